"""Host cost per step and the bubble, measured against a simulated device (no model, no GPU).

    python scripts/bench_sim.py host     # host ms per step, zero-time device: 1/16/64/256 requests, k=0 and k=3
    python scripts/bench_sim.py bubble   # device 2/5/10/20 ms x 16/64/256 requests x n-gram on/off: async / sync

Both run the real services as processes (`zerobubble worker --simulate-device-ms MS`, `zerobubble
scheduler`) and this script as the gRPC client, so a step's figure covers the whole path: plan ->
protobuf -> gRPC -> worker (plan decoding, slots, input assembly, proposer bookkeeping, result)
-> gRPC -> reconcile -> detokenize -> client streams.

Every request is decoding for most of a run: N short chat prompts, all sent at once, each with
the same `max_tokens` (the simulated tokens never include EOS). Fixed costs (connecting,
tokenizing prompts, prefill, the last request's tail) are removed by running every
configuration at two lengths and taking differences: ms per step = d(wall) / d(steps), and
throughput = d(tokens) / d(wall). Configurations that are compared are run back to back (sync,
async, sync, async ...) because the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerobubble.bench import BenchRow, run_bench_async  # noqa: E402
from zerobubble.tools.launch import Service, start_scheduler, start_worker, wait_serving  # noqa: E402

TOPICS = ("rivers", "compilers", "bread", "volcanoes", "chess", "bridges", "owls", "tides")


def rows(num_requests: int, max_tokens: int) -> list[BenchRow]:
    """Short, distinct chat prompts (about 40 tokens with SmolLM2's template)."""
    return [BenchRow(index=i, kind="sim", max_tokens=max_tokens, messages=[
        {"role": "user", "content": f"Request {i}: write a long essay about {TOPICS[i % len(TOPICS)]}."}])
        for i in range(num_requests)]


@contextmanager
def sim_worker(device_ms: float, spec: str, args: argparse.Namespace) -> Iterator[Service]:
    worker = start_worker(simulate_device_ms=device_ms, spec_method=spec, num_spec_tokens=3,
                          max_num_seqs=256, kv_cache_memory_gb=args.kv_gb,
                          simulate_acceptance_rate=args.acceptance_rate)
    try:
        yield worker
    finally:
        worker.stop()


def run(worker: Service, num_requests: int, max_tokens: int, window: int) -> dict:
    """One bench through a fresh scheduler in front of `worker`."""
    scheduler = start_scheduler([worker], max_inflight_steps=window, max_num_seqs=256,
                                max_num_batched_tokens=2048)
    try:
        wait_serving(scheduler.target)
        report = asyncio.run(run_bench_async(scheduler.target, rows(num_requests, max_tokens),
                                             num_requests, request_timeout=600))
    finally:
        scheduler.stop()
    if report["num_errors"]:
        raise RuntimeError(f"{report['num_errors']} requests failed: {report['finish_reasons']}")
    stats = report["server_stats"]
    return {"wall_s": report["wall_s"], "output_tokens": report["output_tokens"],
            "num_steps": stats["num_steps"], "worker_busy_s": stats["worker_busy_s"],
            "worker_idle_s": stats["worker_idle_s"], "acceptance_rate": report["acceptance_rate"]}


def marginal(short: dict, long: dict, device_ms: float) -> dict:
    """Figures of the extra decode steps of the long run over the short one."""
    wall = long["wall_s"] - short["wall_s"]
    steps = long["num_steps"] - short["num_steps"]
    idle = long["worker_idle_s"] - short["worker_idle_s"]
    busy = long["worker_busy_s"] - short["worker_busy_s"]
    return {
        "ms_per_step": 1000 * wall / steps,
        "tokens_per_s": (long["output_tokens"] - short["output_tokens"]) / wall,
        "tokens_per_step": (long["output_tokens"] - short["output_tokens"]) / steps,
        # Share of the wall time the device was computing: 1.0 is the device-bound rate.
        "device_busy_fraction": steps * device_ms / 1000 / wall,
        "worker_idle_fraction": idle / (idle + busy) if idle + busy > 0 else 0.0,
        "acceptance_rate": long["acceptance_rate"],
    }


def measure(worker: Service, num_requests: int, window: int, device_ms: float,
            args: argparse.Namespace) -> dict:
    short = run(worker, num_requests, args.short_tokens, window)
    long = run(worker, num_requests, args.long_tokens, window)
    return marginal(short, long, device_ms)


def suite_host(args: argparse.Namespace) -> dict:
    out: dict = {}
    for spec in ("none", "ngram"):
        k = 3 if spec == "ngram" else 0
        with sim_worker(0.0, spec, args) as worker:
            for n in args.requests:
                figures = [measure(worker, n, 2, 0.0, args) for _ in range(args.repeats)]
                best = min(figures, key=lambda f: f["ms_per_step"])
                out[f"k{k}/n{n}"] = {"ms_per_step": best["ms_per_step"],
                                     "all_ms_per_step": [f["ms_per_step"] for f in figures],
                                     "tokens_per_step": best["tokens_per_step"],
                                     "acceptance_rate": best["acceptance_rate"]}
                print(f"k={k} n={n:4d}: {best['ms_per_step']:.2f} ms/step "
                      f"({', '.join(f'{f:.2f}' for f in out[f'k{k}/n{n}']['all_ms_per_step'])}), "
                      f"{best['tokens_per_step']:.2f} tokens/step", flush=True)
    return out


def suite_bubble(args: argparse.Namespace) -> dict:
    out: dict = {}
    for device_ms in args.device_ms:
        for spec in ("none", "ngram"):
            with sim_worker(device_ms, spec, args) as worker:
                for n in args.requests:
                    sync = measure(worker, n, 1, device_ms, args)
                    async_ = measure(worker, n, 2, device_ms, args)
                    key = f"{device_ms:g}ms/{spec}/n{n}"
                    out[key] = {"sync": sync, "async": async_,
                                "async_over_sync": async_["tokens_per_s"] / sync["tokens_per_s"]}
                    print(f"{key:>18}: async/sync {out[key]['async_over_sync']:.2f}  "
                          f"device busy sync {sync['device_busy_fraction']:.2f} async "
                          f"{async_['device_busy_fraction']:.2f}  idle sync "
                          f"{sync['worker_idle_fraction']:.3f} async {async_['worker_idle_fraction']:.3f}"
                          f"  host {sync['ms_per_step'] - device_ms:.2f} ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=("host", "bubble"))
    parser.add_argument("--requests", type=int, nargs="+", help="running requests (default: host "
                        "1 16 64 256, bubble 16 64 256)")
    parser.add_argument("--device-ms", type=float, nargs="+", default=[2, 5, 10, 20])
    parser.add_argument("--short-tokens", type=int, default=48)
    parser.add_argument("--long-tokens", type=int, default=144)
    parser.add_argument("--repeats", type=int, default=2, help="host suite: runs per figure (best kept)")
    parser.add_argument("--acceptance-rate", type=float, default=0.6)
    parser.add_argument("--kv-gb", type=float, default=16.0,
                        help="KV budget the simulated worker sizes its block pool with (not allocated)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.requests is None:
        args.requests = [1, 16, 64, 256] if args.suite == "host" else [16, 64, 256]
    result = {"host": suite_host, "bubble": suite_bubble}[args.suite](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
