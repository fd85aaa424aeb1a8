"""Side-by-side throughput comparisons, each measured in ONE run on the same machine.

    python scripts/bench_matrix.py hf      # ours (async) vs Hugging Face continuous batching, concurrency 16
    python scripts/bench_matrix.py hf --spec-methods none ngram   # ... with and without n-gram speculation
    python scripts/bench_matrix.py async   # async (2 plans in flight) vs sync (1) at concurrency 1, 4, 16
    python scripts/bench_matrix.py async --spec-methods ngram --concurrency 1 16   # ... with n-gram k=3
    python scripts/bench_matrix.py spec    # n-gram k=3 vs no speculation at concurrency 1, by row kind

The machine is shared and noisy, so configurations are interleaved (A, B, A, B ...) over
`--repeats` rounds and the ratio of summed throughputs is reported, never an absolute figure alone.
Results go to stdout and, with `--json`, to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerobubble.bench import load_dataset, run_bench_async  # noqa: E402
from zerobubble.tools.launch import start_scheduler, start_worker, wait_serving  # noqa: E402

DEFAULT_DATASET = ROOT / "zerobubble" / "workloads" / "grounded.jsonl"


def bench(target: str, rows, concurrency: int) -> dict:
    return asyncio.run(run_bench_async(target, rows, concurrency, request_timeout=1800))


def with_scheduler(worker, rows, concurrency: int, **scheduler_flags) -> dict:
    """One bench run through a fresh scheduler process in front of `worker`."""
    scheduler = start_scheduler([worker], **scheduler_flags)
    try:
        wait_serving(scheduler.target)
        return bench(scheduler.target, rows, concurrency)
    finally:
        scheduler.stop()


def summary(report: dict) -> dict:
    keys = (
        "output_tokens",
        "wall_s",
        "output_tokens_per_s",
        "ttft_p50_s",
        "itl_p50_s",
        "acceptance_rate",
        "mean_accepted_length",
        "worker_idle_fraction",
    )
    return {k: report.get(k) for k in keys}


def interleave(configs: dict[str, callable], repeats: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, run in configs.items():
            runs[name].append(summary(run()))
            print(
                f"  {name}: {runs[name][-1]['output_tokens_per_s']:.1f} tok/s, "
                f"idle {runs[name][-1]['worker_idle_fraction']}",
                flush=True,
            )
    return runs


def rate(runs: list[dict]) -> float:
    return sum(r["output_tokens"] for r in runs) / sum(r["wall_s"] for r in runs)


def suite_async(args) -> dict:
    out = {}
    for spec in args.spec_methods:
        flags = {"spec_method": spec, "num_spec_tokens": 3} if spec != "none" else {"spec_method": "none"}
        worker = start_worker(kv_cache_memory_gb=args.kv_gb, max_num_seqs=64, num_threads=args.num_threads, **flags)
        try:
            for concurrency in args.concurrency:
                limit = {1: args.limit_c1, 4: args.limit_c4}.get(concurrency, args.limit_c16)
                rows = load_dataset(args.dataset, limit=limit, max_tokens_cap=args.max_tokens_cap)
                key = f"{spec}-c{concurrency}" if len(args.spec_methods) > 1 else f"c{concurrency}"
                print(f"{spec}, concurrency {concurrency}: {len(rows)} rows", flush=True)
                runs = interleave(
                    {
                        name: lambda rows=rows, c=concurrency, w=worker, n=n: with_scheduler(
                            w, rows, c, max_inflight_steps=n
                        )
                        for name, n in (("sync", 1), ("async", 2))
                    },
                    args.repeats,
                )
                ttft = {name: sorted(r["ttft_p50_s"] for r in rs)[len(rs) // 2] for name, rs in runs.items()}
                out[key] = {
                    "async_over_sync": rate(runs["async"]) / rate(runs["sync"]),
                    "ttft_p50_s": ttft,
                    "async_idle_fraction": [r["worker_idle_fraction"] for r in runs["async"]],
                    "sync_idle_fraction": [r["worker_idle_fraction"] for r in runs["sync"]],
                    "runs": runs,
                }
                print(
                    f"  async / sync = {out[key]['async_over_sync']:.3f}; "
                    f"TTFT p50 async {ttft['async']:.3f} s, sync {ttft['sync']:.3f} s",
                    flush=True,
                )
        finally:
            worker.stop()
    return out


def suite_spec(args) -> dict:
    out = {}
    workers = {"none": start_worker(kv_cache_memory_gb=args.kv_gb, spec_method="none")}
    for n_min in args.ngram_min:
        name = "ngram" if len(args.ngram_min) == 1 else f"ngram-min{n_min}"
        workers[name] = start_worker(
            kv_cache_memory_gb=args.kv_gb, spec_method="ngram", num_spec_tokens=3, ngram_min=n_min
        )
    try:
        for kind in ("code-edit", "open-chat", "grounded-qa"):
            rows = load_dataset(args.dataset, kind=kind, limit=args.limit_spec, max_tokens_cap=args.max_tokens_cap)
            print(f"{kind}: {len(rows)} rows at concurrency 1", flush=True)
            runs = interleave(
                {name: (lambda w=w, rows=rows: with_scheduler(w, rows, 1)) for name, w in workers.items()}, args.repeats
            )
            out[kind] = {
                f"{name}_over_none": rate(r) / rate(runs["none"]) for name, r in runs.items() if name != "none"
            }
            for key, ratio in out[kind].items():
                print(f"  {key} = {ratio:.3f}", flush=True)
            out[kind]["runs"] = runs
    finally:
        for w in workers.values():
            w.stop()
    return out


def suite_hf(args) -> dict:
    rows = load_dataset(args.dataset, limit=args.limit_c16, max_tokens_cap=args.max_tokens_cap)
    ours: dict[str, dict] = {}
    for spec in args.spec_methods:
        flags = {"spec_method": spec, "num_spec_tokens": 3} if spec != "none" else {"spec_method": "none"}
        worker = start_worker(kv_cache_memory_gb=args.kv_gb, dtype=args.dtype, **flags)
        try:
            ours[spec] = with_scheduler(worker, rows, 16)
        finally:
            worker.stop()
        print(f"  ours ({spec}): {ours[spec]['output_tokens_per_s']:.1f} tok/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ours_path, hf_path = Path(tmp) / "ours.json", Path(tmp) / "hf.json"
        ours_path.write_text(json.dumps(ours[args.spec_methods[0]]))
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / "hf_baseline.py"),
            "--dataset",
            str(args.dataset),
            "--limit",
            str(args.limit_c16),
            "--json",
            str(hf_path),
            "--compare",
            str(ours_path),
            "--dtype",
            args.dtype,
        ]
        if args.max_tokens_cap:
            cmd += ["--max-tokens-cap", str(args.max_tokens_cap)]
        subprocess.run(cmd, check=True)
        hf = json.loads(hf_path.read_text())
    out = {"hf_output_tokens_per_s": hf["output_tokens_per_s"], "hf_wall_s": hf["wall_s"]}
    for spec, report in ours.items():
        ratio = report["output_tokens_per_s"] / hf["output_tokens_per_s"]
        print(f"  ours ({spec}) / HF = {ratio:.2f}", flush=True)
        out[spec] = {"ours": summary(report), "ours_over_hf": ratio}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=("hf", "async", "spec"))
    parser.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens-cap", type=int, default=0)
    parser.add_argument("--kv-gb", type=float, default=1.0)
    parser.add_argument(
        "--spec-methods",
        nargs="+",
        default=["none"],
        choices=("none", "ngram", "suffix"),
        help="hf suite: our configurations, each against the same HF run; async suite: one worker each",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="hf suite: the dtype of both engines"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="async suite")
    parser.add_argument("--num-threads", type=int, default=0, help="the worker's torch threads (0 = default)")
    parser.add_argument("--limit-c1", type=int, default=4)
    parser.add_argument("--limit-c4", type=int, default=12)
    parser.add_argument("--limit-c16", type=int, default=48)
    parser.add_argument("--limit-spec", type=int, default=4)
    parser.add_argument(
        "--ngram-min",
        type=int,
        nargs="+",
        default=[2],
        help="spec suite: one n-gram worker per value, all against no speculation",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = {"hf": suite_hf, "async": suite_async, "spec": suite_spec}[args.suite](args)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2, default=str)[:4000])


if __name__ == "__main__":
    main()
