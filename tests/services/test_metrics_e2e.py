"""Every metric of DESIGN.md's table, scraped from both services around a real generation.

One worker process (n-gram speculation, so the speculation families move) and one scheduler
process on loopback serve a handful of requests that end in every way a client can see: length,
EOS, stop string and client cancel. The scheduler admits two requests at a time, so some wait
and the queue figures are not trivially zero. A thread scrapes the scheduler while the requests
run (gauges only mean something then); afterwards both services are scraped once more and every
figure is checked against what the clients themselves received.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

import grpc
import pytest

from tests.support.metrics_scrape import scrape, total
from tests.support.polling import wait_until_async
from tests.support.servers import start_scheduler, start_worker, wait_serving
from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.client import Completion, build_request, complete
from zerobubble.metrics import METRIC_SPECS, metric_spec

pytestmark = pytest.mark.timeout(300)

NUM_SPEC_TOKENS = 3
MAX_INFLIGHT = 2

# Prompts chosen so that each request ends in a known way with SmolLM2 greedy, and so that the
# n-gram proposer finds matches (repeated sequences) and also misses (free text).
REQUESTS: list[dict] = [
    dict(prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,", max_tokens=24),
    dict(prompt="The cat sat on the mat. The dog sat on the log. The cat sat on the", max_tokens=24),
    dict(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32),
    dict(prompt="1, 2, 3, 4, 5,", max_tokens=24, stop=[" 9"]),
]
# Cancelled by the client after its first tokens; it would otherwise run for a long time.
CANCELLED = dict(prompt="Tell me a long story about a dragon.", max_tokens=200, ignore_eos=True)


# -- scraping --------------------------------------------------------------------------------------


def values(samples: list, name: str) -> list:
    return [s for s in samples if s.name == name]


def sample_names(spec) -> list[str]:
    """What a scrape shows for one family of the contract (a histogram as _count/_sum/_bucket)."""
    if spec.kind == "histogram":
        return [spec.name + suffix for suffix in ("_count", "_sum", "_bucket")]
    return [spec.name]


def family_of(sample: str) -> str | None:
    """The contract family a sample belongs to (``X_bucket`` -> ``X``, ``X_created`` too)."""
    spec = metric_spec(sample)
    if spec is None and sample.endswith("_created"):
        base = sample.removesuffix("_created")
        spec = metric_spec(base + "_total") or metric_spec(base)
    return spec.name if spec is not None else None


class Poller:
    """Scrapes a metrics port in a thread and keeps the largest value of each watched gauge.

    Gauges such as running requests or KV usage only move while requests run; sampling them
    every 50 ms catches the live values that a scrape after the fact cannot see.
    """

    WATCH = (
        "zerobubble_num_requests_running",
        "zerobubble_num_requests_waiting",
        "zerobubble_kv_cache_usage_ratio",
        "zerobubble_inflight_steps",
    )

    def __init__(self, port: int) -> None:
        self.port = port
        self.max: dict[str, float] = defaultdict(float)
        self.out_of_range: list[tuple[str, dict, float]] = []
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for s in scrape(self.port):
                if s.name in self.WATCH:
                    self.max[s.name] = max(self.max[s.name], s.value)
                    if s.value < 0 or (s.name == "zerobubble_kv_cache_usage_ratio" and s.value > 1):
                        self.out_of_range.append((s.name, s.labels, s.value))
            self.scrapes += 1
            self._stop.wait(0.05)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# -- the scenario ----------------------------------------------------------------------------------


async def prompt_lengths(stub: generate_pb2_grpc.GenerationStub, requests: list[dict]) -> list[int]:
    """The prompt lengths as the server tokenizes them, asked independently."""
    lengths = []
    for r in requests:
        kind = {k: r[k] for k in ("prompt", "messages") if k in r}
        tok_req = build_request(**kind)
        tok = generate_pb2.TokenizeRequest()
        if "prompt" in kind:
            tok.prompt = tok_req.prompt
        else:
            tok.messages.CopyFrom(tok_req.messages)
        lengths.append(len((await stub.Tokenize(tok, timeout=30)).token_ids))
    return lengths


async def cancel_after_first_tokens(stub: generate_pb2_grpc.GenerationStub, request: dict) -> int:
    """Start `request`, cancel it once it has delivered two tokens; the tokens received."""
    got = 0
    call = stub.Generate(build_request(**request), timeout=120)
    async for reply in call:
        got += len(reply.token_ids)
        if got >= 2:
            break
    call.cancel()
    return got


def quiet(port: int) -> bool:
    """Every request (the cancelled one too) counted, nothing running, no step in flight."""
    s = scrape(port)
    return (
        total(s, "zerobubble_request_success_total") == len(REQUESTS) + 1
        and total(s, "zerobubble_num_requests_running") == 0
        and total(s, "zerobubble_inflight_steps") == 0
    )


@pytest.fixture(scope="module")
def observed(smollm2_dir):
    """Run the requests once; the tests below each check one part of what was scraped."""
    started = time.monotonic()
    worker = start_worker(
        kv_cache_memory_gb=0.2, max_num_seqs=8, metrics_port=0, spec_method="ngram", num_spec_tokens=NUM_SPEC_TOKENS
    )
    scheduler = start_scheduler([worker], max_num_seqs=2, max_inflight_steps=MAX_INFLIGHT)
    try:
        wait_serving(scheduler.target)
        assert "METRICS" in worker.ports, "the worker did not announce its metrics port"

        async def scenario():
            async with grpc.aio.insecure_channel(scheduler.target) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                info = await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=30)
                prompt_lens = await prompt_lengths(stub, [*REQUESTS, CANCELLED])
                with Poller(scheduler.ports["METRICS"]) as poller, Poller(worker.ports["METRICS"]) as worker_poller:
                    done = await asyncio.gather(
                        *[complete(stub, build_request(**r), timeout=180) for r in REQUESTS],
                        cancel_after_first_tokens(stub, CANCELLED),
                    )
                    completions: list[Completion] = list(done[:-1])
                    # Let the scheduler see the cancel, free the blocks and go quiet.
                    port = scheduler.ports["METRICS"]
                    await wait_until_async(lambda: quiet(port), 30, "the scheduler to go quiet", poll=0.1)
                return info, prompt_lens, completions, done[-1], poller, worker_poller

        info, prompt_lens, completions, cancelled_tokens, poller, worker_poller = asyncio.run(scenario())
        result = dict(
            info=info,
            prompt_lens=prompt_lens,
            completions=completions,
            cancelled_tokens=cancelled_tokens,
            poller=poller,
            worker_poller=worker_poller,
            sched=scrape(scheduler.ports["METRICS"]),
            worker=scrape(worker.ports["METRICS"]),
        )
        print(f"metrics scenario: {time.monotonic() - started:.1f}s including service starts")
        yield result
    finally:
        scheduler.stop()
        worker.stop()


def test_requests_ended_as_planned(observed):
    # The checks below rely on these outcomes; if the model's output changed, say so here.
    reasons = [c.finish_reason for c in observed["completions"]]
    assert reasons == ["max_tokens", "max_tokens", "eos", "stop_sequence"], reasons
    assert observed["cancelled_tokens"] >= 2


def test_every_contract_family_is_exported_by_the_scheduler(observed):
    sched = observed["sched"]
    names = {s.name for s in sched}
    # A front's series exist while it is attached (tests/services/test_front.py); this scheduler has none.
    for spec in (s for s in METRIC_SPECS if "front" not in s.labels):
        missing = [n for n in sample_names(spec) if n not in names]
        assert not missing, f"scheduler does not export {missing}"


def test_labels_name_the_served_model_and_the_worker(observed):
    model = observed["info"].model
    assert model, "ModelInfo names no model"
    worker_families = {spec.name for spec in METRIC_SPECS if "worker" in spec.labels}
    workers_seen: set[str] = set()
    for which in ("sched", "worker"):
        for s in observed[which]:
            if not s.name.startswith("zerobubble_"):
                continue
            assert family_of(s.name), f"{which} exports {s.name}, which is not in the contract"
            assert s.labels.get("model") == model, (which, s)
            if family_of(s.name) in worker_families:
                assert s.labels.get("worker"), (which, s)
                workers_seen.add(s.labels["worker"])
    # The scheduler labels a worker's figures with the id the worker labels its own with.
    assert len(workers_seen) == 1, workers_seen


def test_token_counters_equal_what_the_clients_saw(observed):
    sched = observed["sched"]
    completions = observed["completions"]
    streamed = sum(len(c.token_ids) for c in completions)
    generated = total(sched, "zerobubble_generation_tokens_total")
    # The cancelled request streamed at least what its client read before cancelling (more may
    # have been queued for it), at most its max_tokens.
    cancelled = generated - streamed
    assert observed["cancelled_tokens"] <= cancelled <= CANCELLED["max_tokens"], (
        generated,
        streamed,
        observed["cancelled_tokens"],
    )
    # Prompt tokens: exactly the prompts' lengths, as Tokenize and the replies report them.
    assert total(sched, "zerobubble_prompt_tokens_total") == sum(observed["prompt_lens"])
    assert [c.num_prompt_tokens for c in completions] == observed["prompt_lens"][:-1]


def test_request_success_counts_each_finish_reason(observed):
    sched = observed["sched"]
    expected: dict[str, int] = defaultdict(int)
    for c in observed["completions"]:
        expected[c.finish_reason] += 1
    expected["cancelled"] += 1
    for reason in ("eos", "max_tokens", "stop_sequence", "cancelled", "error"):
        got = total(sched, "zerobubble_request_success_total", finished_reason=reason)
        assert got == expected.get(reason, 0), (reason, got, dict(expected))


def test_latency_histograms_count_every_request(observed):
    sched = observed["sched"]
    completions = observed["completions"]
    n = len(completions) + 1
    assert total(sched, "zerobubble_time_to_first_token_seconds_count") == n
    assert total(sched, "zerobubble_e2e_request_latency_seconds_count") == n
    assert total(sched, "zerobubble_request_queue_time_seconds_count") == n
    # Two requests are admitted at a time, so the others waited for a measurable time.
    assert total(sched, "zerobubble_request_queue_time_seconds_sum") > 0
    # Inter-token gaps: one per token after each request's first (a message that carries
    # several speculated tokens counts one gap per token), so the count follows from the
    # generation counter; and at least one per token-carrying message after the first.
    generated = total(sched, "zerobubble_generation_tokens_total")
    itl = total(sched, "zerobubble_inter_token_latency_seconds_count")
    assert itl == generated - n, (itl, generated)
    assert itl >= sum(len(c.itl) for c in completions)
    # A request's gaps and TTFT fit inside its end-to-end latency.
    e2e = total(sched, "zerobubble_e2e_request_latency_seconds_sum")
    assert 0 < total(sched, "zerobubble_inter_token_latency_seconds_sum") < e2e
    assert 0 < total(sched, "zerobubble_time_to_first_token_seconds_sum") < e2e


def test_speculation_counters_are_consistent(observed):
    for which in ("sched", "worker"):
        s = observed[which]
        drafts = total(s, "zerobubble_spec_decode_num_drafts_total")
        draft_tokens = total(s, "zerobubble_spec_decode_num_draft_tokens_total")
        accepted = total(s, "zerobubble_spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and draft_tokens > 0, f"{which}: speculation did not move"
        assert drafts <= draft_tokens <= NUM_SPEC_TOKENS * drafts, (which, drafts, draft_tokens)
        assert 0 < accepted <= draft_tokens, (which, accepted, draft_tokens)
        per_pos = {
            int(x.labels["position"]): x.value
            for x in values(s, "zerobubble_spec_decode_num_accepted_tokens_per_pos_total")
        }
        assert sorted(per_pos) == list(range(NUM_SPEC_TOKENS)), (which, per_pos)
        ordered = [per_pos[p] for p in range(NUM_SPEC_TOKENS)]
        # A draft token is accepted only if every one before it was.
        assert all(a >= b for a, b in zip(ordered, ordered[1:])), (which, ordered)
        assert sum(ordered) == accepted, (which, ordered, accepted)
        assert ordered[0] <= drafts
    # The draft slots of every decode row planned (--spec-draft-length adaptive, the default):
    # at most k each, and at least the drafts verified, which some of them carried.
    sched = observed["sched"]
    rows = total(sched, "zerobubble_spec_decode_draft_slots_count")
    slots = total(sched, "zerobubble_spec_decode_draft_slots_sum")
    assert total(sched, "zerobubble_spec_decode_num_draft_tokens_total") <= slots <= NUM_SPEC_TOKENS * rows
    # Rolled-back placeholders: every scheduled draft slot that was not accepted. There were
    # rejections (free text), so it moved; it cannot be fewer than the rejected real drafts.
    sched = observed["sched"]
    rejected = total(sched, "zerobubble_spec_decode_num_draft_tokens_total") - total(
        sched, "zerobubble_spec_decode_num_accepted_tokens_total"
    )
    assert total(sched, "zerobubble_placeholder_tokens_rolled_back_total") >= rejected > 0


def test_worker_figures_agree_between_worker_and_scheduler(observed):
    sched, worker = observed["sched"], observed["worker"]
    for name in (
        "zerobubble_worker_step_duration_seconds_count",
        "zerobubble_spec_decode_num_drafts_total",
        "zerobubble_spec_decode_num_draft_tokens_total",
        "zerobubble_spec_decode_num_accepted_tokens_total",
    ):
        assert total(sched, name) == total(worker, name) > 0, name
    steps = total(worker, "zerobubble_worker_step_duration_seconds_count")
    busy = total(worker, "zerobubble_worker_step_duration_seconds_sum")
    assert 0 < busy / steps < 10, "mean step time is not plausible"
    assert values(worker, "zerobubble_worker_idle_seconds_total"), "no idle (bubble) series"
    assert total(worker, "zerobubble_worker_idle_seconds_total") >= 0
    assert total(sched, "zerobubble_worker_idle_seconds_total") == pytest.approx(
        total(worker, "zerobubble_worker_idle_seconds_total")
    )
    # A worker shows its own step figures, not the scheduler's request queues.
    names = {s.name for s in worker}
    assert "zerobubble_worker_step_duration_seconds_bucket" in names
    assert "zerobubble_inflight_steps" in names
    assert "zerobubble_kv_cache_usage_ratio" in names


def test_gauges_moved_while_running_and_settled_after(observed):
    poller, sched = observed["poller"], observed["sched"]
    assert poller.scrapes >= 5, "too few scrapes while requests ran"
    assert not poller.out_of_range, poller.out_of_range
    assert poller.max["zerobubble_num_requests_running"] >= 1
    assert poller.max["zerobubble_num_requests_running"] <= 2  # the scheduler's max_num_seqs
    assert poller.max["zerobubble_num_requests_waiting"] >= 1
    assert 0 < poller.max["zerobubble_kv_cache_usage_ratio"] <= 1
    assert 1 <= poller.max["zerobubble_inflight_steps"] <= MAX_INFLIGHT
    # Afterwards: nothing running, nothing waiting, no KV blocks held, no plan on the wire.
    for name in (
        "zerobubble_num_requests_running",
        "zerobubble_num_requests_waiting",
        "zerobubble_kv_cache_usage_ratio",
        "zerobubble_inflight_steps",
    ):
        assert values(sched, name) and total(sched, name) == 0, name


def test_worker_gauges_move_on_the_workers_own_port(observed):
    poller = observed["worker_poller"]
    assert poller.scrapes >= 5
    assert not poller.out_of_range, poller.out_of_range
    assert 0 < poller.max["zerobubble_kv_cache_usage_ratio"] <= 1
    assert poller.max["zerobubble_inflight_steps"] >= 1
