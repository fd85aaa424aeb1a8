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
from dataclasses import dataclass, field

import grpc

from zerobubble import rpc
from zerobubble.api import worker_pb2, worker_pb2_grpc
from zerobubble.scheduler_svc.scheduler import RequestEvent, Scheduler, SchedulerConfig
from zerobubble.scheduler_svc.suffix import SharedOutputs
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
    rows = plan.rows
    return sum(n or 1 + k for n, k in zip(rows.num_tokens, rows.num_draft_slots))


@dataclass(slots=True)
class LinkStats:
    """Worker time as reported with each result (the bubble is `idle_s`)."""

    num_steps: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    grammar_s: float = 0.0  # host time filling grammar masks (structured output)


@dataclass(slots=True)
class LinkChannel:
    """Where and how one worker is reached; each (re)connection opens a fresh gRPC channel."""

    address: str
    creds: grpc.ChannelCredentials | None = None
    # The name the worker's TLS certificate is checked against when `address` is an IP
    # resolved from a DNS name (None: the host part of `address`).
    server_name: str | None = None
    metadata: tuple[tuple[str, str], ...] | None = None

    def open(self) -> grpc.aio.Channel:
        return rpc.aio_channel(self.address, self.creds, self.server_name)


@dataclass(slots=True)
class LinkCallbacks:
    """What the link tells its owner (the router): results, loss, readiness, draining."""

    on_events: Callable[[WorkerLink, list[RequestEvent]], None]
    on_lost: Callable[[WorkerLink], None]
    on_step: Callable[[WorkerLink, worker_pb2.StepResult], None] | None = None
    on_ready: Callable[[WorkerLink], None] | None = None
    on_draining: Callable[[WorkerLink], None] | None = None


@dataclass(slots=True)
class PlanBook:
    """The plans in flight on one stream, oldest first, and the step deadline their answers
    imply (`step_deadline_s` 0: derived from recent latencies, see `derived_step_deadline`)."""

    step_deadline_s: float = 0.0
    # (send time, tokens) of the plans in flight; (latency, tokens) of recent answers.
    sent: deque[tuple[float, int]] = field(default_factory=deque)
    latencies: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=NUM_LATENCY_SAMPLES))
    deadlines: dict[int, float] = field(default_factory=dict)  # by plan size class (see DEADLINE_REFRESH_STEPS)
    num_since_refresh: int = 0
    # Each deadline miss doubles the next deadline (reset after a run of answered steps),
    # so a worker that is merely slow cannot be dropped and re-added in a loop.
    num_misses: int = 0
    num_answered: int = 0

    def oldest(self) -> tuple[float, int] | None:
        """(send time, tokens) of the oldest plan in flight."""
        return self.sent[0] if self.sent else None

    def note_sent(self, now: float, num_tokens: int) -> None:
        self.sent.append((now, num_tokens))

    def note_answered(self, now: float) -> None:
        """The oldest plan in flight was answered at `now`."""
        if not self.sent:
            return
        sent_at, num_tokens = self.sent.popleft()
        self.latencies.append((now - sent_at, num_tokens))
        self.num_since_refresh += 1
        if self.num_since_refresh >= DEADLINE_REFRESH_STEPS or len(self.latencies) <= NUM_WARMUP_STEPS:
            self.deadlines.clear()
            self.num_since_refresh = 0
        self.num_answered += 1
        if self.num_answered >= NUM_LATENCY_SAMPLES:
            self.num_misses = 0

    def note_missed(self) -> None:
        self.num_misses += 1
        self.num_answered = 0

    def deadline(self, num_tokens: int = 1) -> float:
        """Seconds the oldest plan in flight (of `num_tokens`) may wait for its result."""
        base = self.step_deadline_s
        if not base:
            # Plans of one size class (up to the next power of two) share it, derived for the
            # class's largest plan so that it is never short for any of them: decode plans
            # differ by a few tokens from step to step as draft slots vary.
            size_class = num_tokens.bit_length()
            base = self.deadlines.get(size_class, 0.0)
            if not base:
                largest = (1 << size_class) - 1
                base = self.deadlines[size_class] = derived_step_deadline(self.latencies, largest)
        return base * 2 ** min(self.num_misses, 5)


@dataclass(slots=True)
class Pacer:
    """How many plans may be on the wire and when the next plan ahead should go out
    (`lookahead_margin_s` None: plans ahead go out at once, see `plan_ahead_due`)."""

    max_inflight: int
    lookahead_margin_s: float | None = DEFAULT_LOOKAHEAD_MARGIN_S
    num_inflight: int = 0
    # (device seconds, tokens) of recent steps, and when the latest result arrived (the
    # worker then starts the next queued step): what `plan_ahead_due` is computed from.
    step_times: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=NUM_LATENCY_SAMPLES))
    # `predicted_step_s` of the last plan size asked, until the next step time arrives:
    # while requests arrive, every arrival asks again for the same oldest plan in flight.
    predicted: tuple[int, float | None] | None = None
    last_result_at: float = 0.0
    last_arrival_at: float = float("-inf")

    def restart(self) -> None:
        """A new stream: the step times of the previous one do not carry over."""
        self.step_times.clear()
        self.predicted = None

    def has_room(self) -> bool:
        return self.num_inflight < self.max_inflight

    def note_result(self, result: worker_pb2.StepResult, now: float) -> None:
        self.num_inflight -= 1
        self.last_result_at = now
        if result.num_tokens > 0 and result.forward_s > 0 and not result.error:
            self.step_times.append((result.forward_s, result.num_tokens))
            self.predicted = None

    def ahead_due(self, plans: PlanBook) -> float | None:
        """When the next plan ahead of those in flight should go out (None: at once)."""
        oldest = plans.oldest()
        if self.lookahead_margin_s is None or oldest is None:
            return None
        sent_at, num_tokens = oldest
        num_tokens = max(num_tokens, 1)
        if self.predicted is None or self.predicted[0] != num_tokens:
            self.predicted = (num_tokens, predicted_step_s(self.step_times, num_tokens))
        step_s = self.predicted[1]
        if step_s is None or not arrivals_recent(time.monotonic() - self.last_arrival_at, step_s):
            return None
        # The oldest plan started when it was sent or when the step before it ended, whichever
        # came last; its result arriving is when the step before ended, as near as we know.
        start_s = max(sent_at, self.last_result_at)
        return plan_ahead_due(start_s, len(plans.sent), step_s, self.lookahead_margin_s)


@dataclass(slots=True)
class Pump:
    """The link's own task and what steers it: the serving loop's wake-up, the lock the loop
    and the receiver both send plans under, and whether the link is closing (the task then
    stops reconnecting). Held as one: nothing outside the link's loop uses them."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task | None = None
    closing: bool = False


class WorkerLink:
    """Connects to one worker, keeps its plan window full and routes its results.

    The connection (`channel`), the window's pacing (`pacer`), the plans in flight with their
    deadline (`plans`) and the link's task (`pump`) are each their own small object; the link
    runs the stream between them.
    """

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
        self.channel = LinkChannel(address, creds, server_name, rpc.bearer_metadata(auth_token))
        self.callbacks = LinkCallbacks(on_events, on_lost, on_step, on_ready)
        self.pacer = Pacer(max(1, max_inflight_steps), lookahead_margin_s)
        self.plans = PlanBook(step_deadline_s)
        self.base_config = config
        self.info: worker_pb2.WorkerInfo | None = None
        self.scheduler: Scheduler | None = None
        self.tokenizer: Tokenizer | None = None
        # Suffix decoding's index of all outputs, shared by the router's links (None: the
        # scheduler keeps its own).
        self.suffix_outputs: SharedOutputs | None = None
        self.ready = False
        self.draining = False  # the worker is shutting down: no new requests for it
        self.stats = LinkStats()
        self.pump = Pump()

    @property
    def address(self) -> str:
        return self.channel.address

    @property
    def inflight(self) -> int:
        """Plans on the wire that were not answered yet."""
        return self.pacer.num_inflight

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
        self.pump.wake.set()

    def note_arrival(self) -> None:
        """A new request was queued on this link's scheduler (see `arrivals_recent`)."""
        self.pacer.last_arrival_at = time.monotonic()
        self.wake()

    def start(self) -> None:
        self.pump.task = asyncio.create_task(self._run(), name=f"link-{self.address}")

    async def close(self) -> None:
        self.pump.closing = True
        if self.pump.task is not None:
            self.pump.task.cancel()
            try:
                await self.pump.task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        backoff = 0.2
        while not self.pump.closing:
            channel = self.channel.open()
            try:
                call = await self._connect(channel)
                backoff = 0.2
                await self._serve(call)
            except asyncio.CancelledError:
                raise
            # InvalidStateError: a write found the call already finished (the worker died
            # between two plans, before the receiver saw it). It is a lost stream like the others.
            except (grpc.aio.AioRpcError, ConnectionError, asyncio.InvalidStateError) as exc:
                self._log_lost(exc)
            except Exception:
                # A bug or a bad result in the receive path (reconciliation, detokenizer,
                # callbacks) must not end this task: that would lose the worker until restart.
                # Reset the link like a lost stream; its requests resume from confirmed tokens.
                logger.exception("worker link %s failed; resetting it", self.address)
            finally:
                await self._reset(channel)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _connect(self, channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
        """Describe the worker, (re)build its scheduler and open its `Execute` stream."""
        stub = worker_pb2_grpc.WorkerStub(channel)
        self.info = await stub.Describe(worker_pb2.DescribeRequest(), timeout=10, metadata=self.channel.metadata)
        self._configure(self.info)
        self.draining = False
        call = stub.Execute(metadata=self.channel.metadata)
        self.ready = True
        if self.callbacks.on_ready is not None:
            self.callbacks.on_ready(self)
        logger.info("connected to worker %s at %s (%d blocks)", self.info.worker_id, self.address, self.info.num_blocks)
        self.wake()
        return call

    def _log_lost(self, exc: Exception) -> None:
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

    async def _reset(self, channel: grpc.aio.Channel) -> None:
        """After a stream ended: close its channel and hand a ready link's requests back."""
        was_ready = self.ready
        self.ready = False
        self.pacer.num_inflight = 0
        await channel.close(grace=None)
        if was_ready:
            try:
                self.callbacks.on_lost(self)
            except Exception:
                logger.exception("re-queueing the requests of worker %s failed", self.address)

    def _configure(self, info: worker_pb2.WorkerInfo) -> None:
        """(Re)build this link's scheduler for the worker's capacity; a reconnect starts clean."""
        cfg = self.base_config.with_worker(info)
        if self.tokenizer is None:
            self.tokenizer = Tokenizer(info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token)
            # The streaming tables (one entry per vocabulary id: 125 ms for SmolLM2's 49k) are
            # built now, not inside the first request's admission, which would stall every
            # stream on the loop and add them to that request's time to first token.
            self.tokenizer.byte_pieces()
        self.scheduler = Scheduler(cfg, self.tokenizer, suffix_outputs=self.suffix_outputs)

    def step_deadline(self, num_tokens: int = 1) -> float:
        """Seconds the oldest plan in flight (of `num_tokens`) may wait for its result."""
        return self.plans.deadline(num_tokens)

    async def _serve(self, call: grpc.aio.StreamStreamCall) -> None:
        self.plans.sent.clear()
        self.pacer.restart()
        receiver = asyncio.create_task(self._receive(call))
        try:
            while True:
                due = await self._send_plans(call)
                self.pump.wake.clear()
                waiter = asyncio.create_task(self.pump.wake.wait())
                timeout = None
                oldest = self.plans.oldest()
                if oldest is not None:
                    sent_at, num_tokens = oldest
                    deadline = self.plans.deadline(num_tokens)
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
                    oldest = self.plans.oldest()
                    if oldest is not None and time.monotonic() - oldest[0] >= deadline:
                        self.plans.note_missed()
                        raise WorkerHung(f"no answer to a step for {deadline:.1f}s (the step deadline)")
        finally:
            receiver.cancel()
            call.cancel()

    async def _send_plans(self, call: grpc.aio.StreamStreamCall) -> float | None:
        """Fill the window of plans in flight; returns when a plan ahead that is held back is
        due (None: none is held back)."""
        async with self.pump.send_lock:  # the serving loop and the receiver both send
            due: float | None = None
            while self.pacer.has_room():
                due = self.pacer.ahead_due(self.plans)
                plan = None
                if due is None or due <= time.monotonic():
                    due = None
                    plan = self.sched.schedule()
                if plan is None:
                    plan = self.sched.notice_plan()  # finish notices never wait
                if plan is None:
                    break
                self.pacer.num_inflight += 1
                self.plans.note_sent(time.monotonic(), plan_tokens(plan))
                await call.write(plan)
            return due

    async def _receive(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            result = await call.read()
            if result is grpc.aio.EOF:
                raise ConnectionError("worker closed the stream")
            if result.draining and not self.draining:
                logger.info("worker %s is shutting down: no new requests for it", self.worker_id)
                self.draining = True
                if self.callbacks.on_draining is not None:
                    self.callbacks.on_draining(self)
            if result.step_id == 0:  # a notice, not the answer to a plan
                self.wake()
                continue
            now = time.monotonic()
            self.pacer.note_result(result, now)
            self.plans.note_answered(now)
            self._account(result)
            if result.error:
                logger.error("worker %s step %d failed: %s", self.worker_id, result.step_id, result.error)
                events = self.sched.fail_step(result.step_id, result.error)
            else:
                events = self.sched.on_step_result(result)
            if self.callbacks.on_step is not None:
                self.callbacks.on_step(self, result)
            # The next plan goes out before the clients' streams are served: the worker may be
            # waiting for it, while a client's tokens can wait the few hundred microseconds.
            try:
                await self._send_plans(call)
            finally:
                if events:
                    self.callbacks.on_events(self, events)
            self.wake()

    def _account(self, result: worker_pb2.StepResult) -> None:
        self.stats.num_steps += 1
        self.stats.busy_s += result.forward_s
        self.stats.idle_s += result.idle_s
        self.stats.grammar_s += result.grammar_s
