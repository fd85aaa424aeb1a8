"""The scheduler's CPU for suffix decoding per plan, at N running requests (no model).

Requests are the `grounded` workload's prompts with their Hugging Face greedy outputs (64
tokens), cycled, each replaced by a fresh one when it ends, so the shared index fills and
evicts. Each step every request is planned (`SuffixDrafter.plan`, which indexes what was
confirmed since) and then advances by one token plus the drafts of its continuation that the
output follows, as a synchronous scheduler would see it. Prints the planning time per step.

    python scripts/bench_suffix.py 16 64

The prompts and outputs are computed once (transformers, the oracle's cache) into a file in the
temporary directory; the timing run imports neither, so its garbage collections are the
scheduler's own.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerobubble.request_options import SamplingOptions, StoppingOptions  # noqa: E402
from zerobubble.scheduler_svc.request import Request  # noqa: E402
from zerobubble.scheduler_svc.suffix import SuffixDrafter  # noqa: E402

CACHE = Path(tempfile.gettempdir()) / "zerobubble-bench-suffix.json"
STEPS = 400


def workload() -> tuple[list[list[int]], list[list[int]]]:
    if not CACHE.exists():
        import subprocess

        code = (
            "import json, sys; from pathlib import Path; "
            "from tests.support.e2e import prompt_ids; from tests.support.hf_oracle import hf_greedy; "
            "from zerobubble.worker_svc.model_loader import resolve_model; "
            "d = resolve_model('smollm2-135m'); "
            "rows = [json.loads(l) for l in Path('zerobubble/workloads/grounded.jsonl').read_text().splitlines()]; "
            "p = prompt_ids(d, rows); Path(sys.argv[1]).write_text(json.dumps([p, hf_greedy(d, p, 64)]))"
        )
        subprocess.run([sys.executable, "-c", code, str(CACHE)], check=True, cwd=Path(__file__).resolve().parents[1])
    prompts, outputs = json.loads(CACHE.read_text())
    return prompts, outputs


def run(num_requests: int, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    def new(i: int) -> tuple[Request, list[int]]:
        request = Request(
            req_id=str(i),
            prompt_token_ids=list(prompts[i % len(prompts)]),
            sampling=SamplingOptions(),
            stopping=StoppingOptions(),
            max_tokens=64,
            eos_token_ids=frozenset(),
            detokenizer=None,
            arrival_time=0.0,
            admission_id=1,
        )
        return request, outputs[i % len(outputs)]

    drafter = SuffixDrafter(16)
    active = [new(i) for i in range(num_requests)]
    next_id, times, tokens = num_requests, [], 0
    for _ in range(STEPS):
        begin = time.perf_counter()
        drafter.new_plan()
        plans = []
        for req, _ in active:
            plan = drafter.plan(req, 3)
            drafter.commit(req, plan)
            plans.append(plan)
        times.append(time.perf_counter() - begin)
        for k, ((req, ref), plan) in enumerate(zip(active, plans)):
            done, state = len(req.output_token_ids), req.suffix
            assert state is not None
            consumed = req.num_tokens - state.anchor
            rest = state.sent[consumed:] if state.sent and consumed <= len(state.sent) else []
            accepted = 0
            limit = min(len(rest), plan.num_draft_slots, len(ref) - done - 1)
            while accepted < limit and rest[accepted] == ref[done + accepted]:
                accepted += 1
            req.output_token_ids.extend(ref[done : done + 1 + accepted])
            tokens += 1 + accepted
            if len(req.output_token_ids) >= len(ref):
                drafter.finish(req)
                active[k] = new(next_id)
                next_id += 1
    times.sort()
    print(
        f"{num_requests} requests: {1e3 * sum(times) / len(times):.2f} ms per plan on average, "
        f"p50 {1e3 * times[len(times) // 2]:.2f}, p99 {1e3 * times[int(len(times) * 0.99)]:.2f} ms; "
        f"{drafter.num_queries / STEPS:.1f} queries and {tokens / STEPS:.0f} output tokens per step, "
        f"{drafter.shared.index.num_tokens} tokens in the shared index"
    )


def main() -> None:
    prompts, outputs = workload()
    for n in [int(a) for a in sys.argv[1:]] or [16, 64]:
        run(n, prompts, outputs)


if __name__ == "__main__":
    main()
