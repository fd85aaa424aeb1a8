"""Where async + n-gram loses to sync on a CPU: worker busy ms per step under variants.

    python scripts/async_cpu_probe.py --rows 4 --repeats 2

Each variant is one worker process (n-gram k=3); for it, sync (1 plan in flight) and async (2)
schedulers run the same rows at concurrency 1, interleaved. Reported per run: tokens/s, steps,
worker busy ms per step (ModelInfo.stats), idle fraction.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerobubble.bench import load_dataset, run_bench_async  # noqa: E402
from zerobubble.tools.launch import start_scheduler, start_worker, wait_serving  # noqa: E402

DATASET = ROOT.parent / "shared" / "workloads" / "grounded.jsonl"


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` on `cores` (a process's mask is per thread on Linux)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=["default", "bound"])
    args = p.parse_args()
    rows = load_dataset(DATASET, limit=args.rows, max_tokens_cap=0)
    variants = {
        "default": ({}, {}),
        "threads1": ({"num_threads": 1}, {}),
        "passive": ({}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        # The step thread on the last core; the worker's other threads, the scheduler and this
        # client (the host) on the others.
        "bound": ({"cpu_cores": str(max(os.sched_getaffinity(0)))}, {}),
    }
    everything = os.sched_getaffinity(0)
    host = everything - {max(everything)}
    for name in args.variants:
        opts, env = variants[name]
        worker = start_worker(kv_cache_memory_gb=0.5, spec_method="ngram", num_spec_tokens=3, env=env, **opts)
        try:
            totals = {1: [0, 0.0], 2: [0, 0.0]}
            for _ in range(args.repeats):
                for inflight in (1, 2):
                    sched = start_scheduler([worker], max_inflight_steps=inflight)
                    try:
                        wait_serving(sched.target)
                        if name == "bound":
                            pin(sched.proc.pid, host)
                            pin(os.getpid(), host)
                        r = asyncio.run(run_bench_async(sched.target, rows, args.concurrency, request_timeout=1800))
                    finally:
                        sched.stop()
                    st = r.get("server_stats") or {}
                    totals[inflight][0] += r["output_tokens"]
                    totals[inflight][1] += r["wall_s"]
                    print(
                        f"{name} inflight={inflight}: {r['output_tokens_per_s']:.1f} tok/s, "
                        f"ttft p50 {r['ttft_p50_s']:.3f}s, idle {r.get('worker_idle_fraction')}, stats {st}",
                        flush=True,
                    )
            ratio = (totals[2][0] / totals[2][1]) / (totals[1][0] / totals[1][1])
            print(f"== {name}: async/sync = {ratio:.3f}", flush=True)
        finally:
            worker.stop()
            pin(os.getpid(), everything)


if __name__ == "__main__":
    main()
