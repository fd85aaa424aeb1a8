"""The scheduler service: client API (`Generate`, `Tokenize`, `ModelInfo`), request routing over
worker links, streaming of reconciled tokens, metrics.

A request is validated (INVALID_ARGUMENT naming the field), tokenized, routed to a worker by load
and prefix affinity, and its reconciled tokens are streamed back as they are confirmed. A client
cancel or deadline aborts it and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc

from scheduler_svc.request import InvalidRequest, require
from scheduler_svc.router import Router
from scheduler_svc.scheduler import QueueFullError, RequestEvent, SchedulerConfig
from scheduler_svc.worker_link import WorkerLink
from zerobubble import rpc
from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.config import SchedulerServiceConfig

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = generate_pb2.FinishReason
# Our own input limits: far below the transport cap so oversized input gets a clear message.
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024


class EventBuffer:
    """A stream's events not yet sent to its client, merged into one pending event.

    The scheduler only appends here and never waits, so a client that stops reading slows no
    one else; what it holds is one event whose tokens grow at most to its own request's
    remaining output (bounded by max_tokens), not one object per step.
    """

    __slots__ = ("_pending", "_ready")

    def __init__(self) -> None:
        self._pending: RequestEvent | None = None
        self._ready = asyncio.Event()

    def put(self, ev: RequestEvent) -> None:
        pending = self._pending
        if pending is None:
            self._pending = dataclasses.replace(ev, token_ids=list(ev.token_ids),
                                                logprobs=list(ev.logprobs))
        else:
            pending.token_ids.extend(ev.token_ids)
            pending.logprobs.extend(ev.logprobs)
            pending.text += ev.text
            pending.finish_reason = ev.finish_reason
            pending.num_output_tokens = ev.num_output_tokens
            pending.num_cached_tokens = ev.num_cached_tokens
            pending.error = ev.error
            pending.queue_s = ev.queue_s
        self._ready.set()

    def num_pending_tokens(self) -> int:
        return len(self._pending.token_ids) if self._pending is not None else 0

    async def get(self) -> RequestEvent:
        await self._ready.wait()
        ev, self._pending = self._pending, None
        self._ready.clear()
        assert ev is not None
        return ev


@dataclass(slots=True)
class Stream:
    """The client side of one request: where its events go, and timing for metrics."""

    queue: EventBuffer
    arrival: float
    num_prompt_tokens: int
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Client API over a router of worker links."""

    def __init__(self, cfg: SchedulerServiceConfig, router: Router, metrics=None) -> None:
        self.cfg = cfg
        self.router = router
        self.metrics = metrics
        self.streams: dict[str, Stream] = {}
        self.draining = False

    # -- events from worker links --------------------------------------------------------------

    def on_events(self, link: WorkerLink, events: list[RequestEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            stream = self.streams.get(ev.req_id)
            if stream is None:
                continue
            if ev.token_ids:
                if stream.first_token_at is None:
                    stream.first_token_at = now
                    if self.metrics is not None:
                        self.metrics.observe_ttft(now - stream.arrival)
                elif self.metrics is not None:
                    gap = (now - stream.last_token_at) / len(ev.token_ids)
                    for _ in ev.token_ids:
                        self.metrics.observe_inter_token(gap)
                stream.last_token_at = now
                stream.num_output_tokens += len(ev.token_ids)
            stream.queue.put(ev)

    # -- RPCs ----------------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> None:
        """Shutdown: refuse new requests, let running ones finish for up to `timeout_s`, then
        end the rest with CANCELLED (their clients get a final message, not a reset)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.streams:
            logger.warning("drain timeout: cancelling %d running requests", len(self.streams))
        for req_id, stream in list(self.streams.items()):
            event = self.router.abort(req_id)
            if event is None:  # held by no worker (an orphan): build its final event here
                event = RequestEvent(req_id=req_id, token_ids=[], text="", logprobs=[],
                                     finish_reason=FINISH.FINISH_REASON_CANCELLED,
                                     num_prompt_tokens=stream.num_prompt_tokens,
                                     num_output_tokens=stream.num_output_tokens,
                                     num_cached_tokens=0)
            event.error = "the server is shutting down"
            stream.queue.put(event)
        while self.streams and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.05)  # the final messages go out

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        link = self.router.any_ready()
        if link is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        if request.model and request.model != link.info.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model: unknown model "
                                f"{request.model!r}; this server serves {link.info.model!r}")
        try:
            prompt_ids = self._prompt_ids(request, link)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        req_id = request.request_id or uuid.uuid4().hex
        if req_id in self.streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {req_id!r} is already running")
        link = self.router.route(prompt_ids)
        if link is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        stream = Stream(queue=EventBuffer(), arrival=time.monotonic(),
                        num_prompt_tokens=len(prompt_ids))
        self.streams[req_id] = stream
        try:
            self.router.submit(link, req_id, prompt_ids, **self._params(request))
        except InvalidRequest as exc:
            self.streams.pop(req_id, None)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            self.streams.pop(req_id, None)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finished = False
        try:
            while True:
                ev: RequestEvent = await stream.queue.get()
                reply = generate_pb2.GenerateResponse(
                    request_id=req_id, text=ev.text, token_ids=ev.token_ids,
                    logprobs=ev.logprobs, num_prompt_tokens=ev.num_prompt_tokens,
                    num_output_tokens=ev.num_output_tokens,
                    num_cached_prompt_tokens=ev.num_cached_tokens)
                if ev.finish_reason is not None:
                    reply.finish_reason = ev.finish_reason
                    reply.error = ev.error or ""
                    finished = True
                    self._record_finished(stream, ev)
                yield reply
                if finished:
                    return
        finally:
            self.streams.pop(req_id, None)
            if not finished:
                # Client cancel or deadline: abort and give the KV blocks back. The tokens it
                # already generated still count as generated (the counter is tokens out).
                # Its queue time counts if it had been scheduled (None if it never was).
                event = self.router.abort(req_id)
                if self.metrics is not None:
                    self.metrics.record_finished("cancelled", None, time.monotonic() - stream.arrival,
                                                 event.queue_s if event is not None else None,
                                                 stream.num_prompt_tokens, stream.num_output_tokens)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context):
        link = self.router.any_ready()
        if link is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        try:
            ids = self._prompt_ids(request, link)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return generate_pb2.TokenizeResponse(token_ids=ids,
                                             tokens=[link.tokenizer.id_to_token(i) or "" for i in ids])

    async def ModelInfo(self, request, context):
        link = self.router.any_ready()
        if link is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        info = link.info
        stats = generate_pb2.ServerStats()
        for lk in self.router.links:
            stats.num_steps += lk.stats.num_steps
            stats.worker_busy_s += lk.stats.busy_s
            stats.worker_idle_s += lk.stats.idle_s
            if lk.scheduler is not None:
                s = lk.scheduler.stats
                stats.num_drafts += s.num_drafts
                stats.num_draft_tokens += s.num_draft_tokens
                stats.num_accepted_tokens += s.num_accepted_tokens
                stats.num_preemptions += s.num_preemptions
                stats.num_generation_tokens += s.num_generation_tokens
        return generate_pb2.ModelInfoResponse(
            model=info.model, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids, num_workers=len(self.router.ready_links()),
            spec_method=info.spec_method, num_spec_tokens=info.num_spec_tokens,
            max_inflight_steps=self.cfg.max_inflight_steps, stats=stats)

    # -- validation ----------------------------------------------------------------------------

    def _prompt_ids(self, request, link: WorkerLink) -> list[int]:
        kind = request.WhichOneof("input")
        tok = link.tokenizer
        if kind == "prompt":
            require(len(request.prompt) > 0, "prompt: must not be empty")
            require(len(request.prompt) <= MAX_PROMPT_CHARS,
                   f"prompt: {len(request.prompt)} characters, limit is {MAX_PROMPT_CHARS}")
            ids = tok.encode(request.prompt)
        elif kind == "messages":
            msgs = request.messages.messages
            require(len(msgs) > 0, "messages: must not be empty")
            require(len(msgs) <= MAX_MESSAGES, f"messages: {len(msgs)} messages, limit is {MAX_MESSAGES}")
            total = sum(len(m.content) for m in msgs)
            require(total <= MAX_PROMPT_CHARS,
                   f"messages: {total} characters of content, limit is {MAX_PROMPT_CHARS}")
            for i, m in enumerate(msgs):
                require(m.role in ("system", "user", "assistant", "tool"),
                       f"messages[{i}].role: unknown role {m.role!r}")
            try:
                ids = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs])
            except Exception as exc:  # a template's raise_exception, e.g. bad role order
                raise InvalidRequest(f"messages: chat template rejected them: {exc}") from exc
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            require(len(ids) > 0, "token_ids: must not be empty")
            vocab = link.info.vocab_size
            bad = [i for i in ids if not 0 <= i < vocab]
            require(not bad, f"token_ids: {bad[0] if bad else 0} is outside the vocabulary [0, {vocab})")
        else:
            raise InvalidRequest("input: one of prompt, messages or token_ids is required")
        require(len(ids) > 0, "input: tokenizes to no tokens")
        return ids

    @staticmethod
    def _params(request: generate_pb2.GenerateRequest) -> dict:
        """The request's sampling and stopping fields as `Scheduler.add_request` takes them.

        Unset optional fields keep the scheduler's defaults (an unset seed is drawn there);
        the scheduler's validator checks them all.
        """
        s, st = request.sampling, request.stopping
        return dict(temperature=s.temperature if s.HasField("temperature") else 0.0,
                    top_k=s.top_k if s.HasField("top_k") else 0,
                    top_p=s.top_p if s.HasField("top_p") else 1.0,
                    seed=s.seed if s.HasField("seed") else None,
                    max_tokens=st.max_tokens if st.HasField("max_tokens") else None,
                    min_tokens=st.min_tokens, stop=list(st.stop),
                    stop_token_ids=list(st.stop_token_ids), ignore_eos=st.ignore_eos,
                    logprobs=request.response.logprobs)

    def _record_finished(self, stream: Stream, ev: RequestEvent) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        ttft = stream.first_token_at - stream.arrival if stream.first_token_at else None
        reason = FINISH.Name(ev.finish_reason).removeprefix("FINISH_REASON_").lower()
        self.metrics.record_finished(reason, ttft, now - stream.arrival, ev.queue_s,
                                     stream.num_prompt_tokens, stream.num_output_tokens)


async def serve_scheduler(cfg: SchedulerServiceConfig, worker_addresses: list[str] | None = None,
                          ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
                          bound: list | None = None) -> None:
    """Run the scheduler service until `stop` (or SIGTERM)."""
    from zerobubble.metrics import ServiceMetrics, start_metrics_server

    metrics = ServiceMetrics(model="", role="scheduler")
    if cfg.metrics_port >= 0:
        mport = start_metrics_server(metrics, cfg.metrics_port, cfg.host)
        logger.info("scheduler metrics on :%d/metrics", mport)
        print(f"ZEROBUBBLE_METRICS_PORT={mport}", flush=True)
        if bound is not None:
            bound.append(("metrics", mport))
    sched_cfg = SchedulerConfig.from_service(cfg)
    creds = rpc.channel_credentials(cfg.worker_tls_ca or None, cfg.worker_tls_cert or None,
                                    cfg.worker_tls_key or None)
    server = grpc.aio.server(
        options=rpc.SERVER_OPTIONS,
        interceptors=[rpc.BearerAuthInterceptor(cfg.auth_token, SERVICE_NAME,
                                                {"Generate": "unary_stream"})]
        if cfg.auth_token else None)
    health = rpc.add_health_and_reflection(server, [SERVICE_NAME])
    router = Router(sched_cfg, cfg.max_inflight_steps, creds, metrics,
                    worker_auth_token=cfg.worker_auth_token,
                    step_deadline_s=cfg.step_deadline)
    servicer = GenerationServicer(cfg, router, metrics)
    router.on_events = servicer.on_events

    async def on_readiness(serving: bool) -> None:
        await rpc.set_serving(health, [SERVICE_NAME], serving)

    router.on_readiness = on_readiness
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    server_creds = rpc.server_credentials(cfg.tls_cert or None, cfg.tls_key or None)
    port = rpc.bind(server, cfg.host, cfg.port, server_creds)
    await server.start()
    await rpc.set_serving(health, [SERVICE_NAME], False)  # until a worker is connected
    await router.start(worker_addresses if worker_addresses is not None else cfg.worker_addresses())
    logger.info("scheduler listening on %s:%d", cfg.host, port)
    print(f"ZEROBUBBLE_SCHEDULER_PORT={port}", flush=True)
    if bound is not None:
        bound.append(("grpc", port))
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    rpc.install_stop_signals(stop)
    await stop.wait()
    # Health first (load balancers stop routing), then the running requests get the drain time.
    router.on_readiness = None
    await rpc.set_serving(health, [SERVICE_NAME], False)
    logger.info("shutting down: draining %d requests for up to %.0fs", len(servicer.streams),
                cfg.drain_timeout)
    await servicer.drain(cfg.drain_timeout)
    await rpc.graceful_stop(server, health, [SERVICE_NAME], grace_s=2.0)
    await router.close()


def run_scheduler(cfg: SchedulerServiceConfig) -> None:
    """Entry point of `zerobubble scheduler`."""
    asyncio.run(serve_scheduler(cfg))
