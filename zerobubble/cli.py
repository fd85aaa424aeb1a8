"""The ``zerobubble`` console script: ``serve``, ``worker``, ``scheduler``, ``generate``, ``bench``.

Every flag can also be set through the environment as ``ZEROBUBBLE_<FLAG_IN_UPPER_SNAKE>``
(``--max-inflight-steps`` <-> ``ZEROBUBBLE_MAX_INFLIGHT_STEPS``), which is how the Kubernetes
manifests configure the services. A flag on the command line wins over the environment, which
wins over the built-in default.

The service entry points are imported inside :func:`dispatch` so that ``generate`` and ``bench``
start quickly and never import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

_Config = TypeVar("_Config")


def config_from_args(cls: type[_Config], args: argparse.Namespace) -> _Config:
    """A service's config dataclass filled from the parsed flags of the same names."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


ENV_PREFIX = "ZEROBUBBLE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def env_name(flag: str) -> str:
    """Environment variable that backs ``flag`` (``--max-num-seqs`` -> ``ZEROBUBBLE_MAX_NUM_SEQS``)."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    """Read a boolean the way people write it in environment files."""
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"expected one of 1/true/yes/0/false/no, got {text!r}")


@dataclass(frozen=True, slots=True)
class EnvDefault:
    """A flag default taken from the environment, converted only once its subcommand is chosen.

    Converting while the parser is built would let a variable meant for one subcommand break
    the others (``ZEROBUBBLE_JSON`` is a path for ``bench`` but a bool for ``generate``).
    """

    name: str
    raw: str
    convert: Callable[[str], Any]


class Parser(argparse.ArgumentParser):
    """ArgumentParser that converts the :class:`EnvDefault` values left in a parsed namespace.

    argparse would neither check such defaults against ``choices`` nor parse bools, so a bad
    environment value would run silently; here it is a usage error naming the variable.
    """

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        for dest, value in vars(parsed).items():
            if isinstance(value, EnvDefault):
                try:
                    setattr(parsed, dest, value.convert(value.raw))
                except (ValueError, argparse.ArgumentTypeError) as exc:
                    self.error(f"{value.name}={value.raw!r}: {exc}")
        return parsed, extras


class _AppendReplacingDefault(argparse.Action):
    """``action="append"`` whose first command-line value replaces the default list.

    Plain ``append`` adds to the default, so values from the environment would leak into an
    explicit command line.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


def env_converter(default: Any, type: Callable[[str], Any], choices: Sequence[Any] | None,
                  repeat: bool) -> Callable[[str], Any]:
    """How a flag's environment string becomes its value (bools from 1/true/yes/0/false/no).

    A ``repeat`` flag's variable holds one item per line, because the items (stop strings) may
    contain commas.
    """

    def convert(raw: str) -> Any:
        if isinstance(default, bool):
            return parse_bool(raw)
        value = [type(item) for item in raw.split("\n") if item] if repeat else type(raw)
        if choices is not None and any(v not in choices for v in (value if repeat else [value])):
            raise ValueError(f"choose from {', '.join(map(str, choices))}")
        return value

    return convert


def add_flag(
    group: argparse._ActionsContainer,
    flag: str,
    *,
    default: Any,
    help: str,
    type: Callable[[str], Any] = str,
    choices: Sequence[Any] | None = None,
    repeat: bool = False,
    env: Mapping[str, str] | None = None,
) -> None:
    """Add ``flag`` with its ``ZEROBUBBLE_*`` environment fallback (the parser must be a :class:`Parser`).

    A bool ``default`` makes a ``--flag/--no-flag`` pair; ``repeat`` a list flag given once per
    value. An empty variable counts as unset. ``env`` replaces ``os.environ`` (tests).
    """
    name = env_name(flag)
    raw = (os.environ if env is None else env).get(name, "")
    value: Any = EnvDefault(name, raw, env_converter(default, type, choices, repeat)) if raw else default
    shown = repr(raw) if raw else "on" if default is True else "off" if default is False else repr(default)
    # argparse %-formats help strings.
    full_help = f"{help} [env {name}; default {shown.replace('%', '%%')}]"
    if isinstance(default, bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=full_help)
    elif repeat:
        group.add_argument(flag, action=_AppendReplacingDefault, type=type, choices=choices,
                           default=value, help=full_help)
    else:
        group.add_argument(flag, type=type, choices=choices, default=value, help=full_help)


def add_logging_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """``--log-level``, shared by every subcommand."""
    add_flag(parser, "--log-level", default="info", choices=LOG_LEVELS, type=str.lower, env=env,
             help="logging verbosity")


def add_listen_flags(group: argparse._ActionsContainer, *, port: int, metrics_port: int,
                     env: Mapping[str, str] | None) -> None:
    """Where a service listens and how it secures its gRPC port.

    Defined once because worker and scheduler both listen; only the default ports differ.
    """
    add_flag(group, "--host", default="0.0.0.0", env=env, help="address to bind the gRPC server to")
    add_flag(group, "--port", default=port, type=int, env=env, help="gRPC port (0 = pick a free port)")
    add_flag(group, "--metrics-port", default=metrics_port, type=int, env=env,
             help="Prometheus /metrics port (-1 = off, 0 = pick a free port)")
    add_flag(group, "--tls-cert", default="", env=env, help="PEM server certificate; TLS is on when set")
    add_flag(group, "--tls-key", default="", env=env, help="PEM private key of --tls-cert")
    # The worker sizes its state slots and the scheduler its batches from the same number, so
    # `serve` must not be able to give them two different values.
    add_flag(group, "--max-num-seqs", default=64, type=int, env=env,
             help="most requests running at once")


def add_worker_flags(group: argparse._ActionsContainer, env: Mapping[str, str] | None) -> None:
    """The model, device, KV cache and speculation flags of a worker."""
    add_flag(group, "--model", default="smollm2-135m", env=env,
             help="'smollm2-135m' (embedded), a Hugging Face directory or a .gguf file")
    add_flag(group, "--dtype", default="auto", choices=("auto", "float32", "bfloat16"), env=env,
             help="weights and KV dtype (auto = float32 on CPU, bfloat16 on CUDA)")
    add_flag(group, "--device", default="auto", choices=("auto", "cpu", "cuda"), env=env,
             help="where the model runs (auto = cuda when available)")
    add_flag(group, "--block-size", default=16, type=int, env=env, help="tokens per KV cache block")
    add_flag(group, "--kv-cache-memory-gb", default=2.0, type=float, env=env,
             help="KV cache budget on CPU, in GiB")
    add_flag(group, "--gpu-memory-utilization", default=0.9, type=float, env=env,
             help="fraction of GPU memory the worker may fill (weights + KV cache)")
    add_flag(group, "--max-model-len", default=0, type=int, env=env,
             help="longest sequence in tokens (0 = from the model config, capped at 8192)")
    add_flag(group, "--spec-method", default="none", choices=("none", "ngram", "draft"), env=env,
             help="speculative decoding proposer")
    add_flag(group, "--num-spec-tokens", default=3, type=int, env=env, help="draft tokens per decode step")
    add_flag(group, "--ngram-min", default=2, type=int, env=env, help="shortest n-gram the proposer matches")
    add_flag(group, "--ngram-max", default=4, type=int, env=env, help="longest n-gram the proposer matches")
    add_flag(group, "--draft-model", default="", env=env, help="draft model for --spec-method draft")
    add_flag(group, "--worker-id", default="", env=env,
             help="name in metrics and logs (empty = hostname:port)")
    add_flag(group, "--num-threads", default=0, type=int, env=env,
             help="torch CPU threads (0 = torch default)")
    add_flag(group, "--prepack-weights", default=True, env=env,
             help="CPU: keep linear weights in oneDNN's blocked layout as well (faster decode "
                  "batches; float32 weights then take twice the memory)")


def add_scheduler_flags(group: argparse._ActionsContainer, env: Mapping[str, str] | None) -> None:
    """Admission, batching, worker links and client auth flags of the scheduler."""
    add_flag(group, "--workers", default="", env=env,
             help="workers to drive: 'host:port,host:port' or 'dns:///name:port'")
    add_flag(group, "--max-inflight-steps", default=2, type=int, env=env,
             help="plans sent ahead of their results per worker (1 = synchronous)")
    add_flag(group, "--max-num-batched-tokens", default=512, type=int, env=env,
             help="token budget of one step (prefill chunks + decode slots)")
    add_flag(group, "--max-waiting", default=1024, type=int, env=env,
             help="queued requests beyond which new ones are refused (RESOURCE_EXHAUSTED)")
    add_flag(group, "--enable-prefix-caching", default=True, env=env,
             help="share KV blocks of identical prompt prefixes")
    add_flag(group, "--auth-token", default="", env=env,
             help="bearer token clients must send (empty = no auth)")
    add_flag(group, "--worker-auth-token", default="", env=env,
             help="token sent to the workers' --auth-token (a different secret from the "
                  "clients' --auth-token; empty = none)")
    add_flag(group, "--step-deadline", default=0.0, type=float, env=env,
             help="seconds a worker may take to answer a step before it is declared lost and "
                  "its requests move (0 = max(10 s, 20 x p99 of its recent steps))")
    add_flag(group, "--worker-tls-ca", default="", env=env,
             help="PEM CA that signed the workers' certificates; TLS to workers is on when set")
    add_flag(group, "--worker-tls-cert", default="", env=env, help="PEM client certificate for mutual TLS to workers")
    add_flag(group, "--worker-tls-key", default="", env=env, help="PEM private key of --worker-tls-cert")


def add_client_flags(group: argparse._ActionsContainer, env: Mapping[str, str] | None) -> None:
    """How ``generate`` and ``bench`` reach the scheduler."""
    add_flag(group, "--target", default="localhost:50051", env=env, help="scheduler address HOST:PORT")
    add_flag(group, "--tls-ca", default="", env=env, help="PEM CA of the server certificate; TLS is on when set")
    add_flag(group, "--tls-cert", default="", env=env, help="PEM client certificate (mutual TLS)")
    add_flag(group, "--tls-key", default="", env=env, help="PEM private key of --tls-cert")
    add_flag(group, "--auth-token", default="", env=env, help="bearer token sent as 'authorization'")
    add_flag(group, "--connect-timeout", default=10.0, type=float, env=env,
             help="seconds to wait for the connection before giving up")


def add_generate_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """Input, sampling and output flags of ``generate``."""
    # Not an argparse-required group: the env fallbacks would not count as "given".
    # run_generate checks that exactly one input is set.
    inputs = parser.add_argument_group("input (exactly one)")
    add_flag(inputs, "--prompt", default="", env=env, help="raw prompt text (no chat template)")
    add_flag(inputs, "--messages-json", default="", env=env,
             help='chat messages as JSON: [{"role": "user", "content": "..."}]')
    add_flag(inputs, "--chat", default=False, env=env,
             help="send --prompt as one user chat message, so the model's chat template applies")
    sampling = parser.add_argument_group("sampling and stopping")
    add_flag(sampling, "--max-tokens", default=0, type=int, env=env, help="output token limit (0 = server default)")
    add_flag(sampling, "--temperature", default=0.0, type=float, env=env, help="0 = greedy")
    add_flag(sampling, "--seed", default=-1, type=int, env=env, help="sampling seed (-1 = server picks)")
    add_flag(sampling, "--top-k", default=0, type=int, env=env, help="0 = off")
    add_flag(sampling, "--top-p", default=1.0, type=float, env=env, help="nucleus probability mass in (0, 1]")
    add_flag(sampling, "--stop", default=[], repeat=True, env=env, help="stop string, repeatable")
    add_flag(sampling, "--timeout", default=0.0, type=float, env=env, help="whole-request deadline in s (0 = none)")
    add_flag(parser, "--json", default=False, env=env,
             help="print one JSON object (text, token_ids, finish_reason, timings) instead of streaming")


def add_bench_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """Dataset and load flags of ``bench``."""
    add_flag(parser, "--dataset", default="", env=env, help="JSONL file: messages|prompt, max_tokens, kind, ...")
    add_flag(parser, "--concurrency", default=8, type=int, env=env, help="requests in flight at once")
    add_flag(parser, "--kind", default="", env=env, help="only rows whose 'kind' equals this")
    add_flag(parser, "--limit", default=0, type=int, env=env, help="first N rows after --kind (0 = all)")
    add_flag(parser, "--max-tokens-cap", default=0, type=int, env=env, help="cap every row's max_tokens (0 = off)")
    add_flag(parser, "--json", default="", env=env, help="write the full report (per request too) to this file")
    add_flag(parser, "--progress", default=True, env=env, help="progress bar when stdout is a terminal")


def build_parser(env: Mapping[str, str] | None = None) -> Parser:
    """The whole CLI; ``env`` replaces ``os.environ`` for the fallbacks (tests)."""
    parser = Parser(prog="zerobubble", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="scheduler + one local worker (or --workers) in one process")
    add_logging_flags(serve, env)
    add_listen_flags(serve.add_argument_group("scheduler server"), port=50051, metrics_port=9090, env=env)
    add_flag(serve, "--worker-port", default=0, type=int, env=env,
             help="port of the local worker (0 = pick a free port); its metrics go to the scheduler's port")
    add_worker_flags(serve.add_argument_group("worker"), env)
    add_scheduler_flags(serve.add_argument_group("scheduler"), env)
    add_flag(serve, "--drain-timeout", default=60.0, type=float, env=env,
             help="seconds SIGTERM lets running requests finish before cancelling the rest")

    worker = sub.add_parser("worker", help="one worker service (a model replica)")
    add_logging_flags(worker, env)
    add_listen_flags(worker.add_argument_group("server"), port=50061, metrics_port=9091, env=env)
    add_flag(worker, "--tls-client-ca", default="", env=env,
             help="PEM CA for client certificates; when set, clients must present one (mutual TLS)")
    add_flag(worker, "--auth-token", default="", env=env,
             help="token the scheduler must send (its --worker-auth-token) to use Execute and "
                  "Describe; health stays open (empty = no auth)")
    add_flag(worker, "--drain-timeout", default=30.0, type=float, env=env,
             help="seconds SIGTERM waits for the running steps before ending the stream "
                  "(the manifests' grace period is 30 s)")
    add_worker_flags(worker.add_argument_group("worker"), env)

    scheduler = sub.add_parser("scheduler", help="the scheduler service (client API)")
    add_logging_flags(scheduler, env)
    add_listen_flags(scheduler.add_argument_group("server"), port=50051, metrics_port=9090, env=env)
    add_scheduler_flags(scheduler.add_argument_group("scheduler"), env)
    add_flag(scheduler, "--drain-timeout", default=60.0, type=float, env=env,
             help="seconds SIGTERM lets running requests finish before cancelling the rest "
                  "(the manifests' grace period is 60 s)")

    generate = sub.add_parser("generate", help="send one request and stream the reply")
    add_logging_flags(generate, env)
    add_client_flags(generate.add_argument_group("connection"), env)
    add_generate_flags(generate, env)

    bench = sub.add_parser("bench", help="replay a JSONL dataset at a given concurrency")
    add_logging_flags(bench, env)
    add_client_flags(bench.add_argument_group("connection"), env)
    add_bench_flags(bench, env)
    return parser


def dispatch(args: argparse.Namespace) -> int | None:
    """Run the chosen subcommand; its return value is the exit status (None = 0)."""
    if args.command == "serve":
        from zerobubble.serve import run_serve

        return run_serve(args)
    if args.command == "worker":
        from worker_svc.server import run_worker

        return run_worker(args)
    if args.command == "scheduler":
        from scheduler_svc.server import run_scheduler

        return run_scheduler(args)
    if args.command == "generate":
        from zerobubble.client import run_generate

        return run_generate(args)
    if args.command == "bench":
        from zerobubble.bench import run_bench

        return run_bench(args)
    raise AssertionError(f"unhandled command {args.command!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        status = dispatch(args)
    except KeyboardInterrupt:
        status = 130
    sys.exit(status or 0)


if __name__ == "__main__":
    main()
