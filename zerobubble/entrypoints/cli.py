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
import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerobubble.config import (
    EVENT_LOOPS,
    LOG_LEVELS,
    ConfigError,
    FrontConfig,
    SchedulerServiceConfig,
    WorkerConfig,
    apply_grpc_defaults,
    env_name,
    flag_name,
    from_namespace,
    parse_bool,
    parse_setting,
    serve_config,
    service_settings,
    setting_info,
)

# argparse's exit status for a usage error; a model `--model` cannot serve is one too.
USAGE_ERROR = 2


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

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
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

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


def env_converter(
    default: Any, type: Callable[[str], Any], choices: Sequence[Any] | None, repeat: bool
) -> Callable[[str], Any]:
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
    convert: Callable[[str], Any] | None = None,
) -> None:
    """Add ``flag`` with its ``ZEROBUBBLE_*`` environment fallback (the parser must be a :class:`Parser`).

    A bool ``default`` makes a ``--flag/--no-flag`` pair; ``repeat`` a list flag given once per
    value. An empty variable counts as unset. ``env`` replaces ``os.environ`` (tests).
    ``convert`` reads the variable (default: from ``type``, ``choices`` and ``repeat``).
    """
    name = env_name(flag)
    raw = (os.environ if env is None else env).get(name, "")
    value: Any = EnvDefault(name, raw, convert or env_converter(default, type, choices, repeat)) if raw else default
    shown = repr(raw) if raw else "on" if default is True else "off" if default is False else repr(default)
    # argparse %-formats help strings.
    full_help = f"{help} [env {name}; default {shown.replace('%', '%%')}]"
    if isinstance(default, bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=full_help)
    elif repeat:
        group.add_argument(
            flag, action=_AppendReplacingDefault, type=type, choices=choices, default=value, help=full_help
        )
    else:
        group.add_argument(flag, type=type, choices=choices, default=value, help=full_help)


def add_logging_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """``--log-level``, shared by every subcommand."""
    add_flag(
        parser, "--log-level", default="info", choices=LOG_LEVELS, type=str.lower, env=env, help="logging verbosity"
    )


def add_setting_flags(parser: argparse.ArgumentParser, command: str, env: Mapping[str, str] | None) -> None:
    """The flags of a service command, generated from its settings in `zerobubble.config`."""
    groups: dict[type, argparse._ActionsContainer] = {}
    for cls, f in service_settings(command):
        title = cls.__name__.removesuffix("Config").removesuffix("Service").lower() or "settings"
        group = groups.get(cls) or groups.setdefault(cls, parser.add_argument_group(title))
        info = setting_info(f)
        kind: Callable[[str], Any] = type(f.default)
        if info.choices is not None and kind is str:
            kind = str.lower
        add_flag(
            group,
            flag_name(f.name),
            default=f.default,
            help=info.help,
            type=kind,
            choices=info.choices,
            env=env,
            convert=functools.partial(parse_setting, f),
        )


def add_client_flags(group: argparse._ActionsContainer, env: Mapping[str, str] | None) -> None:
    """How ``generate`` and ``bench`` reach the scheduler."""
    add_flag(group, "--target", default="localhost:50051", env=env, help="scheduler address HOST:PORT")
    add_flag(group, "--tls-ca", default="", env=env, help="PEM CA of the server certificate; TLS is on when set")
    add_flag(group, "--tls-cert", default="", env=env, help="PEM client certificate (mutual TLS)")
    add_flag(group, "--tls-key", default="", env=env, help="PEM private key of --tls-cert")
    add_flag(group, "--auth-token", default="", env=env, help="bearer token sent as 'authorization'")
    add_flag(
        group,
        "--connect-timeout",
        default=10.0,
        type=float,
        env=env,
        help="seconds to wait for the connection before giving up",
    )


def add_generate_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """Input, sampling and output flags of ``generate``."""
    # Not an argparse-required group: the env fallbacks would not count as "given".
    # run_generate checks that exactly one input is set.
    inputs = parser.add_argument_group("input (exactly one)")
    add_flag(inputs, "--prompt", default="", env=env, help="raw prompt text (no chat template)")
    add_flag(
        inputs,
        "--messages-json",
        default="",
        env=env,
        help='chat messages as JSON: [{"role": "user", "content": "..."}]',
    )
    add_flag(
        inputs,
        "--chat",
        default=False,
        env=env,
        help="send --prompt as one user chat message, so the model's chat template applies",
    )
    sampling = parser.add_argument_group("sampling and stopping")
    add_flag(sampling, "--max-tokens", default=0, type=int, env=env, help="output token limit (0 = server default)")
    add_flag(sampling, "--temperature", default=0.0, type=float, env=env, help="0 = greedy")
    add_flag(sampling, "--seed", default=-1, type=int, env=env, help="sampling seed (-1 = server picks)")
    add_flag(sampling, "--top-k", default=0, type=int, env=env, help="0 = off")
    add_flag(sampling, "--top-p", default=1.0, type=float, env=env, help="nucleus probability mass in (0, 1]")
    add_flag(sampling, "--stop", default=[], repeat=True, env=env, help="stop string, repeatable")
    add_flag(sampling, "--timeout", default=0.0, type=float, env=env, help="whole-request deadline in s (0 = none)")
    structured = parser.add_argument_group("structured output (at most one)")
    add_flag(
        structured, "--json-schema", default="", env=env, help="output matches this JSON schema (JSON text or a file)"
    )
    add_flag(structured, "--regex", default="", env=env, help="output matches this regex (whole)")
    add_flag(
        structured, "--choice", default=[], repeat=True, env=env, help="output is one of these: A,B,... or repeated"
    )
    add_flag(structured, "--grammar", default="", env=env, help="output follows this Lark or GBNF grammar file")
    add_flag(
        parser,
        "--json",
        default=False,
        env=env,
        help="print one JSON object (text, token_ids, finish_reason, timings) instead of streaming",
    )


def add_bench_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """Dataset and load flags of ``bench``."""
    _add_bench_load_flags(parser, env)
    _add_bench_backend_flags(parser, env)
    _add_bench_row_flags(parser, env)
    add_flag(parser, "--json", default="", env=env, help="write the full report (per request too) to this file")
    add_flag(parser, "--progress", default=True, env=env, help="progress bar when stdout is a terminal")


def _add_bench_load_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """What ``bench`` sends and how fast."""
    add_flag(
        parser,
        "--dataset",
        default="",
        env=env,
        help="JSONL file (messages|prompt, max_tokens, kind, ...) or a shipped workload's name: grounded, "
        "structured, edits",
    )
    add_flag(
        parser,
        "--concurrency",
        default=8,
        type=int,
        env=env,
        help="requests in flight at once (with --request-rate: the most in flight)",
    )
    add_flag(
        parser,
        "--request-rate",
        default=0.0,
        type=float,
        env=env,
        help="open loop: Poisson arrivals at this many requests/s (0 = closed loop at --concurrency)",
    )
    add_flag(
        parser,
        "--connections",
        default=1,
        type=int,
        env=env,
        help="gRPC connections to --target, requests spread round-robin: a scheduler's --fronts share "
        "its port by connection, so one connection reaches one front (1 = all requests on one)",
    )
    add_flag(
        parser,
        "--event-loop",
        default="auto",
        type=str.lower,
        choices=EVENT_LOOPS,
        env=env,
        help="the client's asyncio event loop: uvloop (less CPU per message read), the standard library's, "
        "or auto = uvloop where it is installed",
    )


def _add_bench_backend_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """Which server ``bench`` sends to."""
    add_flag(
        parser,
        "--backend",
        default="grpc",
        choices=("grpc", "openai"),
        env=env,
        help="grpc: our scheduler at --target; openai: any OpenAI-compatible server at --base-url",
    )
    add_flag(
        parser,
        "--base-url",
        default="http://localhost:8000/v1",
        env=env,
        help="OpenAI-compatible API root for --backend openai",
    )
    add_flag(
        parser,
        "--model-name",
        default="",
        env=env,
        help="model to ask for with --backend openai (empty = the first of /v1/models)",
    )


def _add_bench_row_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    """Which of the dataset's rows ``bench`` sends, and with what."""
    add_flag(parser, "--kind", default="", env=env, help="only rows whose 'kind' equals this")
    add_flag(parser, "--limit", default=0, type=int, env=env, help="first N rows after --kind (0 = all)")
    add_flag(parser, "--max-tokens-cap", default=0, type=int, env=env, help="cap every row's max_tokens (0 = off)")
    add_flag(
        parser,
        "--constraints",
        default=True,
        env=env,
        help="constrain rows that carry a 'schema' to it (--no-constraints: the same rows unconstrained)",
    )
    add_flag(
        parser,
        "--prediction",
        default=True,
        env=env,
        help="send a row's 'prediction' as the request's predicted output (--no-prediction: the same rows without it)",
    )


def build_parser(env: Mapping[str, str] | None = None) -> Parser:
    """The whole CLI; ``env`` replaces ``os.environ`` for the fallbacks (tests)."""
    parser = Parser(prog="zerobubble", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for command, help in (
        ("serve", "scheduler + one local worker (or --workers) in one process"),
        ("worker", "one worker service (a model replica)"),
        ("scheduler", "the scheduler service (client API)"),
        ("front", "a client-facing front process relaying Generate calls to a scheduler"),
    ):
        add_setting_flags(sub.add_parser(command, help=help), command, env)

    generate = sub.add_parser("generate", help="send one request and stream the reply")
    add_logging_flags(generate, env)
    add_client_flags(generate.add_argument_group("connection"), env)
    add_generate_flags(generate, env)

    bench = sub.add_parser("bench", help="replay a JSONL dataset at a given concurrency")
    add_logging_flags(bench, env)
    add_client_flags(bench.add_argument_group("connection"), env)
    add_bench_flags(bench, env)
    # `zerobubble bench plot A.json B.json -o OUT.png`; plain `zerobubble bench` runs a benchmark.
    bench_sub = bench.add_subparsers(dest="bench_command", required=False, metavar="{plot}")
    plot = bench_sub.add_parser("plot", help="draw throughput and TTFT / inter-token CDFs of bench reports")
    plot.add_argument("reports", nargs="+", help="bench --json reports (the file name labels the run)")
    plot.add_argument("-o", "--output", required=True, help="image to write (.png, .svg, .pdf)")
    plot.add_argument("--title", default="", help="figure title")
    return parser


def dispatch(args: argparse.Namespace) -> int | None:
    """Run the chosen subcommand; its return value is the exit status (None = 0).

    Service configs are built and validated here, so a bad combination of flags is a usage
    error naming them, before any model is loaded.
    """
    if args.command == "serve":
        from zerobubble.entrypoints.serve import run_serve

        run_serve(serve_config(args))
        return None
    if args.command == "worker":
        from zerobubble.worker_svc.model_loader import ModelLoadError
        from zerobubble.worker_svc.server import run_worker

        try:
            run_worker(from_namespace(WorkerConfig, args))
        except ModelLoadError as exc:
            # A model that is missing, malformed or of an unsupported family is the user's input:
            # one line naming it and what is wrong (and, for a family, the supported ones).
            print(f"zerobubble worker: error: {exc}", file=sys.stderr)
            return USAGE_ERROR
        return None
    if args.command == "scheduler":
        from zerobubble.scheduler_svc.server import run_scheduler

        run_scheduler(from_namespace(SchedulerServiceConfig, args))
        return None
    if args.command == "front":
        from zerobubble.scheduler_svc.front import run_front

        run_front(from_namespace(FrontConfig, args))
        return None
    if args.command == "generate":
        from zerobubble.client import run_generate

        return run_generate(args)
    if args.command == "bench":
        from zerobubble.entrypoints.bench import run_bench

        return run_bench(args)
    raise AssertionError(f"unhandled command {args.command!r}")


def check_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate a service command's config; a bad combination is a usage error (exit 2)."""
    try:
        if args.command == "serve":
            serve_config(args).validate()
        elif args.command == "worker":
            from_namespace(WorkerConfig, args).validate()
        elif args.command == "front":
            from_namespace(FrontConfig, args).validate()
        elif args.command == "scheduler":
            from_namespace(SchedulerServiceConfig, args).validate()
    except ConfigError as exc:
        parser.error(f"{args.command}: {exc}")


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    apply_grpc_defaults(os.environ)  # before any command imports grpc
    parser = build_parser()
    args = parser.parse_args(argv)
    check_config(parser, args)
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
