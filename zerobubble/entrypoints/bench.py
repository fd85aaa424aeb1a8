"""Entry point of ``zerobubble bench``: load the rows, run them on the chosen backend, print and
write the report; ``zerobubble bench plot`` draws reports (see :mod:`zerobubble.bench_plot`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import grpc.aio

from zerobubble.bench import BenchRow, format_summary, load_dataset, run_bench_async
from zerobubble.bench_openai import OpenAIBackendError, run_openai_bench_async
from zerobubble.client import ChannelSettings, format_rpc_error
from zerobubble.config import ConfigError, check_event_loop
from zerobubble.event_loop import run_loop


def load_rows(args: argparse.Namespace) -> list[BenchRow]:
    """The rows ``bench`` sends: ``--dataset`` selected by ``--kind``, ``--limit`` and
    ``--max-tokens-cap``, without schemas under ``--no-constraints`` and without predictions
    under ``--no-prediction``.

    Raises:
        OSError: the dataset cannot be read.
        ValueError: it holds an invalid row.
    """
    return load_dataset(
        args.dataset,
        kind=args.kind,
        limit=args.limit,
        max_tokens_cap=args.max_tokens_cap,
        constraints=args.constraints,
        predictions=args.prediction,
    )


class _UsageError(Exception):
    """The flags or the dataset cannot make a run (exit status 2)."""


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of ``zerobubble bench``; returns the exit status (1 when any request failed)."""
    if getattr(args, "bench_command", None) == "plot":
        from zerobubble.bench_plot import run_plot  # matplotlib only for plots

        return run_plot(args)
    try:
        rows = _checked_rows(args)
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        report = _run_backend(args, rows)
    except grpc.aio.AioRpcError as exc:
        print(f"error: {format_rpc_error(exc)}", file=sys.stderr)
        return 1
    except (OpenAIBackendError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_summary(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"report written to {args.json}")
    return 1 if report["num_errors"] else 0


def _checked_rows(args: argparse.Namespace) -> list[BenchRow]:
    """The dataset's selected rows, once the flags can make a run."""
    if not args.dataset:
        raise _UsageError("--dataset is required")
    try:
        check_event_loop(args.event_loop)
    except ConfigError as exc:
        raise _UsageError(str(exc)) from exc
    try:
        rows = load_rows(args)
    except (OSError, ValueError) as exc:
        raise _UsageError(str(exc)) from exc
    if not rows:
        raise _UsageError(f"no rows selected from {args.dataset}" + (f" with kind {args.kind!r}" if args.kind else ""))
    return rows


def _run_backend(args: argparse.Namespace, rows: list[BenchRow]) -> dict[str, Any]:
    """Send `rows` to the server `--backend` names; the report."""
    if args.backend == "openai":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
        return run_loop(
            run_openai_bench_async(
                args.base_url,
                rows,
                args.concurrency,
                request_rate=args.request_rate,
                model=args.model_name,
                api_key=args.auth_token,
                progress=args.progress,
            ),
            args.event_loop,
        )
    return run_loop(
        run_bench_async(
            ChannelSettings.from_args(args),
            rows,
            args.concurrency,
            request_rate=args.request_rate,
            progress=args.progress,
            connect_timeout=args.connect_timeout,
            num_connections=args.connections,
        ),
        args.event_loop,
    )
