"""Do clients that stop reading slow the others down? (issue 11, item 5)

Runs rounds against a scheduler, interleaved A B A B ...:
  A: N streams, all read promptly;
  B: the same N requests, but S of them (each on its own connection, as separate clients
     would be) read their first message and then stop reading until every other stream ended.
Reports the inter-token latency p50/p99 of the N - S streams that read promptly in both (the
same requests), and the B/A ratio. The stalled streams' output is checked too: every token
arrives once they read again.

    python scripts/slow_readers.py --target 127.0.0.1:50051 --streams 64 --stalled 8 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics

import grpc

from zerobubble.api import generate_pb2_grpc
from zerobubble.client import build_request, complete

logger = logging.getLogger("slow_readers")

PROMPTS = [
    "Count from one to a hundred:",
    "Write a long story about a dragon.",
    "List every country in Europe.",
    "Explain how computers work, step by step.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_round(target: str, num_streams: int, num_stalled: int, max_tokens: int) -> dict:
    requests = [
        build_request(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True)
        for i in range(num_streams)
    ]
    prompt_idx = range(num_stalled, num_streams)  # the streams that read in both variants
    release = asyncio.Event()
    async with grpc.aio.insecure_channel(target) as shared:
        stub = generate_pb2_grpc.GenerationStub(shared)

        async def stalled(req) -> int:
            async with grpc.aio.insecure_channel(target) as own:
                call = generate_pb2_grpc.GenerationStub(own).Generate(req, timeout=1800)
                first = await call.read()
                await release.wait()  # stop reading until the others are done
                count = len(first.token_ids)
                while (reply := await call.read()) is not grpc.aio.EOF:
                    count += len(reply.token_ids)
                return count

        stalls = [asyncio.create_task(stalled(requests[i])) for i in range(num_stalled)]
        normal = await asyncio.gather(*(complete(stub, requests[i], timeout=1800) for i in prompt_idx))
        release.set()
        stalled_counts = await asyncio.gather(*stalls)
    itl = [gap for c in normal for gap in c.itl]
    return dict(
        stalled=num_stalled,
        p50=percentile(itl, 0.5),
        p99=percentile(itl, 0.99),
        stalled_tokens_ok=all(n == max_tokens for n in stalled_counts),
        normal_tokens_ok=all(len(c.token_ids) == max_tokens for c in normal),
    )


async def main_async(args: argparse.Namespace) -> dict:
    rounds = []
    for r in range(args.rounds):
        for stalled in (0, args.stalled):
            # Variant A runs the same N requests with the first S read promptly too; only the
            # N - S common streams are compared, so both sides measure the same requests.
            res = await one_round(args.target, args.streams, stalled, args.max_tokens)
            res["round"] = r
            rounds.append(res)
            logger.info("%s", res)
    a = [x["p99"] for x in rounds if x["stalled"] == 0]
    b = [x["p99"] for x in rounds if x["stalled"] > 0]
    return dict(
        rounds=rounds,
        p99_a=statistics.median(a),
        p99_b=statistics.median(b),
        p99_ratio=statistics.median(b) / statistics.median(a),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stalled", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    report = asyncio.run(main_async(args))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
