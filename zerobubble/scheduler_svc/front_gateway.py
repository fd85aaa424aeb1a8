"""The scheduler's side of front processes (`zerobubble front`, `scheduler_svc/front.py`).

A front owns client `Generate` calls and relays them to the scheduler over one `Attach`
stream. Here each relayed call becomes a submission of the servicer, exactly as a direct call
(`GenerationServicer.submit`, so validation, routing, `--stream-interval`, metrics and aborts
are the same code); only its replies differ: `GenerationServicer.relay` hands them over as the
scheduler produces them (no queue, no task per request), they gather in the stream's outbox and
leave as one `EngineMessage` per loop turn. What that takes off the planning loop is the per-message cost
of gRPC (a `sendmsg` and the call's bookkeeping per reply; docs/benchmarks/host.md measures it),
which at hundreds of streams is most of what the loop spends per step. To a front that reads
them, replies of tokens alone go as rows of the message's columns (`EngineMessage.plain`), not
as a message each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc

from zerobubble.api import front_pb2, front_pb2_grpc, generate_pb2, worker_pb2
from zerobubble.scheduler_svc.submission import DeliverPlain, ReplyOrEnd, RequestError, Submission

if TYPE_CHECKING:
    from zerobubble.scheduler_svc.router import Router

logger = logging.getLogger(__name__)


class RelayingServicer(Protocol):
    """What the gateway needs of the scheduler's servicer (`GenerationServicer`)."""

    router: Router

    async def precheck(self, request: generate_pb2.GenerateRequest) -> None: ...

    def submit(self, request: generate_pb2.GenerateRequest, detokenize: bool = True) -> Submission: ...

    def stop_sequence(self, submission: Submission, index: int, num_output_tokens: int) -> bool: ...

    def relay(
        self,
        submission: Submission,
        deliver: Callable[[ReplyOrEnd], None],
        deliver_plain: DeliverPlain | None = None,
    ) -> None: ...

    def close(self, submission: Submission) -> None: ...

    def observe_relayed(self, ttft_s: Sequence[float], e2e_s: Sequence[float]) -> None: ...

    def observe_front_load(self, front: str, cpu_seconds: float, num_calls: int) -> None: ...

    def forget_front(self, front: str) -> None: ...


SERVICE_NAME = front_pb2.DESCRIPTOR.services_by_name["FrontGateway"].full_name


class Outbox:
    """What one front has not been sent yet; `take` waits for something and takes it all.

    Plain replies (`EngineMessage.plain`) gather in lists, put in the message's columns once
    per take: a list append per reply instead of a message.
    """

    __slots__ = ("_message", "_ready", "_tags", "_indexes", "_num_tokens", "_token_ids", "_num_output_tokens")

    def __init__(self) -> None:
        self._message = front_pb2.EngineMessage()
        self._ready = asyncio.Event()
        self._tags: list[int] = []
        self._indexes: list[int] = []
        self._num_tokens: list[int] = []
        self._token_ids: list[int] = []
        self._num_output_tokens: list[int] = []

    def reply(self, tag: int, response) -> None:
        self._message.replies.add(tag=tag, num_plain_before=len(self._tags)).response.CopyFrom(response)
        self._ready.set()

    def plain(self, tag: int, index: int, token_ids: list[int], num_output_tokens: int) -> None:
        self._tags.append(tag)
        self._indexes.append(index)
        self._num_tokens.append(len(token_ids))
        self._token_ids.extend(token_ids)
        self._num_output_tokens.append(num_output_tokens)
        self._ready.set()

    def refuse(self, tag: int, error: RequestError) -> None:
        self._message.refused.add(tag=tag, code=error.code.value[0], message=error.message)
        self._ready.set()

    def accept(self, tag: int) -> None:
        self._message.accepted.append(tag)
        self._ready.set()

    def done(self, tag: int) -> None:
        self._message.done.append(tag)
        self._ready.set()

    async def take(self) -> front_pb2.EngineMessage:
        await self._ready.wait()
        message, self._message = self._message, front_pb2.EngineMessage()
        self._ready.clear()
        if self._tags:
            plain = message.plain
            plain.tags.extend(self._tags)
            plain.indexes.extend(self._indexes)
            plain.num_tokens.extend(self._num_tokens)
            plain.token_ids.extend(self._token_ids)
            plain.num_output_tokens.extend(self._num_output_tokens)
            self._tags, self._indexes, self._num_tokens, self._token_ids, self._num_output_tokens = [], [], [], [], []
        return message


class FrontGateway(front_pb2_grpc.FrontGatewayServicer):
    """`Attach`: one stream per front process, its calls relayed through `servicer`."""

    def __init__(self, servicer: RelayingServicer) -> None:
        self.servicer = servicer

    async def Describe(self, request: front_pb2.DescribeRequest, context) -> worker_pb2.WorkerInfo:
        link = self.servicer.router.any_ready()
        if link is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
            raise AssertionError("unreachable: abort raises")
        info, _ = link.described()
        return info

    def _check_tokenized_for(self, model: str) -> None:
        """A front tokenized the prompt for `model` (empty: it did not): refuse its ids if the
        scheduler now serves another model (the front describes it again once it is ready)."""
        if not model:
            return
        link = self.servicer.router.any_ready()
        if link is not None and link.info is not None and link.info.model != model:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"the front tokenized for {model!r} but the scheduler now serves {link.info.model!r}; retry",
            )

    async def Attach(self, request_iterator, context) -> AsyncIterator[front_pb2.EngineMessage]:
        session = _FrontSession(self.servicer, self._check_tokenized_for)
        peer = context.peer()
        logger.info("front attached: %s", peer)
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while True:
                take = asyncio.ensure_future(session.outbox.take())
                await asyncio.wait((take, reader), return_when=asyncio.FIRST_COMPLETED)
                if not take.done():  # the front closed its side: nothing more will come
                    take.cancel()
                    break
                yield take.result()
            reader.result()  # raises what ended the read, if anything
        finally:
            # The front is gone (or closed): its requests have nobody to stream to.
            reader.cancel()
            num_aborted = session.close()
            logger.info("front detached: %s (%d requests aborted)", peer, num_aborted)


class _FrontSession:
    """One attached front: its calls in flight by tag and the outbox of their replies."""

    def __init__(self, servicer: RelayingServicer, check_tokenized_for: Callable[[str], None]) -> None:
        self.servicer = servicer
        self.check_tokenized_for = check_tokenized_for
        self.outbox = Outbox()
        self.running: dict[int, Submission] = {}
        self.names: set[str] = set()  # what the front reports its load as (one name, in practice)
        self.reads_plain = False  # the front said it reads `EngineMessage.plain`

    def deliver_to(self, tag: int) -> Callable[[ReplyOrEnd], None]:
        running, outbox = self.running, self.outbox

        def deliver(reply: ReplyOrEnd) -> None:
            if reply is None:
                running.pop(tag, None)
                outbox.done(tag)
            else:
                outbox.reply(tag, reply)

        return deliver

    def deliver_plain_to(self, tag: int) -> DeliverPlain:
        outbox = self.outbox

        def deliver_plain(index: int, token_ids: list[int], num_output_tokens: int) -> None:
            outbox.plain(tag, index, token_ids, num_output_tokens)

        return deliver_plain

    async def read(self, request_iterator: AsyncIterator[front_pb2.FrontMessage]) -> None:
        async for message in request_iterator:
            self.reads_plain = self.reads_plain or message.reads_plain
            for submit in message.submit:
                await self._submit(submit)
            for tag in message.cancel:
                cancelled = self.running.pop(tag, None)
                if cancelled is not None:
                    self.servicer.close(cancelled)  # aborts it, frees its blocks
            for stopped in message.stopped:
                stopping = self.running.get(stopped.tag)
                if stopping is not None and self.servicer.stop_sequence(
                    stopping, stopped.index, stopped.num_output_tokens
                ):
                    del self.running[stopped.tag]  # its front has ended the call
                    self.servicer.close(stopping)
            if message.ttft_s or message.e2e_s:
                self.servicer.observe_relayed(message.ttft_s, message.e2e_s)
            if message.HasField("load"):
                load = message.load
                self.names.add(load.name)
                self.servicer.observe_front_load(load.name, load.cpu_seconds, load.num_calls)

    async def _submit(self, submit: front_pb2.Submit) -> None:
        try:
            self.check_tokenized_for(submit.tokenized_for)
            await self.servicer.precheck(submit.request)
            submission = self.servicer.submit(submit.request, detokenize=not submit.front_detokenizes)
        except RequestError as exc:
            self.outbox.refuse(submit.tag, exc)
            return
        self.running[submit.tag] = submission
        self.outbox.accept(submit.tag)
        self.servicer.relay(
            submission, self.deliver_to(submit.tag), self.deliver_plain_to(submit.tag) if self.reads_plain else None
        )

    def close(self) -> int:
        """Abort the calls still running and forget the front's load; how many were aborted."""
        aborted = list(self.running.values())
        self.running.clear()
        for submission in aborted:
            self.servicer.close(submission)
        for name in self.names:
            self.servicer.forget_front(name)
        return len(aborted)
