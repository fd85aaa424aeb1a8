"""`zerobubble.config` owns every service setting: flags, env fallbacks and inner defaults follow it."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util

import pytest

from zerobubble.config import (
    GRPC_EXPERIMENTS_DEFAULT,
    ConfigError,
    FrontConfig,
    SchedulerServiceConfig,
    WorkerConfig,
    apply_grpc_defaults,
    check_scheduler_fits_worker,
    env_name,
    flag_name,
    from_env,
    secret_settings,
    service_settings,
    setting_info,
)
from zerobubble.entrypoints.cli import build_parser, check_config
from zerobubble.rpc import run_service
from zerobubble.scheduler_svc.scheduler import SchedulerConfig


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = build_parser(env={})
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit) as info:
        check_config(parser, args)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "worker", "scheduler"])
def test_every_setting_is_a_documented_flag_with_an_env_fallback(command: str) -> None:
    settings = service_settings(command)
    names = [f.name for _, f in settings]
    assert len(names) == len(set(names))
    help_text = build_parser(env={})._subparsers._group_actions[0].choices[command].format_help()  # type: ignore[union-attr]
    for _, f in settings:
        assert setting_info(f).help, f.name
        assert flag_name(f.name) in help_text and env_name(f.name) in help_text, f.name
    env = {
        env_name(f.name): str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
        for _, f in settings
        if f.default != ""
    }
    env[env_name("max_num_seqs")] = "7"
    args = build_parser(env=env).parse_args([command] + (["--workers", "w:1"] if command == "scheduler" else []))
    assert args.max_num_seqs == 7


def test_inner_configs_take_their_defaults_from_the_settings() -> None:
    service = SchedulerServiceConfig()
    inner = SchedulerConfig()
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "max_waiting",
        "spec_disable_batch_size",
        "spec_draft_length",
    ):
        assert getattr(inner, name) == getattr(service, name), name
    assert SchedulerConfig.from_service(SchedulerServiceConfig(max_num_seqs=5)).max_num_seqs == 5


def test_draft_without_a_draft_model_is_a_usage_error_naming_the_flags(capsys) -> None:
    err = _usage_error(["serve", "--spec-method", "draft"], capsys)
    assert "--spec-method draft" in err and "--draft-model" in err
    err = _usage_error(["worker", "--draft-model", "/m", "--spec-method", "ngram"], capsys)
    assert "--draft-model" in err and "--spec-method" in err
    err = _usage_error(["worker", "--spec-method", "eagle"], capsys)
    assert "--spec-method eagle" in err and "--draft-model" in err


@pytest.mark.parametrize(
    "argv, flags",
    [
        (["worker", "--ngram-min", "5", "--ngram-max", "2", "--spec-method", "ngram"], ["--ngram-min", "--ngram-max"]),
        (["scheduler", "--workers", "w:1", "--max-inflight-steps", "0"], ["--max-inflight-steps"]),
        (["scheduler"], ["--workers"]),
        (["serve", "--tls-cert", "/c.pem"], ["--tls-cert", "--tls-key"]),
        (["serve", "--max-num-seqs", "0"], ["--max-num-seqs"]),
        (["worker", "--cpu-cores", "3-1"], ["--cpu-cores"]),
        (["worker", "--cpu-cores", "one"], ["--cpu-cores"]),
        (["scheduler", "--workers", "w:1", "--cpu-affinity", "0-"], ["--cpu-affinity"]),
        (["serve", "--cpu-affinity", "4096"], ["--cpu-affinity", "not available"]),
        (["worker", "--cpu-affinity", "4096-4097"], ["--cpu-affinity", "not available"]),
        (["worker", "--cpu-affinity", "0", "--cpu-cores", "0-1"], ["--cpu-cores", "outside --cpu-affinity"]),
        (["serve", "--cpu-affinity", "0", "--loop-cores", "0"], ["--loop-cores", "leaves no core"]),
        (["serve", "--cpu-affinity", "0", "--loop-cores", "1"], ["--loop-cores", "outside --cpu-affinity"]),
        (["serve", "--loop-cores", "x"], ["--loop-cores"]),
        (["serve", "--cpu-affinity", "0", "--loop-cores", "first"], ["--loop-cores first", "leaves no core"]),
        (["serve", "--spec-disable-batch-size", "-1"], ["--spec-disable-batch-size"]),
        (["scheduler", "--workers", "w:1", "--spec-disable-batch-size", "-2"], ["--spec-disable-batch-size"]),
        (["worker", "--device", "cuda", "--quantization", "int8"], ["--quantization int8", "CPU only"]),
        (["worker", "--device", "cuda", "--draft-quantization", "int8"], ["--draft-quantization int8", "CPU only"]),
    ],
)
def test_bad_combinations_name_their_flags(argv: list[str], flags: list[str], capsys) -> None:
    err = _usage_error(argv, capsys)
    for flag in flags:
        assert flag in err, (flag, err)


def test_every_rule_lives_in_the_config_classes() -> None:
    """The rules the CLI applies are the config classes' own: a service given a config built
    in code, and the deploy check reading a container's environment, meet the same ones."""
    with pytest.raises(ConfigError, match="--workers is required"):
        SchedulerServiceConfig().validate()
    SchedulerServiceConfig().validate(needs_workers=False)  # serve starts its own worker
    with pytest.raises(ConfigError, match="--workers is required"):
        from_env(SchedulerServiceConfig, {})
    with pytest.raises(ConfigError, match="max-num-seqs 32 exceeds the 16"):
        check_scheduler_fits_worker(SchedulerServiceConfig(max_num_seqs=32), WorkerConfig(max_num_seqs=16))
    check_scheduler_fits_worker(SchedulerServiceConfig(max_num_seqs=16), WorkerConfig(max_num_seqs=16))
    with pytest.raises(ConfigError, match="SchedulerConfig.num_blocks must be positive"):
        SchedulerConfig(block_size=16, max_model_len=64).validate()


def test_a_service_refuses_a_config_the_cli_would_refuse() -> None:
    from zerobubble.scheduler_svc.front import serve_front
    from zerobubble.scheduler_svc.server import serve_scheduler

    with pytest.raises(ConfigError, match="--workers is required"):
        asyncio.run(serve_scheduler(SchedulerServiceConfig(port=0, metrics_port=-1, http_port=-1)))
    with pytest.raises(ConfigError, match="--max-inflight-steps"):
        asyncio.run(serve_scheduler(SchedulerServiceConfig(max_inflight_steps=0), ["w:1"]))
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key"):
        asyncio.run(serve_front(FrontConfig(tls_cert="/c.pem")))


def test_serve_with_remote_workers_does_not_check_worker_settings(capsys) -> None:
    parser = build_parser(env={})
    check_config(parser, parser.parse_args(["serve", "--workers", "w:1", "--spec-method", "draft"]))


def test_from_env_builds_and_validates_like_the_cli() -> None:
    cfg = from_env(
        WorkerConfig,
        {"ZEROBUBBLE_SPEC_METHOD": "NGRAM", "ZEROBUBBLE_PREPACK_WEIGHTS": "off", "ZEROBUBBLE_BLOCK_SIZE": "32"},
    )
    assert (cfg.spec_method, cfg.prepack_weights, cfg.block_size) == ("ngram", False, 32)
    with pytest.raises(ConfigError, match="ZEROBUBBLE_BLOCK_SIZE='big'"):
        from_env(WorkerConfig, {"ZEROBUBBLE_BLOCK_SIZE": "big"})
    with pytest.raises(ConfigError, match="ZEROBUBBLE_DTYPE='float8'.*choose from"):
        from_env(WorkerConfig, {"ZEROBUBBLE_DTYPE": "float8"})
    with pytest.raises(ConfigError, match="--draft-model"):
        from_env(WorkerConfig, {"ZEROBUBBLE_SPEC_METHOD": "draft"})


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_spec_disable_batch_size_reaches_the_scheduler_from_a_flag_or_the_environment(command: str) -> None:
    """A scheduler setting (the worker's Describe brings k, not the threshold): from the flag,
    else from ``ZEROBUBBLE_SPEC_DISABLE_BATCH_SIZE``, through to the worker-completed config."""
    from zerobubble.api import worker_pb2

    workers = ["--workers", "w:1"] if command == "scheduler" else []
    env = {env_name("spec_disable_batch_size"): "8"}
    for argv, environ, expected in (
        ([], {}, 0),
        ([], env, 8),
        (["--spec-disable-batch-size", "4"], env, 4),
    ):
        args = build_parser(env=environ).parse_args([command, *workers, *argv])
        assert args.spec_disable_batch_size == expected
        service = SchedulerServiceConfig(spec_disable_batch_size=args.spec_disable_batch_size)
        info = worker_pb2.WorkerInfo(num_blocks=8, block_size=4, max_model_len=32, num_spec_tokens=3)
        inner = SchedulerConfig.from_service(service).with_worker(info)
        assert (inner.spec_disable_batch_size, inner.num_spec_tokens) == (expected, 3)
    assert from_env(SchedulerServiceConfig, {**env, "ZEROBUBBLE_WORKERS": "w:1"}).spec_disable_batch_size == 8
    with pytest.raises(ConfigError, match="--spec-disable-batch-size must be >= 0"):
        from_env(SchedulerServiceConfig, {env_name("spec_disable_batch_size"): "-1", "ZEROBUBBLE_WORKERS": "w:1"})


def test_credentials_are_secret_settings() -> None:
    assert {"auth_token", "tls_key", "tls_cert", "worker_tls_key"} <= secret_settings()
    assert "model" not in secret_settings()
    assert all(dataclasses.is_dataclass(cls) for cls, _ in service_settings("serve"))


def test_cpu_cores_read_like_taskset_lists() -> None:
    from zerobubble.config import parse_cores

    assert parse_cores("1") == {1}
    assert parse_cores("0,2,4-6") == {0, 2, 4, 5, 6}
    for bad in ("", "1-", "a", "5-3"):
        with pytest.raises(ValueError):
            parse_cores(bad)


def test_cpu_cores_bind_the_step_thread_and_keep_the_rest_off_them() -> None:
    """In a child process (affinity is per process): the device thread, and a thread it starts
    (as torch starts its OpenMP team), run on --cpu-cores; the worker's own thread on the others."""
    import json
    import os
    import subprocess
    import sys

    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("needs two usable cores")
    code = f"""
import json, os, threading
from zerobubble.worker_svc.server import WorkerConfig, bind_cpu_cores, device_thread
device = device_thread()
bind_cpu_cores(WorkerConfig(cpu_cores="{available[-1]}"), device)
def on_device():
    seen = []
    t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    t.start(); t.join()
    return [sorted(os.sched_getaffinity(0)), seen[0]]
print(json.dumps(device.submit(on_device).result() + [sorted(os.sched_getaffinity(0))]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    step, started, rest = json.loads(out.stdout.strip().splitlines()[-1])
    assert step == started == [available[-1]]
    assert rest == available[:-1]


def test_event_loop_uvloop_without_the_package_is_a_usage_error(monkeypatch, capsys) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real_find_spec(name, *a)
    )
    err = _usage_error(["worker", "--event-loop", "uvloop"], capsys)
    assert "--event-loop uvloop" in err and "not installed" in err
    # auto falls back to asyncio's loop instead (rpc.run_service)
    from_env(WorkerConfig, {"ZEROBUBBLE_EVENT_LOOP": "auto"})


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


@pytest.mark.parametrize("choice", ["auto", "uvloop", "asyncio"])
def test_run_service_runs_on_the_chosen_event_loop(choice: str) -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = run_service(_running_loop(), choice)
    assert isinstance(loop, uvloop.Loop) == (choice != "asyncio"), type(loop)


def test_grpc_runtime_defaults_yield_to_the_environment() -> None:
    unset: dict[str, str] = {}
    apply_grpc_defaults(unset)
    assert unset == {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS_DEFAULT}
    # An operator's choice is kept, gRPC's own defaults (empty) included.
    for chosen in ("", "-event_engine_client"):
        env = {"GRPC_EXPERIMENTS": chosen}
        apply_grpc_defaults(env)
        assert env == {"GRPC_EXPERIMENTS": chosen}


def test_spec_method_auto_resolves_once_when_the_config_is_made() -> None:
    assert WorkerConfig().spec_method == "ngram"  # the default is auto
    assert WorkerConfig(spec_method="auto").speculative
    assert WorkerConfig(spec_method="none").spec_method == "none"
    assert WorkerConfig(spec_method="suffix").spec_method == "suffix"
    assert from_env(WorkerConfig, {"ZEROBUBBLE_SPEC_METHOD": "auto"}).spec_method == "ngram"
    # A simulated device takes n-gram drafts: auto works there too.
    WorkerConfig(simulate_device_ms=1.0).validate()
    with pytest.raises(ConfigError, match="--spec-method draft or eagle"):
        WorkerConfig(draft_model="/m")


def test_spec_method_auto_with_a_draft_model_is_a_usage_error(capsys) -> None:
    err = _usage_error(["worker", "--draft-model", "/m"], capsys)
    assert "--spec-method auto" in err and "--draft-model" in err
