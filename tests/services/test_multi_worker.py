"""One scheduler over two real worker processes: routing spreads requests, and a worker killed
with SIGKILL mid-generation costs no request, no token and no change in greedy output.

Both workers run n-gram speculation with the default async window, so when one dies it has plans
in flight and optimistic placeholders outstanding: the re-queued requests must resume from their
confirmed tokens only.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from tests.support.metrics_scrape import scrape, total
from tests.support.polling import wait_until
from tests.support.servers import start_scheduler, start_worker, wait_serving
from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.client import Completion, build_request, complete
from zerobubble.request_options import StoppingOptions

pytestmark = pytest.mark.timeout(400)

MAX_TOKENS = 32
# Chat prompts: SmolLM2's template puts the same system prompt (several KV blocks) in front of
# each, which is what prefix-affinity routing sees in real traffic.
QUESTIONS = [
    "Name three primes and explain why each is prime.",
    "Describe how a bicycle works in a few sentences.",
    "Write a short poem about the sea at night.",
    "List the planets of the solar system in order.",
]


# -- routing policy and link recovery, without processes ------------------------------------------


class FakeScheduler:
    def __init__(self, load: int, cached: int) -> None:
        self.load, self.cached = load, cached

    def cached_prefix_blocks(self, token_ids) -> int:
        return self.cached


class FakeLink:
    def __init__(self, name: str, load: int, cached: int) -> None:
        self.name, self.ready, self.draining = name, True, False
        self.scheduler = FakeScheduler(load, cached)
        self.sched = self.scheduler  # WorkerLink.sched: the scheduler of a configured link

    def load(self) -> int:
        return self.scheduler.load


@pytest.mark.parametrize(
    "links, expected",
    [
        # Equal load: the prefix-cache hit wins.
        ([("a", 0, 0), ("b", 0, 3)], "b"),
        # A little busier is worth a prefix hit...
        ([("a", 1, 0), ("b", 3, 3)], "b"),
        # ...but a shared prefix must not pin traffic to a worker far busier than another.
        ([("a", 0, 0), ("b", 3, 3)], "a"),
        ([("a", 5, 2), ("b", 9, 40), ("c", 6, 1)], "a"),
        # No hit anywhere: the lightest load.
        ([("a", 4, 0), ("b", 2, 0)], "b"),
    ],
)
def test_route_prefers_prefix_hits_within_a_load_bound(links, expected):
    from zerobubble.scheduler_svc.router import Router
    from zerobubble.scheduler_svc.scheduler import SchedulerConfig

    router = Router(SchedulerConfig(), max_inflight_steps=2)
    router.links = [FakeLink(*spec) for spec in links]
    assert router.route([1, 2, 3]).name == expected


def fake_worker_info(smollm2_dir):
    """What a small worker serving SmolLM2's tokenizer describes itself as."""
    from zerobubble.api import worker_pb2
    from zerobubble.worker_svc.server import tokenizer_fields

    return worker_pb2.WorkerInfo(
        worker_id="fake",
        model="m",
        max_model_len=256,
        block_size=16,
        num_blocks=64,
        vocab_size=49152,
        eos_token_ids=[2],
        max_num_seqs=4,
        **tokenizer_fields(smollm2_dir),
    )


class DeadCall:
    """An Execute stream whose call has already finished: every write raises."""

    async def write(self, plan):
        raise asyncio.InvalidStateError("RPC already finished.")

    async def read(self):
        await asyncio.Event().wait()  # the failure shows up on write first

    def cancel(self):
        pass


def test_link_reconnects_after_writing_to_a_finished_stream(monkeypatch, smollm2_dir):
    """A worker can die between two plans: the next `write` then finds the call already done
    (asyncio.InvalidStateError, not an RpcError). The link must count the worker as lost,
    hand its requests back, and keep trying to reconnect, instead of dying for good."""
    from zerobubble.scheduler_svc import worker_link
    from zerobubble.scheduler_svc.scheduler import SchedulerConfig

    info = fake_worker_info(smollm2_dir)
    describes: list[float] = []

    class Stub:
        def __init__(self, channel):
            pass

        async def Describe(self, request, timeout=None, metadata=None):
            describes.append(time.monotonic())
            return info

        def Execute(self, metadata=None):
            return DeadCall()

    monkeypatch.setattr(worker_link.worker_pb2_grpc, "WorkerStub", Stub)
    lost: list[list[str]] = []

    async def scenario():
        def on_ready(link):
            if not lost:
                link.scheduler.add_request("r1", [1, 2, 3, 4], None, StoppingOptions(max_tokens=4))

        def on_lost(link):
            lost.append([r.req_id for r in link.scheduler.take_unfinished()])

        link = worker_link.WorkerLink("127.0.0.1:1", SchedulerConfig(), 2, lambda *a: None, on_lost, on_ready=on_ready)
        link.start()
        deadline = time.monotonic() + 10
        while len(describes) < 2 and time.monotonic() < deadline and not link.pump.task.done():
            await asyncio.sleep(0.05)
        crashed = link.pump.task.done() and not link.pump.task.cancelled()
        await link.close()
        return crashed

    crashed = asyncio.run(scenario())
    assert lost and lost[0] == ["r1"], "the request was not handed back"
    assert not crashed, "the link task died instead of reconnecting"
    assert len(describes) >= 2, "the link never tried to reconnect"


def chat(question: str) -> dict:
    return dict(messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, ignore_eos=True)


def steps(worker) -> float:
    """Steps the worker itself has executed (its own /metrics)."""
    return total(scrape(worker.ports["METRICS"]), "zerobubble_worker_step_duration_seconds_count")


def check_stream(c: Completion, replies: list) -> None:
    """Each message's running count matches the tokens delivered so far: none lost or repeated."""
    count = 0
    for reply in replies:
        count += len(reply.token_ids)
        assert reply.num_output_tokens == count, (c.request_id, reply.num_output_tokens, count)
    assert count == len(c.token_ids) == MAX_TOKENS
    assert c.finish_reason == "max_tokens", (c.finish_reason, c.error)


async def run_all(target: str, requests: list[dict], on_response=None, stagger: bool = False):
    """Send `requests`; with `stagger`, each starts once the previous one streamed a token."""
    replies: list[list] = [[] for _ in requests]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        tasks = []
        for i, r in enumerate(requests):
            first = asyncio.Event()

            def record(reply, i=i, first=first):
                replies[i].append(reply)
                if reply.token_ids:
                    first.set()
                if on_response is not None:
                    on_response(i, reply)

            tasks.append(asyncio.create_task(complete(stub, build_request(**r), timeout=300, on_response=record)))
            if stagger:
                await asyncio.wait({tasks[-1], asyncio.create_task(first.wait())}, return_when=asyncio.FIRST_COMPLETED)
        completions = await asyncio.gather(*tasks)
        info = await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=30)
    return completions, replies, info


def wait_for_workers(target: str, num_workers: int) -> None:
    """Until the scheduler at ``target`` serves with ``num_workers`` workers connected (serving
    means one is)."""
    wait_serving(target)
    with grpc.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        wait_until(
            lambda: stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=10).num_workers >= num_workers,
            60,
            f"the scheduler to connect to {num_workers} workers",
        )


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    started = time.monotonic()
    workers = [
        start_worker(kv_cache_memory_gb=0.2, max_num_seqs=8, metrics_port=0, spec_method="ngram", num_spec_tokens=3)
        for _ in range(2)
    ]
    scheduler = start_scheduler(workers)
    try:
        wait_for_workers(scheduler.target, 2)
        print(f"cluster up in {time.monotonic() - started:.1f}s")
        yield scheduler, workers
    finally:
        scheduler.stop()
        for w in workers:
            w.stop()


def test_staggered_chat_requests_use_both_workers(cluster):
    """Requests that arrive one after another, all sharing the chat template's system prompt.

    Once the first worker holds that prefix, affinity alone would send every later request to
    it while the other worker idles; load must still win when the imbalance grows.
    """
    scheduler, workers = cluster
    before = [steps(w) for w in workers]
    completions, replies, _ = asyncio.run(run_all(scheduler.target, [chat(q) for q in QUESTIONS], stagger=True))
    for c, r in zip(completions, replies):
        check_stream(c, r)
    moved = [steps(w) - b for w, b in zip(workers, before)]
    assert all(m > 0 for m in moved), f"steps per worker: {moved}"


def test_killed_worker_loses_no_request_and_changes_no_output(cluster):
    scheduler, workers = cluster
    requests = [chat(q) for q in QUESTIONS]

    # The run without failure: concurrent requests spread over both workers by load.
    before = [steps(w) for w in workers]
    started = time.monotonic()
    reference, ref_replies, info = asyncio.run(run_all(scheduler.target, requests))
    print(f"reference run: {time.monotonic() - started:.1f}s")
    assert info.num_workers == 2
    moved = [steps(w) - b for w, b in zip(workers, before)]
    assert all(m > 0 for m in moved), f"steps per worker: {moved}"
    per_worker = {
        s.labels["worker"]: s.value
        for s in scrape(scheduler.ports["METRICS"])
        if s.name == "zerobubble_worker_step_duration_seconds_count"
    }
    assert len(per_worker) == 2 and all(v > 0 for v in per_worker.values()), per_worker
    for c, r in zip(reference, ref_replies):
        check_stream(c, r)

    # The same requests again; the second worker is SIGKILLed once every stream is under way.
    victim = workers[1]
    counts = [0] * len(requests)
    at_kill: list[int] = []

    def maybe_kill(i: int, reply) -> None:
        counts[i] += len(reply.token_ids)
        if not at_kill and min(counts) >= 4:
            at_kill.extend(counts)
            victim.proc.send_signal(signal.SIGKILL)

    started = time.monotonic()
    outputs, replies, info = asyncio.run(run_all(scheduler.target, requests, maybe_kill))
    print(f"run with a killed worker: {time.monotonic() - started:.1f}s")
    victim.proc.wait(timeout=10)
    assert at_kill, "the worker was never killed"
    assert max(at_kill) < MAX_TOKENS, f"a request had already finished at the kill: {at_kill}"
    log = "".join(scheduler.log)
    assert "re-queueing" in log, "the killed worker held no request: the test proved nothing"
    assert info.num_workers == 1

    for i, (c, r) in enumerate(zip(outputs, replies)):
        check_stream(c, r)
        assert c.token_ids == reference[i].token_ids, f"request {i} differs after the failover"
        assert c.text == reference[i].text

    # The dead worker's gauges must not keep its last live values (plans in flight, KV blocks
    # held): alerts and the autoscaler read them.
    sched = scrape(scheduler.ports["METRICS"])
    dead = {
        s.labels["worker"]
        for s in sched
        if s.name == "zerobubble_inflight_steps" and s.labels["worker"].endswith(f":{victim.port}")
    }
    assert len(dead) == 1, dead
    for name in ("zerobubble_inflight_steps", "zerobubble_kv_cache_usage_ratio"):
        assert total(sched, name, worker=next(iter(dead))) == 0, name
    assert total(sched, "zerobubble_num_requests_running") == 0
    assert total(sched, "zerobubble_num_requests_waiting") == 0


def test_a_device_fault_exits_the_worker_and_its_requests_finish_elsewhere():
    """On CUDA a kernel fault (an illegal access) surfaces at the wait for a step's result copy,
    and the context then refuses all work. The worker exits at once, leaving the step
    unanswered, so its scheduler moves its requests, confirmed tokens and all, to the other
    worker: none is lost, none changes. Simulated devices (greedy output depends on the prompt
    only); the fault is injected into one worker's 10th result copy."""
    opts = dict(simulate_device_ms=2.0, spec_method="ngram", num_spec_tokens=3, max_num_seqs=16)
    healthy = start_worker(**opts)
    faulty = start_worker(**opts, env={"ZEROBUBBLE_TEST_DEVICE_FAULT_AT_STEP": "10"})
    requests = [dict(r, max_tokens=96) for r in (chat(q) for q in QUESTIONS)]
    schedulers = []
    try:
        alone = start_scheduler([healthy])
        schedulers.append(alone)
        wait_serving(alone.target)
        reference, _, _ = asyncio.run(run_all(alone.target, requests))
        # A worker serves one scheduler: left running, this one's link would reconnect and take
        # the healthy worker's stream from the next one, again and again (a flaky "no worker is
        # ready" there; the requests still finished, each loss re-queued them).
        alone.stop()
        both = start_scheduler([healthy, faulty])
        schedulers.append(both)
        wait_for_workers(both.target, 2)
        outputs, _, info = asyncio.run(run_all(both.target, requests))
        assert faulty.proc.wait(timeout=30) == 70
        assert "device fault, exiting" in "".join(faulty.log)
        assert "re-queueing" in "".join(both.log), "the faulty worker held no request: the test proved nothing"
        assert info.num_workers == 1
        for i, c in enumerate(outputs):
            assert c.finish_reason == "max_tokens", (i, c.finish_reason, c.error)
            assert c.token_ids == reference[i].token_ids, f"request {i} changed after the failover"
    finally:
        for service in (*schedulers, healthy, faulty):
            service.stop()


def test_a_silent_worker_is_found_by_keepalive_within_seconds():
    """A worker that stops answering without closing its connection (a hung host, a dropped
    network path; here SIGSTOP) is found by the link's keepalive ping going unanswered, within
    its keepalive settings (10 s + 5 s), not gRPC's default ping timeout of a minute; its
    requests finish on the other worker. The step deadline is set far away, so only the
    keepalive can notice."""
    opts = dict(simulate_device_ms=5.0, spec_method="ngram", num_spec_tokens=3, max_num_seqs=16)
    healthy, silent = start_worker(**opts), start_worker(**opts)
    scheduler = start_scheduler([healthy, silent], step_deadline=600.0)
    stopped: list[float] = []
    try:
        wait_for_workers(scheduler.target, 2)
        requests = [dict(r, max_tokens=400) for r in (chat(q) for q in QUESTIONS)]

        num_replies = [0]

        def stop_once_under_way(i: int, reply: generate_pb2.GenerateResponse) -> None:
            num_replies[0] += 1
            if not stopped and num_replies[0] >= 10 * len(requests):
                stopped.append(time.monotonic())
                silent.proc.send_signal(signal.SIGSTOP)

        outputs, _, _ = asyncio.run(run_all(scheduler.target, requests, on_response=stop_once_under_way))
        finished = time.monotonic()
        assert stopped, "the worker was never stopped"
        log = "".join(scheduler.log)
        assert "ping timeout" in log and "re-queueing" in log, "the silent worker held no request or was not found"
        assert all(c.finish_reason == "max_tokens" for c in outputs), [(c.finish_reason, c.error) for c in outputs]
        assert finished - stopped[0] < 40, f"the requests finished {finished - stopped[0]:.0f} s after the stop"
    finally:
        if silent.proc.poll() is None:
            silent.proc.send_signal(signal.SIGCONT)
        for service in (scheduler, healthy, silent):
            service.stop()
