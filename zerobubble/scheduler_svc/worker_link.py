"""One worker as seen from the scheduler: its `Execute` stream, its in-flight window, its
scheduler (each worker is a data-parallel replica with its own KV block pool).

The pump never waits for a step's result before planning the next one: it keeps up to
`max_inflight_steps` plans on the wire (1 = the synchronous baseline, same code path) and
reconciles results as they arrive one or more steps late.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from zerobubble import rpc
from zerobubble.api import worker_pb2, worker_pb2_grpc
from zerobubble.scheduler_svc.scheduler import RequestEvent, Scheduler, SchedulerConfig
from zerobubble.scheduler_svc.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# A worker that does not answer a step within the deadline is declared lost (a stuck driver, a
# long GC pause, SIGSTOP: alive, sockets open, silent). Without a --step-deadline it is derived
# from the latencies of its recent steps (plan sent to result back, window included).
MIN_STEP_DEADLINE_S = 10.0
STEP_DEADLINE_P99_FACTOR = 20.0
# Until this many steps were seen (the first big prefills, warm-up), a more lenient deadline.
NUM_WARMUP_STEPS = 20
WARMUP_STEP_DEADLINE_S = 60.0
NUM_LATENCY_SAMPLES = 256
# Steps of a size comparable to a plan's needed before their latencies alone set its deadline.
NUM_COMPARABLE_STEPS = 5
# A derived deadline is reused for plans of the same size until this many more results came
# back: deriving it reads every recent latency, and the link asks after every wake-up (0.4 ms
# a step at 256 requests), while a deadline only has to follow the worker's pace over time.
DEADLINE_REFRESH_STEPS = 32
# A plan ahead of the running step goes out this long (at least LOOKAHEAD_STEP_FRACTION of a
# step) before the worker is expected to need it (see `plan_ahead_due`).
DEFAULT_LOOKAHEAD_MARGIN_S = 0.02
LOOKAHEAD_STEP_FRACTION = 0.25
# ... and only while requests are arriving: within this many steps of the latest arrival.
ARRIVAL_WINDOW_STEPS = 8


class WorkerHung(ConnectionError):
    """The worker did not answer a step within the deadline."""


class WorkerDrained(ConnectionError):
    """A draining worker finished its requests; the link closes its stream."""


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def derived_step_deadline(latencies: deque[tuple[float, int]], num_tokens: int = 1) -> float:
    """How long a plan of `num_tokens` may wait for its result, from recent (latency, tokens).

    max(10 s, 20 x p99 latency of the recent steps of a comparable size (half to twice the
    plan's tokens)). Only comparable steps count: a decode step must not wait as long as the
    big prefills seen earlier (a hung worker would go unnoticed for a minute), nor a prefill
    be held to a decode's pace. With too few comparable steps, the largest ones seen set the
    pace, scaled up by how much larger the plan is. Lenient until enough steps are known.
    """
    if len(latencies) < NUM_WARMUP_STEPS:
        return WARMUP_STEP_DEADLINE_S
    near = [lat for lat, n in latencies if num_tokens / 2 <= n <= 2 * num_tokens]
    if len(near) >= NUM_COMPARABLE_STEPS:
        base = _p99(near)
    else:
        largest = max(n for _, n in latencies)
        base = _p99([lat for lat, n in latencies if n >= largest / 2]) * max(1.0, num_tokens / max(1, largest))
    return max(MIN_STEP_DEADLINE_S, STEP_DEADLINE_P99_FACTOR * base)


def predicted_step_s(step_times: deque[tuple[float, int]], num_tokens: int) -> float | None:
    """A short estimate of how long a step of `num_tokens` runs on the worker: the 10th
    percentile of the device times of recent steps of a comparable size (half to twice the
    tokens); None with fewer than NUM_COMPARABLE_STEPS of them. Short on purpose: a plan sent
    early costs nothing, one sent late leaves the worker idle."""
    near = sorted(t for t, n in step_times if num_tokens / 2 <= n <= 2 * num_tokens)
    if len(near) < NUM_COMPARABLE_STEPS:
        return None
    return near[len(near) // 10]


def arrivals_recent(since_arrival_s: float, step_s: float) -> bool:
    """Whether requests are arriving, so that holding a plan ahead back may let one join it.

    Holding it back costs something on a CPU: its planning and receipt then interrupt the
    running step a second time, after the result's (about 7 % longer steps at concurrency 1,
    docs/benchmarks/host.md). With no request arriving there is nothing to wait for.
    """
    return since_arrival_s <= ARRIVAL_WINDOW_STEPS * step_s


def plan_ahead_due(start_s: float, num_inflight: int, step_s: float, margin_s: float) -> float:
    """When a plan ahead of `num_inflight` plans in flight should go out, the oldest of which
    started at `start_s` and the others queued behind it, each about `step_s` long.

    Planned at once, a request arriving while step N runs waits for N + 1 too, which was planned
    when N started; with steps much longer than the host's planning (a CPU, a large prefill) that
    is a whole step of time to first token. So the plan goes out when the steps ahead of it are
    expected to end, less the margin (at least LOOKAHEAD_STEP_FRACTION of a step); with steps
    shorter than the margin this is at once, as before.
    """
    return start_s + num_inflight * step_s - max(margin_s, LOOKAHEAD_STEP_FRACTION * step_s)


def plan_tokens(plan: worker_pb2.StepPlan) -> int:
    """Tokens a plan feeds the model (prefill chunks, 1 + drafts per decode)."""
    decodes = plan.decodes
    return (
        len(decodes.req_ids)
        + sum(decodes.num_draft_slots)
        + sum(len(e.token_ids) or 1 + e.num_draft_slots for e in plan.requests)
    )


@dataclass(slots=True)
class LinkStats:
    """Worker time as reported with each result (the bubble is `idle_s`)."""

    num_steps: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    grammar_s: float = 0.0  # host time filling grammar masks (structured output)


class WorkerLink:
    """Connects to one worker, keeps its plan window full and routes its results."""

    def __init__(
        self,
        address: str,
        config: SchedulerConfig,
        max_inflight_steps: int,
        on_events: Callable[[WorkerLink, list[RequestEvent]], None],
        on_lost: Callable[[WorkerLink], None],
        creds: grpc.ChannelCredentials | None = None,
        on_step: Callable[[WorkerLink, worker_pb2.StepResult], None] | None = None,
        on_ready: Callable[[WorkerLink], None] | None = None,
        server_name: str | None = None,
        auth_token: str = "",
        step_deadline_s: float = 0.0,
        lookahead_margin_s: float | None = DEFAULT_LOOKAHEAD_MARGIN_S,
    ) -> None:
        """`step_deadline_s` 0: derived from recent step latencies (`derived_step_deadline`).
        `lookahead_margin_s` None: plans ahead go out at once (see `plan_ahead_due`)."""
        self.address = address
        self.step_deadline_s = step_deadline_s
        self.lookahead_margin_s = lookahead_margin_s
        # (device seconds, tokens) of recent steps, and when the latest result arrived (the
        # worker then starts the next queued step): what `plan_ahead_due` is computed from.
        self._step_times: deque[tuple[float, int]] = deque(maxlen=NUM_LATENCY_SAMPLES)
        # `predicted_step_s` of the last plan size asked, until the next step time arrives:
        # while requests arrive, every arrival asks again for the same oldest plan in flight.
        self._predicted: tuple[int, float | None] | None = None
        self._last_result_at = 0.0
        self._last_arrival_at = float("-inf")
        # (send time, tokens) of the plans in flight, oldest first; (latency, tokens) of recent.
        self._sent: deque[tuple[float, int]] = deque()
        self._latencies: deque[tuple[float, int]] = deque(maxlen=NUM_LATENCY_SAMPLES)
        self._deadlines: dict[int, float] = {}  # derived deadline by plan size class (see DEADLINE_REFRESH_STEPS)
        self._num_since_refresh = 0
        # Each deadline miss doubles the next deadline (reset after a run of answered steps),
        # so a worker that is merely slow cannot be dropped and re-added in a loop.
        self._num_misses = 0
        self._num_answered = 0
        self._metadata = rpc.bearer_metadata(auth_token)
        # The name the worker's TLS certificate is checked against when `address` is an IP
        # resolved from a DNS name (None: the host part of `address`).
        self.server_name = server_name
        self.base_config = config
        self.max_inflight = max(1, max_inflight_steps)
        self.on_events = on_events
        self.on_lost = on_lost
        self.on_step = on_step
        self.on_ready = on_ready
        self.creds = creds
        self.info: worker_pb2.WorkerInfo | None = None
        self.scheduler: Scheduler | None = None
        self.tokenizer: Tokenizer | None = None
        self.ready = False
        self.draining = False  # the worker is shutting down: no new requests for it
        self.on_draining: Callable[[WorkerLink], None] | None = None
        self.inflight = 0
        self.stats = LinkStats()
        self._wake = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._closing = False

    @property
    def sched(self) -> Scheduler:
        """The scheduler of a configured link (every ready link has one)."""
        assert self.scheduler is not None, f"worker link {self.address} is not configured yet"
        return self.scheduler

    def described(self) -> tuple[worker_pb2.WorkerInfo, Tokenizer]:
        """The worker's facts and tokenizer, read when the link connected (ready links only)."""
        assert self.info is not None and self.tokenizer is not None, f"worker link {self.address} is not configured yet"
        return self.info, self.tokenizer

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info is not None else self.address

    def load(self) -> int:
        """Requests this worker holds (for routing)."""
        return self.scheduler.num_unfinished() if self.scheduler is not None else 0

    def wake(self) -> None:
        self._wake.set()

    def note_arrival(self) -> None:
        """A new request was queued on this link's scheduler (see `arrivals_recent`)."""
        self._last_arrival_at = time.monotonic()
        self.wake()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"link-{self.address}")

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        backoff = 0.2
        while not self._closing:
            channel = rpc.aio_channel(self.address, self.creds, self.server_name)
            try:
                stub = worker_pb2_grpc.WorkerStub(channel)
                self.info = await stub.Describe(worker_pb2.DescribeRequest(), timeout=10, metadata=self._metadata)
                self._configure(self.info)
                self.draining = False
                call = stub.Execute(metadata=self._metadata)
                self.ready = True
                if self.on_ready is not None:
                    self.on_ready(self)
                backoff = 0.2
                logger.info(
                    "connected to worker %s at %s (%d blocks)", self.info.worker_id, self.address, self.info.num_blocks
                )
                self.wake()
                await self._serve(call)
            except asyncio.CancelledError:
                raise
            # InvalidStateError: a write found the call already finished (the worker died
            # between two plans, before the receiver saw it). It is a lost stream like the others.
            except (grpc.aio.AioRpcError, ConnectionError, asyncio.InvalidStateError) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and (exc.code() == grpc.StatusCode.UNAUTHENTICATED):
                    logger.error(
                        "worker %s refused our token (--worker-auth-token must equal the worker's --auth-token): %s",
                        self.address,
                        exc.details(),
                    )
                elif isinstance(exc, WorkerDrained):
                    logger.info("worker %s drained: %s", self.address, exc)
                elif self.ready:
                    logger.warning("lost worker %s: %s", self.address, exc)
                else:
                    logger.debug("worker %s not reachable: %s", self.address, exc)
            except Exception:
                # A bug or a bad result in the receive path (reconciliation, detokenizer,
                # callbacks) must not end this task: that would lose the worker until restart.
                # Reset the link like a lost stream; its requests resume from confirmed tokens.
                logger.exception("worker link %s failed; resetting it", self.address)
            finally:
                was_ready = self.ready
                self.ready = False
                self.inflight = 0
                await channel.close(grace=None)
                if was_ready:
                    try:
                        self.on_lost(self)
                    except Exception:
                        logger.exception("re-queueing the requests of worker %s failed", self.address)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _configure(self, info: worker_pb2.WorkerInfo) -> None:
        """(Re)build this link's scheduler for the worker's capacity; a reconnect starts clean."""
        cfg = self.base_config.with_worker(info)
        if self.tokenizer is None:
            self.tokenizer = Tokenizer(info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token)
            # The streaming tables (one entry per vocabulary id: 125 ms for SmolLM2's 49k) are
            # built now, not inside the first request's admission, which would stall every
            # stream on the loop and add them to that request's time to first token.
            self.tokenizer.byte_pieces()
        self.scheduler = Scheduler(cfg, self.tokenizer)

    def step_deadline(self, num_tokens: int = 1) -> float:
        """Seconds the oldest plan in flight (of `num_tokens`) may wait for its result."""
        base = self.step_deadline_s
        if not base:
            # Plans of one size class (up to the next power of two) share it, derived for the
            # class's largest plan so that it is never short for any of them: decode plans
            # differ by a few tokens from step to step as draft slots vary.
            size_class = num_tokens.bit_length()
            base = self._deadlines.get(size_class, 0.0)
            if not base:
                largest = (1 << size_class) - 1
                base = self._deadlines[size_class] = derived_step_deadline(self._latencies, largest)
        return base * 2 ** min(self._num_misses, 5)

    def _ahead_due(self) -> float | None:
        """When the next plan ahead of those in flight should go out (None: at once)."""
        if self.lookahead_margin_s is None or not self._sent:
            return None
        sent_at, num_tokens = self._sent[0]
        num_tokens = max(num_tokens, 1)
        if self._predicted is None or self._predicted[0] != num_tokens:
            self._predicted = (num_tokens, predicted_step_s(self._step_times, num_tokens))
        step_s = self._predicted[1]
        if step_s is None or not arrivals_recent(time.monotonic() - self._last_arrival_at, step_s):
            return None
        # The oldest plan started when it was sent or when the step before it ended, whichever
        # came last; its result arriving is when the step before ended, as near as we know.
        start_s = max(sent_at, self._last_result_at)
        return plan_ahead_due(start_s, len(self._sent), step_s, self.lookahead_margin_s)

    async def _serve(self, call) -> None:
        self._sent.clear()
        self._step_times.clear()
        self._predicted = None
        receiver = asyncio.create_task(self._receive(call))
        try:
            while True:
                due = await self._send_plans(call)
                self._wake.clear()
                waiter = asyncio.create_task(self._wake.wait())
                timeout = None
                if self._sent:
                    sent_at, num_tokens = self._sent[0]
                    deadline = self.step_deadline(num_tokens)
                    # Wake for the deadline or, when a plan ahead is held back, for its due time.
                    until = sent_at + deadline if due is None else min(sent_at + deadline, due)
                    timeout = max(0.0, until - time.monotonic())
                done, _ = await asyncio.wait({waiter, receiver}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if receiver in done:
                    waiter.cancel()
                    receiver.result()  # raises the stream error
                    raise ConnectionError("worker closed the stream")
                if self.draining and self.inflight == 0 and not self.sched.has_unfinished():
                    waiter.cancel()
                    raise WorkerDrained("the worker is shutting down and holds no request")
                if not done:
                    waiter.cancel()
                    if self._sent and time.monotonic() - self._sent[0][0] >= deadline:
                        self._num_misses += 1
                        self._num_answered = 0
                        raise WorkerHung(f"no answer to a step for {deadline:.1f}s (the step deadline)")
        finally:
            receiver.cancel()
            call.cancel()

    async def _send_plans(self, call) -> float | None:
        """Fill the window of plans in flight; returns when a plan ahead that is held back is
        due (None: none is held back)."""
        async with self._send_lock:  # the serving loop and the receiver both send
            due: float | None = None
            while self.inflight < self.max_inflight:
                due = self._ahead_due()
                plan = None
                if due is None or due <= time.monotonic():
                    due = None
                    plan = self.sched.schedule()
                if plan is None:
                    plan = self.sched.notice_plan()  # finish notices never wait
                if plan is None:
                    break
                self.inflight += 1
                self._sent.append((time.monotonic(), plan_tokens(plan)))
                await call.write(plan)
            return due

    async def _receive(self, call) -> None:
        while True:
            result = await call.read()
            if result is grpc.aio.EOF:
                raise ConnectionError("worker closed the stream")
            if result.draining and not self.draining:
                logger.info("worker %s is shutting down: no new requests for it", self.worker_id)
                self.draining = True
                if self.on_draining is not None:
                    self.on_draining(self)
            if result.step_id == 0:  # a notice, not the answer to a plan
                self.wake()
                continue
            self.inflight -= 1
            self._last_result_at = time.monotonic()
            if result.num_tokens > 0 and result.forward_s > 0 and not result.error:
                self._step_times.append((result.forward_s, result.num_tokens))
                self._predicted = None
            if self._sent:
                sent_at, num_tokens = self._sent.popleft()
                self._latencies.append((self._last_result_at - sent_at, num_tokens))
                self._num_since_refresh += 1
                if self._num_since_refresh >= DEADLINE_REFRESH_STEPS or len(self._latencies) <= NUM_WARMUP_STEPS:
                    self._deadlines.clear()
                    self._num_since_refresh = 0
                self._num_answered += 1
                if self._num_answered >= NUM_LATENCY_SAMPLES:
                    self._num_misses = 0
            self._account(result)
            if result.error:
                logger.error("worker %s step %d failed: %s", self.worker_id, result.step_id, result.error)
                events = self.sched.fail_step(result.step_id, result.error)
            else:
                events = self.sched.on_step_result(result)
            if self.on_step is not None:
                self.on_step(self, result)
            # The next plan goes out before the clients' streams are served: the worker may be
            # waiting for it, while a client's tokens can wait the few hundred microseconds.
            try:
                await self._send_plans(call)
            finally:
                if events:
                    self.on_events(self, events)
            self.wake()

    def _account(self, result: worker_pb2.StepResult) -> None:
        self.stats.num_steps += 1
        self.stats.busy_s += result.forward_s
        self.stats.idle_s += result.idle_s
        self.stats.grammar_s += result.grammar_s
