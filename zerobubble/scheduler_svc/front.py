"""`zerobubble front`: a client-facing process in front of a scheduler.

It serves the same `Generation` API as the scheduler (and, with `--http-port`, its OpenAI HTTP
API), but owns only the client calls: every request goes to the scheduler as one entry of a
`FrontMessage` on a single `Attach` stream
(`scheduler_svc/front_gateway.py`), and the replies of a scheduler loop turn come back in one
`EngineMessage`, which this process fans out to its clients. The scheduler's planning loop so
pays one gRPC message per turn instead of one per client reply; the per-reply cost moves here,
to a process that can run on other cores (several fronts can share one port: gRPC listens with
`SO_REUSEPORT`, and the kernel spreads client connections over them).

The front tokenizes and detokenizes: it takes the workers' tokenizer from the scheduler
(`Describe`), sends prompts as token ids, read by the scheduler's own `request_prompt_ids`,
makes the replies' text from their token ids (`CallText`, the scheduler's `Detokenizer`) and
finds the stop strings, ending a sequence in the scheduler when one hits (`Stopped`). The
checks of the options stay in the scheduler (docs/INTERNALS.md, "Fronts"); a refused request
gets the scheduler's status and message either way.
`Tokenize` and `ModelInfo` are passed through. If the stream to the scheduler is lost, running
calls end with UNAVAILABLE, the front reports NOT_SERVING and reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zerobubble import rpc
from zerobubble.api import front_pb2, front_pb2_grpc, generate_pb2, generate_pb2_grpc, worker_pb2
from zerobubble.config import FrontConfig
from zerobubble.request_options import MAX_N, InvalidRequest, from_generate_request
from zerobubble.scheduler_svc.detokenizer import Detokenizer
from zerobubble.scheduler_svc.request import prediction_ids, request_prompt_ids, tokenize_response
from zerobubble.scheduler_svc.submission import RequestError, Stream, Submission, unknown_model
from zerobubble.scheduler_svc.tokenizer import Tokenizer

if TYPE_CHECKING:
    from zerobubble.scheduler_svc.http_api import HTTPFront

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(slots=True, frozen=True)
class Refused:
    """A call the scheduler refused (or that cannot reach it): the status its client gets."""

    code: grpc.StatusCode
    message: str


# What a sequence's plain replies share with its last whole one: request id, prompt tokens,
# cached prompt tokens.
Constants = tuple[str, int, int]

ACCEPTED = object()  # the scheduler queued the call
DONE = object()  # a call's last reply has been queued
LOST = Refused(grpc.StatusCode.UNAVAILABLE, "the front lost its connection to the scheduler")
LOAD_INTERVAL_S = 1.0  # how often a front reports its load (`FrontLoad`) to the scheduler


class _Outgoing:
    """What one `Attach` stream has yet to send, taken whole once per loop turn."""

    __slots__ = ("pending", "wake")

    def __init__(self) -> None:
        self.pending = front_pb2.FrontMessage(reads_plain=True)
        self.wake = asyncio.Event()

    async def messages(self) -> AsyncIterator[front_pb2.FrontMessage]:
        while True:
            await self.wake.wait()
            self.wake.clear()
            message, self.pending = self.pending, front_pb2.FrontMessage(reads_plain=True)
            yield message


class EngineLink:
    """The front's one stream to the scheduler: submits and cancels out, batched per loop turn
    (as the scheduler batches its replies); replies, refusals and ends dispatched to the
    calls' queues by tag."""

    def __init__(self, cfg: FrontConfig) -> None:
        self.target = cfg.scheduler
        self.creds = rpc.channel_credentials(cfg.scheduler_tls_ca or None)
        self.metadata = rpc.bearer_metadata(cfg.scheduler_auth_token)
        self.calls: dict[int, asyncio.Queue] = {}
        # By tag, then sequence: what the plain rows stand on, the last whole reply's request
        # id, prompt tokens and cached prompt tokens (`EngineMessage.plain`).
        self.wholes: dict[int, dict[int, Constants]] = {}
        self.unary: generate_pb2_grpc.GenerationStub | None = None  # set while connected
        # What prompts are tokenized with here (None: not described yet; the scheduler then
        # tokenizes them), and the worker facts it came with.
        self.tokenizer: Tokenizer | None = None
        self.info: worker_pb2.WorkerInfo | None = None
        self.on_readiness: Callable[[bool], Awaitable[None]] | None = None
        self._next_tag = 0
        self._out: _Outgoing | None = None  # the current stream's, while connected
        self.name = f"{socket.gethostname()}:{os.getpid()}"  # the scheduler's series of this front

    @property
    def connected(self) -> bool:
        return self.unary is not None

    def open(self, request: generate_pb2.GenerateRequest, tokenized_for: str = "") -> tuple[int, asyncio.Queue]:
        """Queue a call for the scheduler (tokenized and detokenized here for the model
        `tokenized_for`, if set); its replies, then DONE (or a `Refused`), arrive on the
        returned queue."""
        tag = self._next_tag
        self._next_tag += 1
        queue: asyncio.Queue = asyncio.Queue()
        if self._out is None:
            queue.put_nowait(LOST)
            return tag, queue
        self.calls[tag] = queue
        submit = self._out.pending.submit.add(
            tag=tag, tokenized_for=tokenized_for, front_detokenizes=bool(tokenized_for)
        )
        submit.request.CopyFrom(request)
        self._out.wake.set()
        return tag, queue

    def stop_sequence(self, tag: int, index: int, num_output_tokens: int) -> None:
        """Sequence `index` of call `tag` reached a stop string here: the scheduler ends it."""
        if self._out is not None:
            self._out.pending.stopped.add(tag=tag, index=index, num_output_tokens=num_output_tokens)
            self._out.wake.set()

    def observe(self, ttft_s: float | None = None, e2e_s: float | None = None) -> None:
        """Report what a client saw to the scheduler's histograms (with the next message)."""
        out = self._out
        if out is None:
            return  # no scheduler to count it
        if ttft_s is not None:
            out.pending.ttft_s.append(ttft_s)
        if e2e_s is not None:
            out.pending.e2e_s.append(e2e_s)
        out.wake.set()

    def close(self, tag: int, cancel: bool) -> None:
        """The call is over; ``cancel``: it ended early (its client left), so abort it."""
        self.wholes.pop(tag, None)
        if self.calls.pop(tag, None) is not None and cancel and self._out is not None:
            self._out.pending.cancel.append(tag)
            self._out.wake.set()

    def _dispatch(self, message: front_pb2.EngineMessage) -> None:
        calls = self.calls
        for tag in message.accepted:  # before the replies: a call's acceptance comes first
            queue = calls.get(tag)
            if queue is not None:
                queue.put_nowait(ACCEPTED)
        # Plain rows and whole replies, in the scheduler's order: `num_plain_before` rows come
        # before each whole reply. A row becomes the reply it stands for here, from its
        # sequence's last whole reply.
        wholes = self.wholes
        plain = message.plain
        tags, indexes, outputs = plain.tags, plain.indexes, plain.num_output_tokens
        num_tokens, token_ids = plain.num_tokens, plain.token_ids
        row = start = 0

        def rows_until(end: int) -> None:
            nonlocal row, start
            while row < end:
                tag, stop = tags[row], start + num_tokens[row]
                queue = calls.get(tag)
                if queue is not None:
                    index = indexes[row]
                    request_id, num_prompt_tokens, num_cached = wholes[tag][index]
                    reply = generate_pb2.GenerateResponse(
                        request_id=request_id,
                        token_ids=token_ids[start:stop],
                        num_prompt_tokens=num_prompt_tokens,
                        num_output_tokens=outputs[row],
                        num_cached_prompt_tokens=num_cached,
                        index=index,
                    )
                    queue.put_nowait(reply)
                row, start = row + 1, stop

        for tagged in message.replies:
            rows_until(tagged.num_plain_before)
            queue = calls.get(tagged.tag)
            if queue is not None:
                response = tagged.response
                wholes.setdefault(tagged.tag, {})[response.index] = (
                    response.request_id,
                    response.num_prompt_tokens,
                    response.num_cached_prompt_tokens,
                )
                queue.put_nowait(response)
        rows_until(len(tags))
        for refusal in message.refused:
            queue = calls.get(refusal.tag)
            if queue is not None:
                code = STATUS_BY_CODE.get(refusal.code, grpc.StatusCode.UNKNOWN)
                queue.put_nowait(Refused(code, refusal.message))
        for tag in message.done:
            queue = calls.get(tag)
            if queue is not None:
                queue.put_nowait(DONE)

    async def _set_ready(self, ready: bool) -> None:
        if self.on_readiness is not None:
            await self.on_readiness(ready)

    async def _mirror_health(self, channel: grpc.aio.Channel) -> None:
        """Serve while the scheduler does (it does not while no worker is ready), so that a
        probe of the front tells what a probe of the scheduler would."""
        try:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            async for response in watch:
                serving = response.status == health_pb2.HealthCheckResponse.SERVING
                if serving:  # a worker is ready: (again) what it tokenizes with
                    await self._describe(channel)
                await self._set_ready(serving)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                logger.warning("cannot watch the scheduler's health (%s): serving while attached", exc.code().name)
                await self._set_ready(True)

    async def _describe(self, channel: grpc.aio.Channel) -> None:
        """Take the tokenizer of the scheduler's workers, unless it is the one held already."""
        try:
            info = await front_pb2_grpc.FrontGatewayStub(channel).Describe(
                front_pb2.DescribeRequest(), metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("cannot describe the scheduler's model (%s): it tokenizes", exc.code().name)
            return
        held = self.info
        if held is None or (held.model, held.tokenizer_json, held.chat_template) != (
            info.model,
            info.tokenizer_json,
            info.chat_template,
        ):
            # Off the loop: a large vocabulary takes a while to load.
            self.tokenizer = await asyncio.to_thread(Tokenizer.from_worker_info, info)
            logger.info("tokenizing for %s here", info.model)
        self.info = info

    def load(self) -> front_pb2.FrontLoad:
        """This front's load now: its process's CPU time and its open calls."""
        times = os.times()
        return front_pb2.FrontLoad(name=self.name, cpu_seconds=times.user + times.system, num_calls=len(self.calls))

    async def _report_load(self, out: _Outgoing) -> None:
        """Send `load` with the stream's next message, at once and every `LOAD_INTERVAL_S`."""
        while True:
            out.pending.load.CopyFrom(self.load())
            out.wake.set()
            await asyncio.sleep(LOAD_INTERVAL_S)

    def _lose_calls(self) -> None:
        for queue in self.calls.values():
            queue.put_nowait(LOST)
        self.calls.clear()
        self.wholes.clear()
        self._out = None

    async def run(self, stop: asyncio.Event) -> None:
        """Keep one `Attach` stream open until `stop`, reconnecting with backoff."""
        backoff = 0.1
        while not stop.is_set():
            try:
                async with rpc.aio_channel(self.target, self.creds) as channel:
                    # Each stream has its own outbox: a lost stream's request iterator may
                    # still be waiting and must not take the next stream's messages.
                    self._out = _Outgoing()
                    call = front_pb2_grpc.FrontGatewayStub(channel).Attach(self._out.messages(), metadata=self.metadata)
                    await call.wait_for_connection()
                    self.unary = generate_pb2_grpc.GenerationStub(channel)
                    logger.info("attached to the scheduler at %s", self.target)
                    backoff = 0.1
                    watch = asyncio.create_task(self._mirror_health(channel))
                    report = asyncio.create_task(self._report_load(self._out))
                    try:
                        async for message in call:
                            self._dispatch(message)
                    finally:
                        watch.cancel()
                        report.cancel()
                    logger.warning("the scheduler closed the stream")
            except grpc.aio.AioRpcError as exc:
                logger.warning("stream to the scheduler at %s: %s %s", self.target, exc.code().name, exc.details())
            finally:
                was_connected = self.connected
                self.unary = None
                self._lose_calls()
                if was_connected:
                    await self._set_ready(False)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, 2.0)


def tokenized(request: generate_pb2.GenerateRequest, link: EngineLink) -> tuple[generate_pb2.GenerateRequest, str]:
    """The request with its text or messages replaced by their token ids, and the model they
    were made for (its outputs are then detokenized here too); as it is (and "") where the
    scheduler must read it: no tokenizer yet. Token ids stay as they are.

    Raises:
        RequestError: the input is empty, too long or malformed (the scheduler's words).
    """
    tokenizer, info = link.tokenizer, link.info
    if tokenizer is None or info is None:
        return request, ""
    if request.WhichOneof("input") == "token_ids":
        return request, info.model  # this front detokenizes their outputs, for this model
    try:
        ids = request_prompt_ids(request, tokenizer, info)
    except InvalidRequest as exc:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
    relayed = generate_pb2.GenerateRequest()
    relayed.CopyFrom(request)
    relayed.token_ids.ids[:] = ids  # the input is a oneof: this clears the text or messages
    if request.HasField("prediction") and request.prediction.WhichOneof("content") == "text":
        try:
            predicted = prediction_ids(request.prediction.text, tokenizer, info)
        except InvalidRequest as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        relayed.prediction.token_ids.ids[:] = predicted  # clears the text
    return relayed, info.model


def join_replies(replies: list[generate_pb2.GenerateResponse]) -> list[generate_pb2.GenerateResponse]:
    """`replies` joined per sequence (``index``), in order of first appearance: each sequence's
    tokens, text and log-probabilities in one message whose counts and finish reason are its
    last reply's.

    A client that is written to more slowly than the scheduler confirms tokens (a busy front,
    a slow reader) so gets fewer, larger messages instead of falling further behind.
    """
    if len(replies) <= 1:
        return replies
    by_index: dict[int, list[generate_pb2.GenerateResponse]] = {}
    for reply in replies:
        by_index.setdefault(reply.index, []).append(reply)
    joined = []
    for same in by_index.values():
        if len(same) == 1:
            joined.append(same[0])
            continue
        # Repeated fields concatenate and set scalars take the later value; text is a scalar,
        # so it is joined by hand.
        reply = generate_pb2.GenerateResponse()
        for part in same:
            reply.MergeFrom(part)
        reply.text = "".join([part.text for part in same])
        joined.append(reply)
    return joined


# Plain ints: an enum wrapper's attribute costs a Python call per lookup, per reply here.
_EOS = generate_pb2.FINISH_REASON_EOS
_MAX_TOKENS = generate_pb2.FINISH_REASON_MAX_TOKENS
_STOP_SEQUENCE = generate_pb2.FINISH_REASON_STOP_SEQUENCE


@dataclass(slots=True)
class CallText:
    """A call's text, made here (`Submit.front_detokenizes`): the scheduler's replies carry
    token ids only, and the stop strings are found here.

    A sequence's detokenizer is made at its first reply, when the scheduler has checked the
    stop strings (`Detokenizer` refuses an empty one).
    """

    tokenizer: Tokenizer
    prompt_ids: list[int]
    stop: list[str]
    detokenizers: dict[int, Detokenizer] = field(default_factory=dict)

    def fill(self, reply: generate_pb2.GenerateResponse) -> bool:
        """Put the text of `reply`'s tokens in it, as the scheduler's `_reconcile` would have.

        At a stop string the reply is cut after the token that completed it and finishes its
        sequence (STOP_SEQUENCE); returns whether that happened.
        """
        det = self.detokenizers.get(reply.index)
        if det is None:
            det = self.detokenizers[reply.index] = Detokenizer(self.tokenizer, self.prompt_ids, self.stop)
        ids = reply.token_ids
        final = reply.finish_reason
        if not final and not self.stop:  # most replies: every token renders, nothing to cut
            append = det.append
            reply.text = "".join([append(token_id)[0] for token_id in ids])
            return False
        num_ids = len(ids)
        # The token that ended a sequence on EOS or a stop token id renders no text there.
        num_text = num_ids - 1 if num_ids and final in (_EOS, _STOP_SEQUENCE) else num_ids
        parts = []
        for i in range(num_text):
            text, stopped = det.append(ids[i])
            parts.append(text)
            if stopped:
                num_cut = num_ids - (i + 1)
                if num_cut:
                    if len(reply.logprobs) == num_ids:
                        del reply.logprobs[i + 1 :]
                    if len(reply.top_logprobs) == num_ids:
                        del reply.top_logprobs[i + 1 :]
                    del reply.token_ids[i + 1 :]
                    reply.num_output_tokens -= num_cut
                reply.finish_reason = _STOP_SEQUENCE
                reply.text = "".join(parts)
                return True
        if final in (_EOS, _MAX_TOKENS):
            parts.append(det.flush())
        reply.text = "".join(parts)
        return False


@dataclass(slots=True)
class ReadyView:
    """What the HTTP API reads of a ready worker link, from the scheduler's `Describe`."""

    info: worker_pb2.WorkerInfo
    tokenizer: Tokenizer


class RelayFrontend:
    """A front's request path, for its gRPC and HTTP APIs alike (`http_api.Frontend`): requests
    tokenized here and relayed through the front's stream; `router.any_ready()` answers from
    the scheduler's health and `Describe`."""

    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.router = self  # the HTTP API asks `router.any_ready()`
        self.ready = False
        self.draining = False
        self.texts: dict[int, CallText] = {}  # by tag: the calls detokenized here

    def any_ready(self) -> ReadyView | None:
        link = self.link
        if not (self.ready and link.connected and link.info is not None and link.tokenizer is not None):
            return None
        return ReadyView(link.info, link.tokenizer)

    async def precheck(self, request: generate_pb2.GenerateRequest) -> None:
        """Nothing: the scheduler checks a relayed request's grammar (off its event loop)."""

    def submit(self, request: generate_pb2.GenerateRequest) -> Submission:
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not self.link.connected:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no connection to the scheduler")
        info = self.link.info
        if info is not None and request.model and request.model != info.model:
            raise unknown_model(request.model, info.model)  # here: the API answers it with a 404
        arrival = time.monotonic()  # the client's clock starts before tokenization
        sampling, stopping = from_generate_request(request)
        relayed, tokenized_for = tokenized(request, self.link)
        tag, queue = self.link.open(relayed, tokenized_for)
        if tokenized_for and self.link.tokenizer is not None:
            self.texts[tag] = CallText(self.link.tokenizer, list(relayed.token_ids.ids), stopping.stop)
        # One stream per sequence, as in the scheduler, for the first-token and end times of
        # each (an n outside [1, MAX_N] is the scheduler's to refuse: one then).
        n = sampling.n if 1 <= sampling.n <= MAX_N else 1
        streams = tuple(
            Stream(queue=queue, arrival=arrival, num_prompt_tokens=0, deliver=queue.put_nowait, index=i)
            for i in range(n)
        )
        return Submission(str(tag), streams[0], (), streams)

    async def admitted(self, submission: Submission) -> None:
        queue = submission.stream.queue
        first = await queue.get()
        if isinstance(first, Refused):
            self.link.calls.pop(int(submission.req_id), None)
            self.texts.pop(int(submission.req_id), None)
            raise RequestError(first.code, first.message)
        if first is not ACCEPTED:  # an end or a reply cannot come first; keep it for `responses`
            queue.put_nowait(first)

    async def responses(self, submission: Submission) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        """The call's replies; those that queued up while its client was being written to go
        out joined, as the scheduler's own `merge_pending` does for a direct call.

        Each sequence's time to its first token and to its end, as its client sees them, go to
        the scheduler's histograms (`EngineLink.observe`).
        """
        tag, queue = int(submission.req_id), submission.stream.queue
        streams = submission.streams
        text = self.texts.get(tag)
        ended = refused = False
        try:
            while not ended:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                replies: list[generate_pb2.GenerateResponse] = []
                end: object = None
                for item in items:
                    if item is ACCEPTED:
                        continue
                    if item is DONE or isinstance(item, Refused):
                        end = item  # nothing is queued for a call after its end
                        break
                    replies.append(item)
                for reply in join_replies(replies):
                    stream = streams[reply.index] if reply.index < len(streams) else None
                    if stream is not None and stream.finished:
                        continue  # tokens the scheduler made before it learnt of a stop string
                    if text is not None and self._fill(text, reply):
                        self.link.stop_sequence(tag, reply.index, reply.num_output_tokens)
                    if stream is not None and (stream.first_token_at is None or reply.finish_reason):
                        self._observe(stream, reply)
                    yield reply
                if isinstance(end, Refused):
                    ended = refused = True
                    raise RequestError(end.code, end.message)
                # Every sequence finished (a stop string here ends one before the scheduler's
                # DONE), or the scheduler says the call is over.
                ended = end is DONE or all(stream.finished for stream in streams)
        finally:
            self.texts.pop(tag, None)
            if not refused:  # a refused call was never counted; a cancelled one was
                now = time.monotonic()
                for stream in streams:
                    if not stream.finished:
                        stream.finished = True
                        self.link.observe(e2e_s=now - stream.arrival)
            self.link.close(tag, cancel=not ended)

    @staticmethod
    def _fill(text: CallText, reply: generate_pb2.GenerateResponse) -> bool:
        """`text.fill`; a failure ends this call only, with INTERNAL and the cause (the
        scheduler's `_reconcile` ends one request on its own detokenizer's failure the same way)."""
        try:
            return text.fill(reply)
        except Exception as exc:
            logger.exception("detokenizing a reply failed")
            raise RequestError(grpc.StatusCode.INTERNAL, f"detokenizing the reply failed: {exc}") from exc

    def _observe(self, stream: Stream, reply: generate_pb2.GenerateResponse) -> None:
        """Time `stream`'s first token and end, with `reply` about to be handed to its client."""
        now = time.monotonic()
        ttft_s = e2e_s = None
        if reply.token_ids and stream.first_token_at is None:
            stream.first_token_at = now
            ttft_s = now - stream.arrival
        if reply.finish_reason:
            stream.finished = True
            e2e_s = now - stream.arrival
        if ttft_s is not None or e2e_s is not None:
            self.link.observe(ttft_s, e2e_s)

    def withdraw(self, submission: Submission) -> None:
        self.texts.pop(int(submission.req_id), None)
        self.link.close(int(submission.req_id), cancel=True)


class FrontServicer(generate_pb2_grpc.GenerationServicer):
    """The gRPC client API, relayed to the scheduler through `relay` (the same path as the
    HTTP API's)."""

    def __init__(self, relay: RelayFrontend) -> None:
        self.relay = relay
        self.link = relay.link

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        try:
            submission = self.relay.submit(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
            return
        try:
            async with contextlib.aclosing(self.relay.responses(submission)) as replies:
                async for reply in replies:
                    yield reply
        except RequestError as exc:  # refused by the scheduler, or the scheduler lost
            await context.abort(exc.code, exc.message)

    async def _unary(self, method: str, request, context):
        stub = self.link.unary
        if stub is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no connection to the scheduler")
        try:
            return await getattr(stub, method)(request, metadata=self.link.metadata)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context):
        """Answered here with the scheduler's tokenizer once it is held (as a Generate call's
        prompt is tokenized here), so that tokenizing load stays off the planning loop."""
        ready = self.relay.any_ready()
        if ready is None:
            return await self._unary("Tokenize", request, context)
        try:
            return tokenize_response(request, ready.tokenizer, ready.info)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def ModelInfo(self, request: generate_pb2.ModelInfoRequest, context):
        return await self._unary("ModelInfo", request, context)


async def stop_with_parent(parent_pid: int, stop: asyncio.Event, interval_s: float = 0.5) -> None:
    """Set `stop` once `parent_pid` is no longer this process's parent: a scheduler's fronts
    must not outlive it (killed with SIGKILL, it cannot stop them), or they would hold its
    client port, answering UNAVAILABLE beside the next scheduler's fronts."""
    while not stop.is_set():
        if os.getppid() != parent_pid:
            logger.warning("the scheduler (pid %d) is gone: stopping", parent_pid)
            stop.set()
            return
        await asyncio.sleep(interval_s)


def _grpc_server(cfg: FrontConfig) -> grpc.aio.Server:
    """The front's gRPC server: port reuse when several fronts share the port, bearer auth."""
    options = [(name, 1 if name == "grpc.so_reuseport" else v) for name, v in rpc.SERVER_OPTIONS]
    return grpc.aio.server(
        options=options if cfg.reuse_port else rpc.SERVER_OPTIONS,
        interceptors=[rpc.BearerAuthInterceptor(cfg.auth_token, SERVICE_NAME, {"Generate": "unary_stream"})]
        if cfg.auth_token
        else None,
    )


async def _start_http(cfg: FrontConfig, relay: RelayFrontend) -> HTTPFront:
    """The OpenAI-compatible HTTP server beside the gRPC one."""
    from zerobubble.scheduler_svc.http_api import start_http  # FastAPI only when HTTP is on

    http = await start_http(
        relay,  # type: ignore[arg-type]  # its `router` is itself: `any_ready` is all the API asks
        cfg.host,
        cfg.http_port,
        auth_token=cfg.auth_token,
        tls_cert=cfg.tls_cert,
        tls_key=cfg.tls_key,
        reuse_port=cfg.reuse_port,
    )
    logger.info("OpenAI-compatible HTTP on %s:%d", cfg.host, http.port)
    rpc.announce_port("HTTP", http.port)
    return http


async def _drain(link: EngineLink, drain_timeout: float) -> None:
    """Wait until the running calls ended or the drain time is up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_timeout
    while link.calls and loop.time() < deadline:
        await asyncio.sleep(0.05)


async def serve_front(
    cfg: FrontConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None, bound: list | None = None
) -> None:
    """Run a front until `stop` (or SIGTERM/SIGINT); `bound` gets its port. ConfigError when
    the settings cannot work (the CLI's rules, for callers that build a config themselves)."""
    cfg.validate()
    link = EngineLink(cfg)
    relay = RelayFrontend(link)
    servicer = FrontServicer(relay)
    server = _grpc_server(cfg)
    health = rpc.add_health_and_reflection(server, [SERVICE_NAME])

    async def on_readiness(serving: bool) -> None:
        if serving and not relay.ready:
            # The scheduler's pool waits for this line from each of its fronts, so that no
            # front shares the client port while it still refuses calls.
            rpc.announce_port("FRONT_READY", port)
        relay.ready = serving
        await rpc.set_serving(health, [SERVICE_NAME], serving)

    link.on_readiness = on_readiness
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = rpc.bind(server, cfg.host, cfg.port, rpc.server_credentials(cfg.tls_cert or None, cfg.tls_key or None))
    await server.start()
    await rpc.set_serving(health, [SERVICE_NAME], False)  # until the scheduler is attached
    stop = stop or asyncio.Event()
    rpc.install_stop_signals(stop)
    linking = asyncio.create_task(link.run(stop))
    orphaning = asyncio.create_task(stop_with_parent(cfg.parent_pid, stop)) if cfg.parent_pid else None
    logger.info("front listening on %s:%d, relaying to %s", cfg.host, port, cfg.scheduler)
    rpc.announce_port("FRONT", port)
    if bound is not None:
        bound.append(("grpc", port))
    http = await _start_http(cfg, relay) if cfg.http_port >= 0 else None
    if ready is not None:
        ready.set()
    await stop.wait()
    # Health first (load balancers stop routing), then the running calls get the drain time.
    relay.draining = True
    await rpc.set_serving(health, [SERVICE_NAME], False)
    await _drain(link, cfg.drain_timeout)
    if http is not None:
        await http.stop(grace_s=1.0)
    await rpc.graceful_stop(server, health, [SERVICE_NAME], grace_s=1.0)
    await asyncio.sleep(0.05)  # the cancels of calls cut short go out before the stream closes
    linking.cancel()
    if orphaning is not None:
        orphaning.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await linking


def run_front(cfg: FrontConfig) -> None:
    """Entry point of `zerobubble front`."""
    rpc.run_service(serve_front(cfg), cfg.event_loop, cfg.cpu_affinity)
