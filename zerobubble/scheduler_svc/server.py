"""The scheduler service: client API (`Generate`, `Tokenize`, `ModelInfo`), request routing over
worker links, streaming of reconciled tokens, metrics.

A request is validated (INVALID_ARGUMENT naming the field), tokenized, routed to a worker by load
and prefix affinity, and its reconciled tokens are streamed back as they are confirmed. A client
cancel or deadline aborts it and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from zerobubble import rpc
from zerobubble.api import front_pb2_grpc, generate_pb2, generate_pb2_grpc, worker_pb2
from zerobubble.config import SchedulerServiceConfig
from zerobubble.request_options import (
    InvalidRequest,
    SamplingOptions,
    StoppingOptions,
    for_sequence,
    from_generate_request,
    from_proto,
    shown,
)
from zerobubble.scheduler_svc import front_gateway
from zerobubble.scheduler_svc.front_pool import FrontPool
from zerobubble.scheduler_svc.request import prediction_ids, request_prompt_ids, tokenize_response
from zerobubble.scheduler_svc.router import Router
from zerobubble.scheduler_svc.scheduler import QueueFullError, RequestEvent, SchedulerConfig
from zerobubble.scheduler_svc.submission import (
    DeliverPlain,
    ReplyOrEnd,
    RequestError,
    Stream,
    Submission,
    unknown_model,
)
from zerobubble.scheduler_svc.worker_link import WorkerLink
from zerobubble.structured import GrammarChecker

if TYPE_CHECKING:
    from zerobubble.metrics import ServiceMetrics
    from zerobubble.scheduler_svc.http_api import HTTPFront

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = generate_pb2.FinishReason


def merge_pending(ev: RequestEvent, queue: asyncio.Queue) -> list[RequestEvent]:
    """`ev` and the events already waiting behind it, merged per request (sequence), in order
    of first appearance.

    When the scheduler confirms tokens faster than a stream is written (many streams, a busy
    loop), one message then carries several steps' tokens: the number of writes per step
    adapts to the load instead of every step costing one write per stream. With n > 1 the
    queue holds the events of every sequence, so only events of the same sequence merge.
    """
    merged: dict[str, list[RequestEvent]] = {ev.req_id: [ev]}
    while not queue.empty():
        nxt: RequestEvent = queue.get_nowait()
        events = merged.get(nxt.req_id)
        if events is None:
            merged[nxt.req_id] = [nxt]
        elif events[-1].finish_reason is None:  # nothing follows a final event
            events.append(nxt)
    return [join_events(events) for events in merged.values()]


def join_events(events: list[RequestEvent]) -> RequestEvent:
    """The last of `events`, now carrying every earlier one's tokens before its own (its state
    is the newest).

    Changes that event in place: an event is built for one step and owned by its stream from
    then on (`dataclasses.replace` was a visible share of the scheduler's time at 256 streams).
    All are joined at once, so gathering n events costs O(n), not O(n^2).
    """
    last = events[-1]
    if len(events) == 1:
        return last
    last.token_ids = [t for e in events for t in e.token_ids]
    last.text = "".join([e.text for e in events])
    last.logprobs = [x for e in events for x in e.logprobs]
    last.top_logprobs = [x for e in events for x in e.top_logprobs]
    return last


def take_held(stream: Stream, ev: RequestEvent) -> RequestEvent:
    """`ev` with the tokens the stream gathered under --stream-interval in front; none held after."""
    if not stream.held:
        return ev
    held, stream.held, stream.num_held_tokens = stream.held, [], 0
    held.append(ev)
    return join_events(held)


def sequence_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request: ``seed`` itself for the first, then distinct
    well-mixed 64-bit keys (splitmix64), so the n sequences draw independent noise and a request
    with n = 1 samples exactly as before."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Client API over a router of worker links."""

    def __init__(self, cfg: SchedulerServiceConfig, router: Router, metrics=None) -> None:
        self.cfg = cfg
        self.router = router
        self.metrics = metrics
        self.streams: dict[str, Stream] = {}
        self.draining = False
        self._grammars: GrammarChecker | None = None

    # -- events from worker links --------------------------------------------------------------

    def on_events(self, link: WorkerLink, events: list[RequestEvent]) -> None:
        now = time.monotonic()
        interval = self.cfg.stream_interval
        gaps: list[tuple[float, int]] = []  # (inter-token gap, tokens) of each stream, observed at once
        for ev in events:
            stream = self.streams.get(ev.req_id)
            if stream is None:
                continue
            is_first = stream.first_token_at is None
            if ev.token_ids:
                if is_first:
                    stream.first_token_at = now
                    if self.metrics is not None and not stream.relayed:
                        self.metrics.observe_ttft(now - stream.arrival)
                elif self.metrics is not None and stream.last_token_at is not None:
                    gaps.append(((now - stream.last_token_at) / len(ev.token_ids), len(ev.token_ids)))
                stream.last_token_at = now
                stream.num_output_tokens += len(ev.token_ids)
            # --stream-interval: gather tokens until there are enough for one message; the
            # first token (time to first token) and the final message never wait.
            if (
                interval > 1
                and not is_first
                and ev.finish_reason is None
                and stream.num_held_tokens + len(ev.token_ids) < interval
            ):
                stream.held.append(ev)
                stream.num_held_tokens += len(ev.token_ids)
                continue
            stream.deliver(take_held(stream, ev))
        if gaps and self.metrics is not None:
            self.metrics.observe_inter_token(gaps)

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
                event = RequestEvent(
                    req_id=req_id,
                    token_ids=[],
                    text="",
                    logprobs=[],
                    finish_reason=FINISH.FINISH_REASON_CANCELLED,
                    num_prompt_tokens=stream.num_prompt_tokens,
                    num_output_tokens=stream.num_output_tokens,
                    num_cached_tokens=0,
                )
            event.error = "the server is shutting down"
            stream.deliver(take_held(stream, event))
        while self.streams and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.05)  # the final messages go out

    def submit(self, request: generate_pb2.GenerateRequest, detokenize: bool = True) -> Submission:
        """Validate, tokenize, route and queue one request: the one path gRPC and HTTP share.
        `detokenize` False: the replies carry no text and stop strings are not looked for (a
        front does both, and reports stops with `stop_sequence`).

        Raises:
            RequestError: the request was refused (the status says why; nothing was queued).
        """
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        link = self.router.any_ready()
        if link is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        info, tokenizer = link.described()
        if request.model and request.model != info.model:
            raise unknown_model(request.model, info.model)
        sampling, stopping = from_generate_request(request)
        try:
            prompt_ids = request_prompt_ids(request, tokenizer, info)
            if sampling.prediction_text and not sampling.prediction_token_ids:
                sampling.prediction_token_ids = prediction_ids(sampling.prediction_text, tokenizer, info)
            del sampling.prediction_token_ids[info.max_model_len :]
            sampling.validate(info.vocab_size)
            if sampling.constraint is not None:
                sampling.grammar = self.grammar_checker(info).compile(sampling.constraint)
        except InvalidRequest as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        req_id = request.request_id or uuid.uuid4().hex
        # n > 1: n scheduler requests (one per sequence, each with its own seed stream) on one
        # worker; the later ones wait for the first one's prompt blocks and share them.
        n = sampling.n
        seq_ids = (req_id,) if n == 1 else tuple(f"{req_id}#{i}" for i in range(n))
        if any(seq_id in self.streams for seq_id in seq_ids):
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {shown(req_id)} is already running")
        link = self.router.route(prompt_ids)
        if link is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        queue: asyncio.Queue = asyncio.Queue()  # shared: the servicer reads every sequence's events
        now = time.monotonic()
        streams = tuple(
            Stream(queue=queue, arrival=now, num_prompt_tokens=len(prompt_ids), deliver=queue.put_nowait, index=i)
            for i in range(n)
        )
        self.streams.update(zip(seq_ids, streams))
        try:
            self._queue_sequences(link, seq_ids, prompt_ids, sampling, stopping, detokenize)
        except (InvalidRequest, QueueFullError) as exc:
            self._drop(seq_ids)
            code = (
                grpc.StatusCode.INVALID_ARGUMENT
                if isinstance(exc, InvalidRequest)
                else grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            raise RequestError(code, str(exc)) from exc
        return Submission(req_id, streams[0], seq_ids, streams)

    def _queue_sequences(
        self,
        link: WorkerLink,
        seq_ids: Sequence[str],
        prompt_ids: list[int],
        sampling: SamplingOptions,
        stopping: StoppingOptions,
        detokenize: bool,
    ) -> None:
        """Queue each sequence of a request on ``link``: one alone keeps the client's seed (or
        none, for the scheduler to draw); several derive theirs from one shared seed."""
        if len(seq_ids) == 1:
            self.router.submit(link, seq_ids[0], prompt_ids, sampling, stopping, detokenize=detokenize)
            return
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(64)
        for i, seq_id in enumerate(seq_ids):
            self.router.submit(
                link,
                seq_id,
                prompt_ids,
                for_sequence(sampling, sequence_seed(seed, i)),
                stopping,
                share_prompt_with=seq_ids[0] if i > 0 else None,
                detokenize=detokenize,
            )

    async def admitted(self, submission: Submission) -> None:
        """Queued already: `submit` refuses synchronously here."""

    def grammar_checker(self, info: worker_pb2.WorkerInfo) -> GrammarChecker:
        """The grammar checker for the served model's tokenizer (a new one if it changed)."""
        checker = self._grammars
        if checker is None or checker.tokenizer_json != info.tokenizer_json:
            checker = self._grammars = GrammarChecker(info.tokenizer_json, list(info.eos_token_ids))
        return checker

    async def precheck(self, request: generate_pb2.GenerateRequest) -> None:
        """Compile and check a constrained request's grammar in a thread the first time its
        constraint is seen, so that `submit`, which asks again, finds it cached and never
        compiles a grammar on the event loop. `RequestError` when it does not compile."""
        if not request.HasField("constraint"):
            return
        link = self.router.any_ready()
        constraint = from_proto(request.constraint)
        if link is None or constraint is None:
            return  # submit refuses it, or there is nothing to check
        info, _ = link.described()
        try:
            checker = self.grammar_checker(info)
            if not checker.known(constraint):
                await asyncio.to_thread(checker.compile, constraint)
        except InvalidRequest as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    def withdraw(self, submission: Submission) -> None:
        """Drop a submitted request whose replies will never be read (a front end refused the
        call it belonged to): every one of its sequences is aborted and its KV blocks freed."""
        self._drop(submission.seq_ids or (submission.req_id,))

    def _drop(self, seq_ids: Sequence[str]) -> None:
        for seq_id in seq_ids:
            self.streams.pop(seq_id, None)
            self.router.abort(seq_id)  # a no-op for one that was never queued

    async def responses(self, submission: Submission) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        """The reply messages of a submitted request, each sequence's last one with its finish
        reason (``index`` tells the n sequences apart).

        Leaving early (client cancel, deadline, a closed HTTP connection) aborts the request and
        gives its KV blocks back.
        """
        streams = submission.streams or (submission.stream,)
        queue = streams[0].queue
        try:
            while not all(stream.finished for stream in streams):
                for ev in merge_pending(await queue.get(), queue):
                    stream = self.streams.get(ev.req_id)
                    if stream is not None:  # else its sequence was dropped
                        yield self._reply(submission, stream, ev)
        finally:
            self.close(submission)

    def relay(
        self,
        submission: Submission,
        deliver: Callable[[ReplyOrEnd], None],
        deliver_plain: DeliverPlain | None = None,
    ) -> None:
        """Hand each reply of `submission` to ``deliver`` as the scheduler produces it, and
        None after the last one: `responses` without its queue and task, for a caller that
        batches replies itself (a front's stream, `front_gateway.py`). `close` it if its reader
        leaves early.

        With ``deliver_plain``, a reply that carries nothing but tokens (no text, no
        log-probabilities, not the last, after a whole one with the same cached count) goes there as
        (index, token ids, output tokens so far) instead of as a message: its reader rebuilds
        it from the sequence's last whole reply (`EngineMessage.plain`).
        """
        streams = submission.streams or (submission.stream,)

        def on_event(ev: RequestEvent) -> None:
            stream = self.streams.get(ev.req_id)
            if stream is None:
                pass  # its sequence was dropped
            elif (
                deliver_plain is not None
                and ev.finish_reason is None
                and ev.num_cached_tokens == stream.relayed_cached
                and not (ev.text or ev.logprobs or ev.top_logprobs)
            ):
                deliver_plain(stream.index, ev.token_ids, ev.num_output_tokens)
            else:
                stream.relayed_cached = ev.num_cached_tokens
                deliver(self._reply(submission, stream, ev))
            if all(stream.finished for stream in streams):
                self.close(submission)
                deliver(None)

        for stream in streams:
            stream.deliver = on_event
            stream.relayed = True
            while not stream.queue.empty():  # whatever arrived before the relay was set up
                on_event(stream.queue.get_nowait())

    def _reply(self, submission: Submission, stream: Stream, ev: RequestEvent) -> generate_pb2.GenerateResponse:
        """The client message for one event of `submission`'s sequence `stream`; a final event
        marks its sequence finished and counts it in the metrics."""
        reply = generate_pb2.GenerateResponse(
            request_id=submission.req_id,
            text=ev.text,
            token_ids=ev.token_ids,
            logprobs=ev.logprobs,
            num_prompt_tokens=ev.num_prompt_tokens,
            num_output_tokens=ev.num_output_tokens,
            num_cached_prompt_tokens=ev.num_cached_tokens,
            index=stream.index,
        )
        if ev.prediction is not None:
            reply.num_accepted_prediction_tokens, reply.num_rejected_prediction_tokens = ev.prediction
        for ids, lps in ev.top_logprobs:
            reply.top_logprobs.add(token_ids=ids, logprobs=lps)
        if ev.finish_reason is not None:
            reply.finish_reason = ev.finish_reason  # type: ignore[assignment]
            reply.error = ev.error or ""
            stream.finished = True
            self._record_finished(stream, ev.finish_reason, ev.queue_s)
        return reply

    def close(self, submission: Submission) -> None:
        """The replies of `submission` are over: forget its streams. Sequences that did not
        finish (client cancel, deadline, its front gone) are aborted, their KV blocks given
        back; the tokens they generated still count as generated (the counter is tokens out),
        and their queue time counts if they had been scheduled."""
        seq_ids = submission.seq_ids or (submission.req_id,)
        streams = submission.streams or (submission.stream,)
        for seq_id, stream in zip(seq_ids, streams):
            self._end(seq_id, stream, FINISH.FINISH_REASON_CANCELLED)

    def _end(self, seq_id: str, stream: Stream, finish_reason: int) -> None:
        """Forget a sequence's stream and, unless it finished already, abort it (KV blocks
        back) and count it finished for `finish_reason`, once."""
        if self.streams.pop(seq_id, None) is None or stream.finished:
            return
        stream.finished = True
        event = self.router.abort(seq_id)
        self._record_finished(stream, finish_reason, event.queue_s if event is not None else None)

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        try:
            await self.precheck(request)
            submission = self.submit(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        async with contextlib.aclosing(self.responses(submission)) as replies:
            async for reply in replies:
                yield reply

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context):
        link = self.router.any_ready()
        if link is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
            return None  # abort raises; this tells the type checker
        info, tok = link.described()
        try:
            return tokenize_response(request, tok, info)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

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
            stats.grammar_s += lk.stats.grammar_s
            if lk.scheduler is not None:
                s = lk.scheduler.stats
                stats.num_drafts += s.spec.num_drafts
                stats.num_draft_tokens += s.spec.num_draft_tokens
                stats.num_accepted_tokens += s.spec.num_accepted_tokens
                stats.num_prediction_draft_tokens += s.prediction.num_draft_tokens
                stats.num_prediction_accepted_tokens += s.prediction.num_accepted_tokens
                stats.num_preemptions += s.num_preemptions
                stats.num_generation_tokens += s.num_generation_tokens
        return generate_pb2.ModelInfoResponse(
            model=info.model,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            num_workers=len(self.router.ready_links()),
            spec_method=info.spec_method,
            num_spec_tokens=info.num_spec_tokens,
            max_inflight_steps=self.cfg.max_inflight_steps,
            stats=stats,
        )

    def stop_sequence(self, submission: Submission, index: int, num_output_tokens: int) -> bool:
        """A front found a stop string in sequence `index` of `submission` after
        `num_output_tokens` tokens: end it as the scheduler would have (abort it, KV blocks
        back, counted as stopped with that many tokens). Returns whether every sequence of the
        submission has finished now. A sequence that finished meanwhile is left as it ended."""
        seq_ids = submission.seq_ids or (submission.req_id,)
        streams = submission.streams or (submission.stream,)
        if 0 <= index < len(streams):
            stream = streams[index]
            if not stream.finished:
                stream.num_output_tokens = num_output_tokens  # what its client got
            self._end(seq_ids[index], stream, FINISH.FINISH_REASON_STOP_SEQUENCE)
        return all(stream.finished for stream in streams)

    def _record_finished(self, stream: Stream, finish_reason: int, queue_s: float | None) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        reason = FINISH.Name(finish_reason).removeprefix("FINISH_REASON_").lower()
        self.metrics.record_finished(
            reason,
            None if stream.relayed else now - stream.arrival,
            queue_s,
            stream.num_prompt_tokens,
            stream.num_output_tokens,
        )

    def observe_front_load(self, front: str, cpu_seconds: float, num_calls: int) -> None:
        """Account a front's own load (`FrontLoad`)."""
        if self.metrics is not None:
            self.metrics.record_front_load(front, cpu_seconds, num_calls)

    def forget_front(self, front: str) -> None:
        """A front detached: its series go."""
        if self.metrics is not None:
            self.metrics.forget_front(front)

    def observe_relayed(self, ttft_s: Sequence[float], e2e_s: Sequence[float]) -> None:
        """Account what a front's clients saw (the calls it relays are not timed here)."""
        if self.metrics is None:
            return
        for seconds in ttft_s:
            self.metrics.observe_ttft(seconds)
        for seconds in e2e_s:
            self.metrics.observe_e2e(seconds)


async def serve_scheduler(
    cfg: SchedulerServiceConfig,
    worker_addresses: list[str] | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    bound: list | None = None,
) -> None:
    """Run the scheduler service until `stop` (or SIGTERM/SIGINT); `bound` gets the ports.

    Raises:
        ConfigError: the settings cannot work (the rules the CLI applies, for callers that
            build a config themselves).
    """
    cfg.validate(needs_workers=worker_addresses is None)
    bound = bound if bound is not None else []
    metrics = _start_metrics(cfg, bound)
    router = _build_router(cfg, metrics)
    servicer = GenerationServicer(cfg, router, metrics)
    router.on_events = servicer.on_events
    server = _grpc_server(cfg, servicer)
    health = rpc.add_health_and_reflection(server, [SERVICE_NAME])

    async def on_readiness(serving: bool) -> None:
        await rpc.set_serving(health, [SERVICE_NAME], serving)

    router.on_readiness = on_readiness
    # With fronts, they own the client port; the scheduler listens for them on loopback only.
    if cfg.fronts:
        port = rpc.bind(server, "127.0.0.1", 0, None)
    else:
        port = rpc.bind(server, cfg.host, cfg.port, rpc.server_credentials(cfg.tls_cert or None, cfg.tls_key or None))
    await server.start()
    await rpc.set_serving(health, [SERVICE_NAME], False)  # until a worker is connected
    await router.start(worker_addresses if worker_addresses is not None else cfg.worker_addresses())
    fronts, http = await _start_client_ports(cfg, servicer, port, bound)
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    rpc.install_stop_signals(stop)
    # Started once gRPC's threads exist, so its first sweep moves them off the loop's cores.
    pinning = asyncio.create_task(rpc.keep_loop_thread_on(cfg.loop_core_set())) if cfg.loop_cores else None
    await stop.wait()
    if pinning is not None:
        pinning.cancel()
    # Health first (load balancers stop routing), then the running requests get the drain time.
    router.on_readiness = None
    await rpc.set_serving(health, [SERVICE_NAME], False)
    logger.info("shutting down: draining %d requests for up to %.0fs", len(servicer.streams), cfg.drain_timeout)
    drain_until = time.monotonic() + cfg.drain_timeout
    if fronts is not None:
        await fronts.stop()  # each front lets its calls finish first, while this process serves them
    await servicer.drain(max(drain_until - time.monotonic(), 0.0))
    if http is not None:
        await http.stop(grace_s=2.0)
    await rpc.graceful_stop(server, health, [SERVICE_NAME], grace_s=2.0)
    await router.close()


def _start_metrics(cfg: SchedulerServiceConfig, bound: list) -> ServiceMetrics:
    """The service's metrics, served on ``--metrics-port`` unless it is negative."""
    from zerobubble.metrics import ServiceMetrics, start_metrics_server

    metrics = ServiceMetrics(model="", role="scheduler")
    if cfg.metrics_port >= 0:
        mport = start_metrics_server(metrics, cfg.metrics_port, cfg.host)
        logger.info("scheduler metrics on :%d/metrics", mport)
        rpc.announce_port("METRICS", mport)
        bound.append(("metrics", mport))
    return metrics


def _build_router(cfg: SchedulerServiceConfig, metrics: ServiceMetrics) -> Router:
    """The router over the worker links, configured from the service's flags."""
    return Router(
        SchedulerConfig.from_service(cfg),
        cfg.max_inflight_steps,
        rpc.channel_credentials(cfg.worker_tls_ca or None, cfg.worker_tls_cert or None, cfg.worker_tls_key or None),
        metrics,
        worker_auth_token=cfg.worker_auth_token,
        step_deadline_s=cfg.step_deadline,
        lookahead_margin_s=cfg.lookahead_margin_ms / 1000 if cfg.lookahead_margin_ms >= 0 else None,
    )


def _grpc_server(cfg: SchedulerServiceConfig, servicer: GenerationServicer) -> grpc.aio.Server:
    """The gRPC server with the client API and the fronts' gateway, behind the bearer token
    when one is set (fronts are clients too: they send the same token)."""
    server = grpc.aio.server(
        options=rpc.SERVER_OPTIONS,
        interceptors=[
            rpc.BearerAuthInterceptor(cfg.auth_token, SERVICE_NAME, {"Generate": "unary_stream"}),
            rpc.BearerAuthInterceptor(cfg.auth_token, front_gateway.SERVICE_NAME, {"Attach": "stream_stream"}),
        ]
        if cfg.auth_token
        else None,
    )
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    front_pb2_grpc.add_FrontGatewayServicer_to_server(front_gateway.FrontGateway(servicer), server)
    return server


async def _start_client_ports(
    cfg: SchedulerServiceConfig, servicer: GenerationServicer, port: int, bound: list
) -> tuple[FrontPool | None, HTTPFront | None]:
    """Open what clients connect to: the fronts (which own the gRPC and HTTP ports then) or the
    scheduler's own gRPC port, plus its HTTP front when ``--http-port`` is set."""
    fronts = None
    if cfg.fronts:
        logger.info("scheduler listening for its fronts on 127.0.0.1:%d", port)
        fronts = FrontPool(cfg, port)
        port, http_port = await fronts.start()
        if http_port >= 0:
            logger.info("OpenAI-compatible HTTP on %s:%d (the fronts)", cfg.host, http_port)
            rpc.announce_port("HTTP", http_port)
    logger.info("scheduler listening on %s:%d", cfg.host, port)
    rpc.announce_port("SCHEDULER", port)
    bound.append(("grpc", port))
    http = None
    if cfg.http_port >= 0 and not cfg.fronts:  # with fronts, they serve it
        from zerobubble.scheduler_svc.http_api import start_http  # FastAPI only when HTTP is on

        http = await start_http(
            servicer, cfg.host, cfg.http_port, auth_token=cfg.auth_token, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key
        )
        logger.info("OpenAI-compatible HTTP on %s:%d", cfg.host, http.port)
        rpc.announce_port("HTTP", http.port)
    return fronts, http


def run_scheduler(cfg: SchedulerServiceConfig) -> None:
    """Entry point of `zerobubble scheduler`."""
    rpc.run_service(serve_scheduler(cfg), cfg.event_loop, cfg.cpu_affinity)
