"""The ``zerobubble`` command line: flags per subcommand, environment fallbacks, and the client
commands run as real processes against a fake scheduler (no model needed)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from zerobubble.api import generate_pb2_grpc
from zerobubble.client import request_from_args
from zerobubble.config import SERVE_WORKER_HIDDEN, WorkerConfig, env_name, parse_bool, serve_config
from zerobubble.entrypoints.cli import build_parser
from zerobubble.entrypoints.serve import worker_command

ROOT = Path(__file__).resolve().parents[2]

LISTEN_FLAGS = {"--host", "--port", "--metrics-port", "--tls-cert", "--tls-key", "--max-num-seqs", "--log-level"}
WORKER_FLAGS = {
    "--model",
    "--dtype",
    "--device",
    "--block-size",
    "--kv-cache-memory-gb",
    "--gpu-memory-utilization",
    "--max-model-len",
    "--spec-method",
    "--num-spec-tokens",
    "--ngram-min",
    "--ngram-max",
    "--draft-model",
    "--worker-id",
    "--num-threads",
    "--prepack-weights",
    "--no-prepack-weights",
}
SCHEDULER_FLAGS = {
    "--workers",
    "--max-inflight-steps",
    "--max-num-batched-tokens",
    "--max-waiting",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--auth-token",
    "--worker-tls-ca",
    "--worker-tls-cert",
    "--worker-tls-key",
}
CLIENT_FLAGS = {"--target", "--tls-ca", "--tls-cert", "--tls-key", "--auth-token", "--log-level"}
GENERATE_FLAGS = {
    "--prompt",
    "--chat",
    "--messages-json",
    "--max-tokens",
    "--temperature",
    "--seed",
    "--top-k",
    "--top-p",
    "--stop",
    "--json",
}
BENCH_FLAGS = {"--dataset", "--concurrency", "--kind", "--limit", "--max-tokens-cap", "--json"}


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The sub-parser of ``name``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def option_strings(parser: argparse.ArgumentParser, name: str) -> set[str]:
    """Every option string a subcommand accepts."""
    return {opt for action in subcommand(parser, name)._actions for opt in action.option_strings}


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    return build_parser(env=env or {}).parse_args(argv)


def test_parser_builds_with_all_subcommands() -> None:
    parser = build_parser(env={})
    for name in ("serve", "worker", "scheduler", "generate", "bench"):
        assert subcommand(parser, name) is not None


@pytest.mark.parametrize(
    ("command", "present", "absent"),
    [
        (
            "worker",
            LISTEN_FLAGS | WORKER_FLAGS | {"--tls-client-ca", "--auth-token", "--drain-timeout"},
            SCHEDULER_FLAGS - {"--auth-token"} | {"--worker-port", "--worker-auth-token"},
        ),
        ("scheduler", LISTEN_FLAGS | SCHEDULER_FLAGS, WORKER_FLAGS | {"--tls-client-ca", "--worker-port"}),
        ("serve", LISTEN_FLAGS | WORKER_FLAGS | SCHEDULER_FLAGS | {"--worker-port"}, {"--tls-client-ca"}),
        ("generate", CLIENT_FLAGS | GENERATE_FLAGS, WORKER_FLAGS | SCHEDULER_FLAGS - {"--auth-token"}),
        ("bench", CLIENT_FLAGS | BENCH_FLAGS, WORKER_FLAGS | {"--prompt"}),
    ],
)
def test_flags_live_in_the_right_subcommands(command: str, present: set[str], absent: set[str]) -> None:
    options = option_strings(build_parser(env={}), command)
    assert present <= options, sorted(present - options)
    assert not (absent & options), sorted(absent & options)


def test_defaults_follow_the_contract() -> None:
    serve = parse(["serve"])
    assert (serve.port, serve.metrics_port, serve.worker_port) == (50051, 9090, 0)
    assert serve.model == "smollm2-135m" and serve.spec_method == "auto" and serve.max_inflight_steps == 2
    assert serve.spec_draft_length == "adaptive"
    assert serve.enable_prefix_caching is True and serve.workers == ""
    worker = parse(["worker"])
    assert (worker.port, worker.metrics_port, worker.block_size, worker.num_spec_tokens) == (50061, 9091, 16, 3)
    assert (worker.dtype, worker.device, worker.max_model_len, worker.kv_cache_memory_gb) == ("auto", "auto", 0, 2.0)
    scheduler = parse(["scheduler"])
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.max_waiting) == (64, 512, 1024)


@pytest.mark.parametrize("prepack", ["--prepack-weights", "--no-prepack-weights"])
def test_serve_passes_its_worker_flags_to_the_local_worker(prepack: str) -> None:
    serve = parse(["serve", "--block-size", "32", "--spec-method", "ngram", prepack])
    argv = worker_command(serve_config(serve))
    assert "--auth-token" not in argv  # its token is a fresh secret, passed in the environment
    worker = parse(argv[argv.index("worker") :])
    for f in dataclasses.fields(WorkerConfig):
        # The local worker listens on loopback without TLS whatever serve itself does; serve's
        # --auth-token is the clients' token, not the worker's; its ranks all run beside it.
        if f.name not in SERVE_WORKER_HIDDEN:
            assert getattr(worker, f.name) == getattr(serve, f.name), f.name
    assert worker.prepack_weights is (prepack == "--prepack-weights")


def test_env_name_is_upper_snake_of_the_flag() -> None:
    assert env_name("--max-inflight-steps") == "ZEROBUBBLE_MAX_INFLIGHT_STEPS"
    assert env_name("--kv-cache-memory-gb") == "ZEROBUBBLE_KV_CACHE_MEMORY_GB"


def test_env_fallbacks_convert_int_float_bool_str() -> None:
    env = {
        "ZEROBUBBLE_MAX_INFLIGHT_STEPS": "3",
        "ZEROBUBBLE_KV_CACHE_MEMORY_GB": "0.5",
        "ZEROBUBBLE_ENABLE_PREFIX_CACHING": "no",
        "ZEROBUBBLE_MODEL": "/models/llama",
        "ZEROBUBBLE_SPEC_METHOD": "ngram",
        "ZEROBUBBLE_LOG_LEVEL": "DEBUG",
    }
    args = parse(["serve"], env)
    assert args.max_inflight_steps == 3
    assert args.kv_cache_memory_gb == 0.5
    assert args.enable_prefix_caching is False
    assert args.model == "/models/llama"
    assert args.spec_method == "ngram"
    assert args.log_level == "debug"


def test_command_line_wins_over_env() -> None:
    env = {"ZEROBUBBLE_MAX_INFLIGHT_STEPS": "3", "ZEROBUBBLE_ENABLE_PREFIX_CACHING": "false"}
    args = parse(["scheduler", "--max-inflight-steps", "1", "--enable-prefix-caching"], env)
    assert args.max_inflight_steps == 1 and args.enable_prefix_caching is True


def test_env_fallback_reaches_every_subcommand_sharing_a_flag() -> None:
    env = {"ZEROBUBBLE_MAX_NUM_SEQS": "8", "ZEROBUBBLE_PORT": "6000"}
    for command in ("serve", "worker", "scheduler"):
        args = parse([command], env)
        assert (args.max_num_seqs, args.port) == (8, 6000)


@pytest.mark.parametrize("word", ["1", "true", "YES", "on"])
def test_parse_bool_true_words(word: str) -> None:
    assert parse_bool(word) is True


@pytest.mark.parametrize("word", ["0", "false", "No", "off"])
def test_parse_bool_false_words(word: str) -> None:
    assert parse_bool(word) is False


@pytest.mark.parametrize(
    "env",
    [
        {"ZEROBUBBLE_MAX_INFLIGHT_STEPS": "two"},
        {"ZEROBUBBLE_KV_CACHE_MEMORY_GB": "lots"},
        {"ZEROBUBBLE_ENABLE_PREFIX_CACHING": "maybe"},
        {"ZEROBUBBLE_DTYPE": "float64"},
    ],
)
def test_invalid_env_values_are_usage_errors_naming_the_variable(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(["serve"], env)
    assert info.value.code == 2
    assert next(iter(env)) in capsys.readouterr().err


def test_a_bad_env_value_only_matters_to_subcommands_that_use_it(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"ZEROBUBBLE_JSON": "report.json", "ZEROBUBBLE_DTYPE": "float64"}
    assert parse(["bench"], env).json == "report.json"
    assert parse(["scheduler"], env).port == 50051
    assert parse(["worker", "--dtype", "float32"], env).dtype == "float32"  # the command line wins
    with pytest.raises(SystemExit):
        parse(["generate", "--prompt", "x"], env)
    assert "ZEROBUBBLE_JSON" in capsys.readouterr().err


def test_chat_flag_sends_the_prompt_as_one_user_message() -> None:
    raw = request_from_args(parse(["generate", "--prompt", "Hello"]))
    assert raw.WhichOneof("input") == "prompt" and raw.prompt == "Hello"
    chat = request_from_args(parse(["generate", "--prompt", "Hello", "--chat"]))
    assert chat.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in chat.messages.messages] == [("user", "Hello")]


def test_empty_env_value_means_unset() -> None:
    assert parse(["worker"], {"ZEROBUBBLE_PORT": ""}).port == 50061


def test_repeated_stop_flag_replaces_env_list() -> None:
    env = {"ZEROBUBBLE_STOP": "a, b\n\nEND"}
    assert parse(["generate", "--prompt", "x"], env).stop == ["a, b", "END"]
    assert parse(["generate", "--prompt", "x", "--stop", "X", "--stop", "Y"], env).stop == ["X", "Y"]
    assert parse(["generate", "--prompt", "x"]).stop == []


def test_unknown_choice_on_command_line_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["worker", "--spec-method", "medusa"])
    assert "invalid choice" in capsys.readouterr().err


def run_cli(*argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``python -m zerobubble ...`` in a clean child process."""
    return subprocess.run(
        [sys.executable, "-m", "zerobubble", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def closed_port() -> int:
    """A loopback port nothing listens on (freed just before use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_generate_against_a_dead_target_fails_fast_with_a_clear_error() -> None:
    result = run_cli("generate", "--target", f"127.0.0.1:{closed_port()}", "--prompt", "hi", "--connect-timeout", "5")
    assert result.returncode == 1
    assert result.stderr.startswith("error: UNAVAILABLE: "), result.stderr
    assert result.stdout == ""


def test_generate_needs_exactly_one_input() -> None:
    result = run_cli("generate", "--target", "127.0.0.1:1")
    assert result.returncode == 2 and "--prompt" in result.stderr
    result = run_cli("generate", "--target", "127.0.0.1:1", "--messages-json", "{not json")
    assert result.returncode == 2 and "not valid JSON" in result.stderr


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_an_unsupported_model_type_is_a_one_line_usage_error(command: str, tmp_path: Path) -> None:
    """A model directory of a family we do not run: exit status 2 and one line naming its type
    and the supported ones, before any port is opened (no traceback)."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    result = run_cli(command, "--model", str(tmp_path), "--port", "0", "--metrics-port", "-1", timeout=120)
    assert result.returncode == 2, result.stderr
    # serve logs that it starts its worker first
    lines = [line for line in result.stderr.strip().splitlines() if " INFO " not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "unsupported model_type 'gpt2'" in lines[0] and str(tmp_path) in lines[0]
    assert all(family in lines[0] for family in ("llama", "gemma2", "gemma3_text", "phi3", "qwen3")), lines[0]


def test_client_commands_do_not_import_torch() -> None:
    code = (
        "import sys, zerobubble.entrypoints.cli, zerobubble.client, zerobubble.bench; "
        "zerobubble.entrypoints.cli.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


@pytest.fixture
def fake_target() -> Iterator[str]:
    """A fake scheduler (see ``test_bench.FakeGeneration``) on its own event-loop thread."""
    from tests.support.fake_generation import FakeGeneration

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_generate_streams_text_and_prints_json(fake_target: str) -> None:
    result = run_cli("generate", "--target", fake_target, "--prompt", "hi", "--max-tokens", "5")
    assert (result.returncode, result.stdout) == (0, "<0><1><2><3><4>\n"), result.stderr
    result = run_cli(
        "generate",
        "--target",
        fake_target,
        "--messages-json",
        '[{"role": "user", "content": "hi"}]',
        "--max-tokens",
        "3",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["text"] == "<0><1><2>" and reply["token_ids"] == [0, 1, 2]
    assert reply["finish_reason"] == "max_tokens" and reply["num_prompt_tokens"] == 3
    assert reply["ttft_s"] <= reply["e2e_s"]


def test_generate_reports_server_errors(fake_target: str) -> None:
    result = run_cli("generate", "--target", fake_target, "--prompt", "fail")
    assert result.returncode == 1 and result.stderr.startswith("error: INVALID_ARGUMENT: told to fail")


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_bench_command_writes_the_report(fake_target: str, tmp_path: Path, event_loop: str) -> None:
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "max_tokens": 2 + i, "kind": "a" if i % 2 else "b"}) + "\n" for i in range(6)
        ),
        encoding="utf-8",
    )
    out = tmp_path / "report.json"
    result = run_cli(
        "bench",
        "--target",
        fake_target,
        "--dataset",
        str(dataset),
        "--concurrency",
        "2",
        "--kind",
        "a",
        "--event-loop",
        event_loop,
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "output tok/s" in result.stdout
    report = json.loads(out.read_text(encoding="utf-8"))
    assert [r["index"] for r in report["requests"]] == [1, 3, 5]
    assert report["output_tokens"] == 3 + 5 + 7 and report["concurrency"] == 2
    for key in (
        "wall_s",
        "output_tokens_per_s",
        "requests_per_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p90_s",
        "itl_p99_s",
        "e2e_p50_s",
        "acceptance_rate",
        "mean_accepted_length",
        "worker_idle_fraction",
    ):
        assert key in report


def test_bench_against_a_dead_target_fails_fast(tmp_path: Path) -> None:
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"prompt": "p", "max_tokens": 2}\n', encoding="utf-8")
    result = run_cli("bench", "--target", f"127.0.0.1:{closed_port()}", "--dataset", str(dataset))
    assert result.returncode == 1 and result.stderr.startswith("error: UNAVAILABLE: ")
