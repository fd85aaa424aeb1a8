"""Time to first token and per-request tokens/s at concurrency 1 with a draft model.

Starts `zerobubble worker --spec-method draft` (SmolLM2-135M drafting for itself unless
`--draft-model` says otherwise) and a scheduler from the checkout at `--root` (default: this
one), sends short chat requests one after another and prints the medians (the first request,
a warm-up, is not counted). For a before/after comparison run it alternately against a
worktree of the older code:

    git worktree add /tmp/before <rev>
    python scripts/draft_latency.py --root /tmp/before; python scripts/draft_latency.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

TOPICS = ("cat", "dog", "robot", "river", "king", "tree", "ship", "storm", "lamp")


async def measure(target: str, num_requests: int, max_tokens: int) -> tuple[list[float], list[float]]:
    import grpc

    from zerobubble.api import generate_pb2_grpc
    from zerobubble.client import build_request

    ttfts, rates = [], []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for i in range(num_requests + 1):
            topic = TOPICS[i % len(TOPICS)]
            request = build_request(
                messages=[{"role": "user", "content": f"Write a short story about a {topic}."}], max_tokens=max_tokens
            )
            started, first, num_tokens = time.perf_counter(), None, 0
            async for reply in stub.Generate(request):
                if reply.token_ids and first is None:
                    first = time.perf_counter() - started
                num_tokens += len(reply.token_ids)
            if i and first is not None:  # request 0 warms up
                ttfts.append(first)
                rates.append(num_tokens / (time.perf_counter() - started))
    return ttfts, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--draft-model", default="smollm2-135m")
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--inflight", type=int, default=2, help="the scheduler's --max-inflight-steps (1 = sync)")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    sys.path.insert(0, str(args.root.resolve()))  # the services start from the same checkout
    from zerobubble.tools.launch import start_scheduler, start_worker, wait_serving

    worker = start_worker(
        spec_method="draft", draft_model=args.draft_model, num_spec_tokens=args.num_spec_tokens, max_num_seqs=4
    )
    try:
        scheduler = start_scheduler([worker], max_inflight_steps=args.inflight)
        try:
            wait_serving(scheduler.target)
            ttfts, rates = asyncio.run(measure(scheduler.target, args.requests, args.max_tokens))
        finally:
            scheduler.stop()
    finally:
        worker.stop()
    print(
        f"{args.root}: inflight {args.inflight}: TTFT median {1e3 * statistics.median(ttfts):.0f} ms, "
        f"tokens/s median {statistics.median(rates):.1f} ({len(rates)} requests)",
        flush=True,
    )


if __name__ == "__main__":
    main()
