"""Fault isolation and supervision on the scheduler side, without model processes.

The worker behind a `WorkerLink` here is `SimWorker` (tests/support/sim_worker.py, the pure-Python
worker with the real worker's semantics) answering over a stand-in for the `Execute` call, so
the link's supervision (reset, re-queue from confirmed tokens, reconnect) runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.support.polling import wait_until_async
from tests.support.sim_link import FakeChannel, SimCall, sim_stub, toy_info
from tests.support.sim_worker import (
    make_toy_tokenizer,
    reference_generate,
)
from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.scheduler_svc import worker_link
from zerobubble.scheduler_svc.router import Router
from zerobubble.scheduler_svc.scheduler import (
    FINISH_ERROR,
    FINISH_MAX_TOKENS,
    RequestEvent,
    SchedulerConfig,
)

TOY = make_toy_tokenizer()


def prompts(n: int, seed: int = 3) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.choice(b"abc xyz") for _ in range(rng.randint(5, 20))] for i in range(n)}


def test_link_survives_an_exception_in_its_receive_path(monkeypatch, caplog) -> None:
    """An exception raised while handling a result (here: the event callback, after delivery)
    resets the link instead of ending it: the requests resume from their confirmed tokens after
    the reconnect, and every output equals the toy model's (nothing lost or repeated)."""
    describes: list[float] = []
    monkeypatch.setattr(worker_link.worker_pb2_grpc, "WorkerStub", sim_stub(describes))
    streams: dict[str, list[int]] = {}
    finished: dict[str, RequestEvent] = {}
    num_calls = [0]

    def on_events(link, events: list[RequestEvent]) -> None:
        for ev in events:
            assert ev.req_id not in finished, "event after the final one"
            streams.setdefault(ev.req_id, []).extend(ev.token_ids)
            if ev.finish_reason is not None:
                finished[ev.req_id] = ev
        num_calls[0] += 1
        if num_calls[0] == 5:
            raise RuntimeError("injected fault in the receive path")

    ps = prompts(6)

    async def scenario() -> None:
        router = Router(SchedulerConfig(max_num_batched_tokens=32), max_inflight_steps=2)
        router.on_events = on_events
        await router.start(["sim:1"])
        link = router.links[0]
        await wait_until_async(lambda: link.ready, 10, "the link to be ready")
        for i, (req_id, prompt) in enumerate(ps.items()):
            router.submit(link, req_id, prompt, SamplingOptions(seed=1000 + i), StoppingOptions(max_tokens=30))
        await wait_until_async(lambda: len(finished) == len(ps), 10, "every request to finish")
        assert not link.pump.task.done(), "the link task ended"
        await router.close()

    asyncio.run(scenario())
    assert len(describes) >= 2, "the link never reconnected"
    assert "injected fault in the receive path" in caplog.text
    for i, (req_id, prompt) in enumerate(ps.items()):
        expected = reference_generate(TOY, prompt, 1000 + i, StoppingOptions(max_tokens=30), max_model_len=128)
        assert streams[req_id] == expected.token_ids, req_id
        assert finished[req_id].finish_reason == expected.finish_reason


def test_migration_that_cannot_place_a_request_ends_it_with_error() -> None:
    """A lost worker's request longer than the remaining worker's model length ends with ERROR
    and a message; the others move on (none is left waiting forever)."""
    router = Router(SchedulerConfig(max_num_batched_tokens=32), max_inflight_steps=2)
    got: list[RequestEvent] = []
    router.on_events = lambda link, events: got.extend(events)
    links = []
    for name, max_len in (("big", 128), ("small", 24)):
        link = worker_link.WorkerLink(name, router.config, 2, router._on_link_events, router._on_link_lost)
        link.info = toy_info(name, max_len)
        link._configure(link.info)
        link.ready = True
        links.append(link)
    router.links = links
    big, small = links
    long_prompt, short_prompts = [97] * 30, [[98] * 5, [99] * 6]
    router.submit(big, "long", long_prompt, SamplingOptions(seed=1), StoppingOptions(max_tokens=10))
    for i, p in enumerate(short_prompts):
        router.submit(big, f"short{i}", p, SamplingOptions(seed=2 + i), StoppingOptions(max_tokens=10))
    big.ready = False
    router._on_link_lost(big)
    assert [ev.req_id for ev in got] == ["long"]
    assert got[0].finish_reason == FINISH_ERROR and "cannot be resumed" in got[0].error
    assert "long" not in router.owner
    assert router.owner["short0"] is small and router.owner["short1"] is small
    assert small.scheduler.num_unfinished() == 2


def test_a_bad_result_for_one_request_ends_only_that_request() -> None:
    """An exception while applying one row (here its detokenizer) ends that request with ERROR;
    the step's other rows apply normally and their outputs are unchanged."""
    from tests.support.sim_worker import assert_matches_reference, drive, make_case

    case = make_case(num_requests=4, stopping=StoppingOptions(max_tokens=20), eos_per_mille=0)
    victim = case.scheduler.get_request("r1")
    real_append = victim.detokenizer.append

    def append(token_id: int):
        if victim.num_output_tokens >= 5:
            raise ValueError("injected detokenizer fault")
        return real_append(token_id)

    victim.detokenizer.append = append  # type: ignore[method-assign]
    got = drive(case.scheduler, case.worker, 2)
    assert got["r1"].finish_reason == FINISH_ERROR
    assert "injected detokenizer fault" in got["r1"].last_event.error
    del case.prompts["r1"]
    assert_matches_reference(case, got)
    assert all(got[r].finish_reason == FINISH_MAX_TOKENS for r in case.prompts)
    assert case.scheduler.block_pool.num_used == 0


def test_the_next_plan_goes_out_before_a_results_events_are_delivered(monkeypatch) -> None:
    """The worker may be waiting for the next plan while the scheduler serves the clients'
    streams, so the link plans and sends first and hands the result's events on after."""
    order: list[str] = []

    class RecordingCall(SimCall):
        async def write(self, plan: worker_pb2.StepPlan) -> None:
            order.append("plan")
            await super().write(plan)

        async def read(self):
            result = await super().read()
            order.append("result")
            return result

    monkeypatch.setattr(worker_link.worker_pb2_grpc, "WorkerStub", sim_stub(call=RecordingCall))
    monkeypatch.setattr(worker_link.rpc, "aio_channel", FakeChannel)
    finished: set[str] = set()

    def on_events(link, events: list[RequestEvent]) -> None:
        order.append("events")
        finished.update(ev.req_id for ev in events if ev.finish_reason is not None)

    ps = prompts(4)

    async def scenario() -> None:
        router = Router(SchedulerConfig(max_num_batched_tokens=64), max_inflight_steps=2)
        router.on_events = on_events
        await router.start(["sim:1"])
        await wait_until_async(lambda: router.links[0].ready, 10, "the first link to be ready")
        for i, (req_id, prompt) in enumerate(ps.items()):
            router.submit(
                router.links[0], req_id, prompt, SamplingOptions(seed=1000 + i), StoppingOptions(max_tokens=30)
            )
        await wait_until_async(lambda: len(finished) == len(ps), 10, "every request to finish")
        await router.close()

    asyncio.run(scenario())
    # What happened between each result and the delivery of its events, while all four
    # requests were still decoding (the first 10 results: each gives at most 4 tokens).
    between = []
    for i, what in enumerate(order):
        if what == "events":
            last_result = max(j for j in range(i) if order[j] == "result")
            between.append(order[last_result + 1 : i])
    assert len(between) >= 10
    assert all(b == ["plan"] for b in between[:10]), between[:10]


class HangingCall(SimCall):
    """A worker that stops answering after `num_answers` plans (alive, stream open, silent)."""

    def __init__(self, max_model_len: int, num_answers: int) -> None:
        super().__init__(max_model_len)
        self.num_answers = num_answers

    async def write(self, plan: worker_pb2.StepPlan) -> None:
        if self.num_answers > 0:
            self.num_answers -= 1
            await super().write(plan)


def test_a_hung_worker_is_declared_lost_at_the_step_deadline(monkeypatch, caplog) -> None:
    """A worker that stops answering mid-generation is dropped once the oldest plan in flight
    is older than the step deadline; its requests finish on the other worker, unchanged."""
    calls: dict[str, int] = {}

    class Stub:
        def __init__(self, channel: FakeChannel) -> None:
            self.address = channel.address

        async def Describe(self, request, timeout=None, metadata=None):
            calls[self.address] = calls.get(self.address, 0) + 1
            if self.address.startswith("hang") and calls[self.address] > 1:
                await asyncio.sleep(3600)  # still hung when the link tries to reconnect
            return toy_info(self.address)

        def Execute(self, metadata=None):
            if self.address.startswith("hang"):
                return HangingCall(128, num_answers=4)
            return SimCall(128)

    monkeypatch.setattr(worker_link.worker_pb2_grpc, "WorkerStub", Stub)
    monkeypatch.setattr(worker_link.rpc, "aio_channel", FakeChannel)
    ps = prompts(8, seed=7)
    streams: dict[str, list[int]] = {}
    finished: dict[str, RequestEvent] = {}

    def on_events(link, events: list[RequestEvent]) -> None:
        for ev in events:
            streams.setdefault(ev.req_id, []).extend(ev.token_ids)
            if ev.finish_reason is not None:
                finished[ev.req_id] = ev

    async def scenario() -> float:
        router = Router(SchedulerConfig(max_num_batched_tokens=32), max_inflight_steps=2, step_deadline_s=0.5)
        router.on_events = on_events
        await router.start(["good:1", "hang:1"])
        await wait_until_async(lambda: all(link.ready for link in router.links), 10, "every link to be ready")
        good, hung = router.links
        started = time.monotonic()
        for i, (req_id, prompt) in enumerate(ps.items()):
            router.submit(
                router.links[i % 2], req_id, prompt, SamplingOptions(seed=1000 + i), StoppingOptions(max_tokens=30)
            )
        await wait_until_async(lambda: len(finished) == len(ps), 10, "every request to finish")
        elapsed = time.monotonic() - started
        assert not hung.ready and good.ready
        await router.close()
        return elapsed

    elapsed = asyncio.run(scenario())
    assert "step deadline" in caplog.text
    assert elapsed < 5.0, elapsed
    for i, (req_id, prompt) in enumerate(ps.items()):
        expected = reference_generate(TOY, prompt, 1000 + i, StoppingOptions(max_tokens=30), max_model_len=128)
        assert streams[req_id] == expected.token_ids, req_id
        assert finished[req_id].finish_reason == expected.finish_reason


def test_plans_ahead_go_out_just_in_time_only_when_steps_are_long() -> None:
    from collections import deque

    predict, due = worker_link.predicted_step_s, worker_link.plan_ahead_due
    # Too few steps of a comparable size: no estimate, the plan goes out at once.
    assert predict(deque([(0.1, 8)] * 4 + [(1.0, 512)] * 50), 8) is None
    # The estimate is short on purpose (10th percentile of comparable steps): early is harmless,
    # late leaves the worker idle.
    times = deque([(0.12, 16)] * 80 + [(0.08, 16)] * 20 + [(2.0, 1024)] * 30)
    assert predict(times, 16) == pytest.approx(0.08)
    assert predict(times, 16 * 4) is None  # 1,024-token prefills are not comparable either
    # Steps shorter than the margin (a GPU decode): due before the running step started = at once.
    assert due(100.0, 1, 0.010, 0.020) <= 100.0
    assert due(100.0, 1, 0.020, 0.020) <= 100.0
    # A 120 ms CPU step: the plan ahead goes out a quarter of a step before its end, so a request
    # arriving in the first 90 ms still joins it.
    assert due(100.0, 1, 0.120, 0.020) == pytest.approx(100.09)
    # Two in flight: the third plan is due near the end of the second step.
    assert due(100.0, 2, 0.120, 0.020) == pytest.approx(100.21)
    # A larger margin wins over the quarter step.
    assert due(100.0, 1, 0.120, 0.050) == pytest.approx(100.07)
    # Plans are held back only while requests arrive: within 8 steps of the latest arrival.
    recent = worker_link.arrivals_recent
    assert recent(0.5, 0.120) and not recent(1.5, 0.120) and not recent(float("inf"), 0.120)


def test_a_cached_step_deadline_is_never_shorter_than_the_one_derived_for_the_plan() -> None:
    """The link reuses a derived deadline for plans of one size class; a 2,000-token prefill
    must not inherit the deadline of a 1,100-token one."""
    from collections import deque

    link = worker_link.WorkerLink("sim:1", SchedulerConfig(), 2, on_events=lambda *a: None, on_lost=lambda *a: None)
    rng = random.Random(5)
    decodes = [(0.06 * rng.uniform(0.8, 1.5), 16) for _ in range(100)]
    prefills = [(2.0 * rng.uniform(0.8, 1.5), 1100) for _ in range(3)]
    link.plans.latencies = deque(decodes + prefills, maxlen=worker_link.NUM_LATENCY_SAMPLES)
    for num_tokens in (1, 16, 17, 700, 1100, 1500, 2047, 2048, 4000):
        derived = worker_link.derived_step_deadline(link.plans.latencies, num_tokens)
        assert link.step_deadline(num_tokens) >= derived, num_tokens
    assert link.step_deadline(2047) > worker_link.MIN_STEP_DEADLINE_S  # the case that matters


def test_derived_step_deadline() -> None:
    from collections import deque

    derive = worker_link.derived_step_deadline
    assert derive(deque([(0.05, 8)] * 5)) == worker_link.WARMUP_STEP_DEADLINE_S
    assert derive(deque([(0.05, 8)] * 99 + [(0.2, 8)]), 8) == worker_link.MIN_STEP_DEADLINE_S
    assert derive(deque([(0.05, 8)] * 90 + [(2.0, 8)] * 10), 8) == pytest.approx(40.0)
    # A 2,048-token prefill after fast 8-token decodes gets time in proportion to its tokens.
    assert derive(deque([(0.08, 8)] * 100), 2048) == pytest.approx(20 * 0.01 * 2048)
    # Big prefills seen earlier do not set the pace of a decode step, nor one-token decodes
    # (mostly fixed cost) that of a 128-token step: only steps of comparable size do.
    mixed = deque([(0.05, 1)] * 50 + [(0.3, 128)] * 50 + [(3.0, 512)] * 20)
    assert derive(mixed, 128) == worker_link.MIN_STEP_DEADLINE_S  # 20 x 0.3 s < 10 s
    assert derive(mixed, 512) == pytest.approx(20 * 3.0)
    assert derive(mixed, 4096) == pytest.approx(20 * 3.0 * 8)  # beyond anything seen: scaled
