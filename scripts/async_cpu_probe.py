"""Where async + n-gram loses to sync on a CPU: worker busy ms per step under variants.

    python scripts/async_cpu_probe.py --rows 4 --repeats 2

Each variant is one worker process (n-gram k=3); for it, sync (1 plan in flight) and async (2)
schedulers run the same rows at concurrency 1, interleaved (the order reverses every round).
`--with-at-once` adds async with plans ahead sent at once (`--lookahead-margin-ms -1`) to
compare with the just-in-time default. Reported per run: tokens/s, TTFT p50, worker busy ms
per step (ModelInfo.stats), idle fraction; per configuration: tokens/s over all its runs.

`--paired` instead keeps a sync and an async stack (one worker and one scheduler each) up
side by side and sends each batch of `--concurrency` rows to both in turn, the order swapping
every batch. A batch takes seconds, so the VM's speed, which drifts by up to 20 % within
minutes here, is nearly the same for both halves of a pair; the report is the distribution
of the pairs' async ÷ sync tokens/s and of their TTFT differences.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerobubble.bench import BenchRow, load_dataset, run_bench_async  # noqa: E402
from zerobubble.tools.launch import start_scheduler, start_worker, wait_serving  # noqa: E402

DATASET = ROOT.parent / "shared" / "workloads" / "grounded.jsonl"


def each_thread(pid: int, apply: Callable[[int], object]) -> None:
    """`apply(tid)` for every thread of process `pid` (affinity and nice values are per thread
    on Linux); threads that end meanwhile are skipped."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            apply(int(tid))
        except ProcessLookupError:
            pass


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` on `cores`."""
    each_thread(pid, lambda tid: os.sched_setaffinity(tid, cores))


def renice(pid: int, niceness: int) -> None:
    """Every thread of process `pid` at `niceness`."""
    each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, niceness))


def paired(rows: list[BenchRow], concurrency: int, repeats: int) -> None:
    """Sync and async stacks side by side; every batch of rows runs on both (see the docstring)."""
    stacks = {}
    try:
        for cname, inflight in (("sync", 1), ("async", 2)):
            worker = start_worker(kv_cache_memory_gb=0.5, spec_method="ngram", num_spec_tokens=3)
            stacks[cname] = (worker, start_scheduler([worker], max_inflight_steps=inflight))
            wait_serving(stacks[cname][1].target)
            # Not counted: a stack's first requests pay one-time costs (oneDNN's first calls).
            asyncio.run(run_bench_async(stacks[cname][1].target, rows[:1], 1, request_timeout=1800))
        batches = [rows[i : i + concurrency] for i in range(0, len(rows), concurrency)]
        ratios: list[float] = []
        ttft_deltas: list[float] = []
        for round_ in range(repeats):
            for b, batch in enumerate(batches):
                order = ("sync", "async") if (round_ + b) % 2 == 0 else ("async", "sync")
                res = {
                    cname: asyncio.run(run_bench_async(stacks[cname][1].target, batch, concurrency)) for cname in order
                }
                ratio = res["async"]["output_tokens_per_s"] / res["sync"]["output_tokens_per_s"]
                delta = res["async"]["ttft_p50_s"] - res["sync"]["ttft_p50_s"]
                ratios.append(ratio)
                ttft_deltas.append(delta)
                print(
                    f"round {round_} batch {b}: sync {res['sync']['output_tokens_per_s']:.1f} tok/s, "
                    f"async {res['async']['output_tokens_per_s']:.1f} ({ratio:.3f}); "
                    f"ttft p50 async - sync {1000 * delta:+.1f} ms",
                    flush=True,
                )
        geo = statistics.geometric_mean(ratios)
        low, _, high = statistics.quantiles(ratios, n=4)
        print(
            f"== {len(ratios)} pairs at concurrency {concurrency}: async / sync median "
            f"{statistics.median(ratios):.3f}, geometric mean {geo:.3f}, quartiles {low:.3f}-{high:.3f}, "
            f"async ahead in {sum(r > 1 for r in ratios)}; "
            f"ttft p50 async - sync median {1000 * statistics.median(ttft_deltas):+.1f} ms",
            flush=True,
        )
    finally:
        for worker, sched in stacks.values():
            sched.stop()
            worker.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=["default", "bound"])
    p.add_argument("--with-at-once", action="store_true", help="also async with plans ahead sent at once")
    p.add_argument("--paired", action="store_true", help="sync and async stacks side by side, batch by batch")
    args = p.parse_args()
    if args.paired:
        paired(load_dataset(DATASET, limit=args.rows, max_tokens_cap=0), args.concurrency, args.repeats)
        return
    # (name, scheduler options); everything else is the scheduler's default.
    configs: list[tuple[str, dict]] = [("sync", {"max_inflight_steps": 1}), ("async", {"max_inflight_steps": 2})]
    if args.with_at_once:
        configs.append(("async-at-once", {"max_inflight_steps": 2, "lookahead_margin_ms": -1}))
    rows = load_dataset(DATASET, limit=args.rows, max_tokens_cap=0)
    variants = {
        "default": ({}, {}),
        "threads1": ({"num_threads": 1}, {}),
        "passive": ({}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        # The step thread on the last core; the worker's other threads, the scheduler and this
        # client (the host) on the others.
        "bound": ({"cpu_cores": str(max(os.sched_getaffinity(0)))}, {}),
        # The scheduler and this client at nice 10: they still run beside the step, but the
        # model's threads win the cores when both want them.
        "nice": ({}, {}),
    }
    everything = os.sched_getaffinity(0)
    host = everything - {max(everything)}
    for name in args.variants:
        opts, env = variants[name]
        worker = start_worker(kv_cache_memory_gb=0.5, spec_method="ngram", num_spec_tokens=3, env=env, **opts)
        try:
            totals = {cname: [0, 0.0] for cname, _ in configs}
            for round_ in range(args.repeats):
                for cname, options in configs if round_ % 2 == 0 else configs[::-1]:
                    sched = start_scheduler([worker], **options)
                    try:
                        wait_serving(sched.target)
                        if name == "bound":
                            pin(sched.proc.pid, host)
                            pin(os.getpid(), host)
                        if name == "nice":
                            renice(sched.proc.pid, 10)
                            renice(os.getpid(), 10)
                        res = asyncio.run(run_bench_async(sched.target, rows, args.concurrency, request_timeout=1800))
                    finally:
                        sched.stop()
                    st = res.get("server_stats") or {}
                    totals[cname][0] += res["output_tokens"]
                    totals[cname][1] += res["wall_s"]
                    busy_ms = 1000 * st.get("worker_busy_s", 0.0) / max(1, st.get("num_steps", 1))
                    print(
                        f"{name} {cname}: {res['output_tokens_per_s']:.1f} tok/s, ttft p50 {res['ttft_p50_s']:.3f}s, "
                        f"busy {busy_ms:.1f} ms/step, idle {res.get('worker_idle_fraction')}, stats {st}",
                        flush=True,
                    )
            sync_rate = totals["sync"][0] / totals["sync"][1]
            for cname, (tokens, wall_s) in totals.items():
                print(
                    f"== {name} {cname}: {tokens / wall_s:.2f} tok/s, / sync {tokens / wall_s / sync_rate:.3f}",
                    flush=True,
                )
        finally:
            worker.stop()
            pin(os.getpid(), everything)
            renice(os.getpid(), 0)


if __name__ == "__main__":
    main()
