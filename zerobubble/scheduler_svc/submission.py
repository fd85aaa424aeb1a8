"""What a front end (gRPC `Generate`, the HTTP API) holds while a request runs, and what the
servicer gives it: the request's event stream, and `RequestError` for a request refused before
it was queued.

A module of its own so that the HTTP front can depend on these without importing the servicer
module, which starts the HTTP front (no import cycle).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from zerobubble.api import generate_pb2
from zerobubble.request_options import shown

if TYPE_CHECKING:
    from zerobubble.scheduler_svc.router import Router
    from zerobubble.scheduler_svc.scheduler import RequestEvent


# What a relay hands on: the next reply of a request, or None after its last.
ReplyOrEnd = generate_pb2.GenerateResponse | None
# Where a relay hands a reply of tokens alone: (sequence index, its new token ids, its output
# tokens so far); see `EngineMessage.plain`.
DeliverPlain = Callable[[int, list[int], int], None]


class RequestError(Exception):
    """A request refused before it was queued: the gRPC status and a message naming the cause.

    gRPC aborts with it as is; the HTTP front maps the status to an HTTP one.
    """

    def __init__(self, code: grpc.StatusCode, message: str, unknown_model: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.unknown_model = unknown_model


def unknown_model(requested: str, served: str) -> RequestError:
    """The refusal of a request that names a model this server does not serve (HTTP: 404)."""
    return RequestError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"model: unknown model {shown(requested)}; this server serves {served!r}",
        unknown_model=True,
    )


@dataclass(slots=True, frozen=True)
class Submission:
    """A queued request: its id and the stream its events arrive on.

    With n > 1, ``seq_ids`` / ``streams`` hold the n sequences' scheduler ids and streams (they
    share ``stream.queue``; ``stream`` is the first); empty for n = 1. Dropping a submission
    means dropping every one of ``seq_ids``.
    """

    req_id: str
    stream: Stream
    seq_ids: tuple[str, ...] = ()
    streams: tuple[Stream, ...] = ()


@dataclass(slots=True)
class Stream:
    """The client side of one request: where its events go, and timing for metrics."""

    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    # Where its events go: ``queue.put_nowait`` for a reader of `responses`; a front's relay
    # takes them straight from the scheduler's callback instead (`GenerationServicer.relay`).
    deliver: Callable[[RequestEvent], None]
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0
    index: int = 0  # which of the request's n sequences
    finished: bool = False  # its final event was replied
    # Relayed by a front, which measures what its client sees (time to first token, end to
    # end) and reports it (`FrontMessage.ttft_s`, `e2e_s`): the servicer observes neither.
    relayed: bool = False
    # The cached-prompt count of the last whole reply relayed (-1: none yet): a front fills a
    # plain reply's other fields from that reply (`GenerationServicer.relay`).
    relayed_cached: int = -1
    # Events gathered under --stream-interval, not yet queued, and how many tokens they carry.
    held: list[RequestEvent] = field(default_factory=list)
    num_held_tokens: int = 0


class Frontend(Protocol):
    """The servicer as a front end sees it: `GenerationServicer` in the scheduler, and
    `RelayFrontend` in a front process (`scheduler_svc/front.py`), whose `router` stands in for
    the scheduler's with the workers' facts and tokenizer."""

    router: Router

    async def precheck(self, request: generate_pb2.GenerateRequest) -> None:
        """What may be checked of a request off the event loop before `submit` (its grammar);
        `RequestError` if it is refused."""
        ...

    def submit(self, request: generate_pb2.GenerateRequest) -> Submission: ...

    def responses(self, submission: Submission) -> AsyncGenerator[generate_pb2.GenerateResponse, None]: ...

    def withdraw(self, submission: Submission) -> None: ...

    async def admitted(self, submission: Submission) -> None:
        """Return once the request is queued; `RequestError` if it was refused after `submit`
        returned (a front learns of the scheduler's refusal one message later)."""
        ...
