"""`zerobubble.config` owns every service setting: flags, env fallbacks and inner defaults follow it."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_svc.scheduler import SchedulerConfig
from zerobubble.config import (
    ConfigError,
    SchedulerServiceConfig,
    WorkerConfig,
    env_name,
    flag_name,
    from_env,
    secret_settings,
    service_settings,
    setting_info,
)
from zerobubble.entrypoints.cli import build_parser, check_config


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
    for name in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "max_waiting"):
        assert getattr(inner, name) == getattr(service, name), name
    assert SchedulerConfig.from_service(SchedulerServiceConfig(max_num_seqs=5)).max_num_seqs == 5


def test_draft_without_a_draft_model_is_a_usage_error_naming_the_flags(capsys) -> None:
    err = _usage_error(["serve", "--spec-method", "draft"], capsys)
    assert "--spec-method draft" in err and "--draft-model" in err
    err = _usage_error(["worker", "--draft-model", "/m", "--spec-method", "ngram"], capsys)
    assert "--draft-model" in err and "--spec-method" in err


@pytest.mark.parametrize(
    "argv, flags",
    [
        (["worker", "--ngram-min", "5", "--ngram-max", "2", "--spec-method", "ngram"], ["--ngram-min", "--ngram-max"]),
        (["scheduler", "--workers", "w:1", "--max-inflight-steps", "0"], ["--max-inflight-steps"]),
        (["scheduler"], ["--workers"]),
        (["serve", "--tls-cert", "/c.pem"], ["--tls-cert", "--tls-key"]),
        (["serve", "--max-num-seqs", "0"], ["--max-num-seqs"]),
    ],
)
def test_bad_combinations_name_their_flags(argv: list[str], flags: list[str], capsys) -> None:
    err = _usage_error(argv, capsys)
    for flag in flags:
        assert flag in err, (flag, err)


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


def test_credentials_are_secret_settings() -> None:
    assert {"auth_token", "tls_key", "tls_cert", "worker_tls_key"} <= secret_settings()
    assert "model" not in secret_settings()
    assert all(dataclasses.is_dataclass(cls) for cls, _ in service_settings("serve"))
