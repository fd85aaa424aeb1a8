"""device_check.json and device_check.md, rewritten after every section."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from device_check.common import FAIL, PASS, SKIP, Context, write_atomic


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


# Sections whose measured rows get a table of their own, with these columns.
VALUE_TABLES = {
    "throughput": [
        "none_sync_tok_s",
        "none_async_tok_s",
        "ngram_sync_tok_s",
        "ngram_async_tok_s",
        "async_over_sync_none",
        "async_over_sync_ngram",
        "ngram_over_none_async",
        "eagle_sync_tok_s",
        "eagle_async_tok_s",
        "async_over_sync_eagle",
        "none_async_gpu_busy",
        "ngram_async_gpu_busy",
        "eagle_async_gpu_busy",
        "none_sync_gpu_busy",
    ],
    "served": [
        "sync_tok_s",
        "async_tok_s",
        "async_over_sync",
        "sync_worker_idle",
        "async_worker_idle",
        "sync_ms_per_step",
        "async_ms_per_step",
        "async_clients_ms_per_step",
        "async_scheduler_cpu_ms_per_step",
        "async_acceptance",
    ],
}


def markdown(ctx: Context, meta: dict[str, Any]) -> str:
    """The report as markdown: environment, one table of checks, one table per measured section."""
    lines = [
        f"# device check ({'dry run, ' if ctx.dry_run else ''}{meta['device_name']})"
        + ("" if meta.get("complete", True) else " — incomplete: out of time"),
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, {meta['when']}, {meta['total_s']:.0f} s"
        f" (budget {meta['time_budget_s']:.0f} s)",
        "",
        "| section | check | status | detail |",
        "|---|---|---|---|",
    ]
    for r in ctx.records:
        if r.section not in VALUE_TABLES or r.status != PASS or not r.values:
            lines.append(f"| {r.section} | {r.name} | {r.status.upper()} | {r.detail.replace('|', '/')[:300]} |")
    for section, cols in VALUE_TABLES.items():
        rows = [r for r in ctx.records if r.section == section and r.status == PASS and r.values]
        if rows:
            lines += ["", f"| {section} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            for r in rows:
                lines.append(f"| {r.name} | " + " | ".join(_fmt(r.values.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_report(ctx: Context, meta: dict[str, Any], started: float) -> bool:
    """Write device_check.json and .md as they stand (after every section); True when all pass."""
    meta["total_s"] = time.perf_counter() - started
    # Sections skipped for time (or cut by SIGTERM) leave the run incomplete, not failed.
    meta["complete"] = not any(r.status == SKIP and "out of time" in r.detail for r in ctx.records) and not any(
        r.section == "run" for r in ctx.records
    )
    failed = [r for r in ctx.records if r.status == FAIL]
    report = dict(meta, ok=not failed, records=[asdict(r) for r in ctx.records])
    write_atomic(ctx.out_dir / "device_check.json", json.dumps(report, indent=2))
    write_atomic(ctx.out_dir / "device_check.md", markdown(ctx, meta))
    return not failed
