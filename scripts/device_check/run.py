"""Sections in processes of their own within the time budget; the command line."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import device_check
from device_check.common import FAIL, PACKAGE_DIR, REPO_ROOT, SKIP, Context, OutOfTime, Record, logger
from device_check.environment import check_environment
from device_check.families import check_families
from device_check.kernels import check_kernels
from device_check.report import write_report
from device_check.roofline import check_roofline
from device_check.served import check_served
from device_check.service import check_service
from device_check.sync_free import check_sync_free
from device_check.throughput import check_throughput

SECTIONS: dict[str, Callable[[Context], None]] = {
    "environment": check_environment,
    "kernels": check_kernels,
    "families": check_families,
    "service": check_service,
    "sync_free": check_sync_free,
    "roofline": check_roofline,
    "throughput": check_throughput,
    "served": check_served,  # last: what the budget leaves (its eager half is the least news)
}


def run_in_process(name: str, ctx: Context) -> None:
    """One section here; an exception it raises becomes a record (in its own process too)."""
    try:
        SECTIONS[name](ctx)
    except Exception as exc:  # one broken section must not hide the others' findings
        tb = traceback.format_exc()[-3000:]
        ctx.add(name, "section", FAIL, f"{type(exc).__name__}: {exc}", traceback=tb)


def run_section(name: str, ctx: Context, args: argparse.Namespace) -> None:
    """One section in a process of its own (``--part``); its records join ``ctx``.

    A section that outlives the time left is killed; the records it wrote before stay.
    """
    part = ctx.out_dir / f".part-{name}.json"
    part.unlink(missing_ok=True)
    cmd = [sys.executable, str(PACKAGE_DIR), str(ctx.out_dir), "--only", name, "--part", str(part)]
    cmd += ["--time-budget", f"{max(ctx.time_left(), 1.0):.0f}"] + (["--dry-run"] if args.dry_run else [])
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    killed = False
    try:
        # A little grace past the budget: the section's own loops stop at its deadline.
        proc.wait(timeout=max(ctx.time_left(), 1.0) + 15)
    except subprocess.TimeoutExpired:
        killed = True
    finally:  # also on SIGTERM (OutOfTime): stop the section, keep what it found
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if part.exists():
            ctx.records.extend(Record(**r) for r in json.loads(part.read_text()))
            part.unlink()
    if killed:
        ctx.add(name, "section", FAIL, "stopped: still running when the time budget ran out")
    elif proc.returncode != 0:
        ctx.add(name, "section", FAIL, f"its process exited with {proc.returncode} (output above in the log)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(device_check.__doc__ or "").split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder for device_check.json and device_check.md")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU; CUDA-only parts are skipped")
    parser.add_argument("--only", default="", help="comma-separated sections (default: all): " + ", ".join(SECTIONS))
    parser.add_argument(
        "--time-budget",
        type=float,
        default=420.0,
        help="seconds for all sections: one still running then is stopped, later ones are skipped",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each section in a process of its own (a CUDA error or a hang costs that section only)",
    )
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)  # a section's process: records here
    return parser


def _run_meta(cuda: bool, dry_run: bool, time_budget_s: float) -> dict[str, Any]:
    """The report's head: the machine, the versions, when, and how the run was asked for."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return dict(
        device_name=torch.cuda.get_device_name(0) if cuda else "cpu",
        torch=torch.__version__,
        triton=triton_version,
        python=platform.python_version(),
        when=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        dry_run=dry_run,
        time_budget_s=time_budget_s,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.dry_run
    ctx = Context(
        device=torch.device("cuda" if cuda else "cpu"),
        dry_run=args.dry_run or not cuda,
        out_dir=args.out_dir,
        deadline=started + args.time_budget,
        part_file=args.part,
    )
    if not cuda and not args.dry_run:
        logger.warning("no CUDA device: running the dry run instead")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    selected = [s for s in args.only.split(",") if s] or list(SECTIONS)
    if args.part is not None:  # one section, in its own process, for the parent's report
        for name in selected:
            run_in_process(name, ctx)
        return 0

    def on_term(signum: int, frame: Any) -> None:
        raise OutOfTime

    signal.signal(signal.SIGTERM, on_term)
    meta = _run_meta(cuda, ctx.dry_run, args.time_budget)
    try:
        for name in selected:
            section_started = time.perf_counter()
            if ctx.time_left() < 10:
                ctx.add(name, "section", SKIP, "out of time (--time-budget)")
            elif args.isolate:
                run_section(name, ctx, args)
            else:
                run_in_process(name, ctx)
            logger.info("section %s took %.1f s", name, time.perf_counter() - section_started)
            write_report(ctx, meta, started)
    except OutOfTime:
        ctx.add("run", "SIGTERM", FAIL, "terminated (the wrapper's timeout): the report holds what was found")
    ok = write_report(ctx, meta, started)
    num_failed = sum(r.status == FAIL for r in ctx.records)
    logger.info("%d checks, %d failed; report in %s", len(ctx.records), num_failed, args.out_dir)
    return 0 if ok else 1
