"""Async client of the scheduler's ``zerobubble.v1.Generation`` API, and ``zerobubble generate``.

Used by the ``generate`` and ``bench`` commands and by the integration tests. It imports only
grpc and the generated stubs, so the client side never pulls in torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import grpc.aio

from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.config import keepalive_options
from zerobubble.request_options import Constraint, write_named_controls, write_proto

logger = logging.getLogger(__name__)

# Prompts given as token ids and long replies with logprobs can exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Pings every 30 s notice a dead peer (e.g. a killed pod behind a NAT) while a long request is
# queued; gRPC's client limit of two pings without data keeps us under the server's ping policy.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *keepalive_options(30_000, 10_000),
)

FINISH_REASON_NAMES: dict[int, str] = {
    generate_pb2.FINISH_REASON_UNSPECIFIED: "",
    generate_pb2.FINISH_REASON_EOS: "eos",
    generate_pb2.FINISH_REASON_MAX_TOKENS: "max_tokens",
    generate_pb2.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    generate_pb2.FINISH_REASON_CANCELLED: "cancelled",
    generate_pb2.FINISH_REASON_ERROR: "error",
}

StubOrChannel: TypeAlias = "generate_pb2_grpc.GenerationStub | grpc.aio.Channel"


@dataclass(slots=True)
class ChannelSettings:
    """How to reach a scheduler: address, TLS material (file paths) and bearer token.

    Empty strings mean "not set", matching the CLI flags and their environment fallbacks.
    """

    target: str
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    auth_token: str = ""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChannelSettings:
        """Pick the connection flags out of a parsed ``generate``/``bench`` command line."""
        return cls(
            target=args.target,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            auth_token=args.auth_token,
        )


@dataclass(slots=True)
class Completion:
    """One whole reply, with the client-side timings the benchmark reports (more than 15 fields:
    it is the reply's record as a caller reads it, OpenAI's choice and usage fields flattened).

    ``ttft_s`` is from sending the request to the first message carrying tokens; ``itl`` holds the
    gaps between successive token-carrying messages (with speculative decoding one message may
    carry several tokens, as in vLLM's benchmark); ``e2e_s`` runs to the last message.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    logprobs: list[float] = field(default_factory=list)
    ttft_s: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    request_id: str = ""
    error: str = ""
    # Per emitted token, the most likely tokens as (token id, logprob), when top_logprobs > 0.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With n > 1: one Completion per sequence, by index (this object's own fields are index 0).
    choices: list[Completion] = field(default_factory=list)
    # Output tokens as the server counted them; HTTP replies carry text only, so there it is the
    # usage figure and `token_ids` stays empty.
    num_output_tokens: int = 0
    # The request's predicted output: its tokens the server verified and accepted, and rejected.
    # None: the server did not say (an HTTP server without `completion_tokens_details`).
    num_accepted_prediction_tokens: int | None = None
    num_rejected_prediction_tokens: int | None = None

    @property
    def output_len(self) -> int:
        """Output tokens, from ids when the server sent them, else from its usage count."""
        return len(self.token_ids) or self.num_output_tokens


def _with_bearer_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    """``details`` plus ``authorization: Bearer <token>`` metadata."""
    metadata = grpc.aio.Metadata(*(details.metadata or ()), ("authorization", f"Bearer {token}"))
    return details._replace(metadata=metadata)


# Interceptors rather than call credentials because gRPC refuses call credentials on plaintext
# channels, and a token is still wanted behind a TLS-terminating proxy or on loopback. Two
# classes because grpc.aio files an interceptor under the first call kind it implements only.
class _BearerTokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """Sends the bearer token on unary calls (``Tokenize``, ``ModelInfo``)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_bearer_token(client_call_details, self._token), request)


class _BearerTokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    """Sends the bearer token on server-streaming calls (``Generate``)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_bearer_token(client_call_details, self._token), request)


def open_channel(settings: ChannelSettings, own_connection: bool = False) -> grpc.aio.Channel:
    """Open an aio channel to the scheduler: TLS when a CA or client cert is given, else plaintext.

    ``own_connection``: a connection of its own; by default gRPC shares one between a
    process's channels to the same target. Must be called with an event loop running (grpc.aio
    binds the channel to it).
    """
    interceptors: list[grpc.aio.ClientInterceptor] | None = None
    if settings.auth_token:
        interceptors = [_BearerTokenUnaryUnary(settings.auth_token), _BearerTokenUnaryStream(settings.auth_token)]
    options = (*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)) if own_connection else CHANNEL_OPTIONS
    if not (settings.tls_ca or settings.tls_cert):
        return grpc.aio.insecure_channel(settings.target, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_optional(settings.tls_ca),
        private_key=_read_optional(settings.tls_key),
        certificate_chain=_read_optional(settings.tls_cert),
    )
    return grpc.aio.secure_channel(settings.target, credentials, options=options, interceptors=interceptors)


@contextlib.asynccontextmanager
async def open_channels(settings: ChannelSettings, num_channels: int) -> AsyncIterator[list[grpc.aio.Channel]]:
    """`num_channels` channels to the scheduler, closed on exit: one, or that many with
    connections of their own, as that many client processes would hold (a scheduler's fronts
    share its port by connection; one connection reaches one front)."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(open_channel(settings, own_connection=num_channels > 1))
            for _ in range(num_channels)
        ]


def _read_optional(path: str) -> bytes | None:
    """PEM file contents, or None (= gRPC's default roots / no client cert) when unset."""
    return Path(path).read_bytes() if path else None


async def wait_connected(channel: grpc.aio.Channel, timeout_s: float) -> None:
    """Wait until the channel has finished its first connection attempt, at most ``timeout_s``.

    A refused connection ends the attempt at once, and the RPC issued next then fails fast with
    gRPC's own UNAVAILABLE details; only a target that never answers (a black-holed address)
    runs into the timeout. Without this, such a target would hang a fail-fast RPC for the whole
    ~20 s TCP connect timeout.

    Raises:
        grpc.aio.AioRpcError: DEADLINE_EXCEEDED when still connecting after ``timeout_s``.
    """
    state = channel.get_state(try_to_connect=True)
    deadline = time.monotonic() + timeout_s
    while state in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details=f"no connection within {timeout_s:g}s",
            )
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), remaining)
        except asyncio.TimeoutError:
            continue
        state = channel.get_state(try_to_connect=True)


def as_stub(stub_or_channel: StubOrChannel) -> generate_pb2_grpc.GenerationStub:
    """Accept either a stub or a channel wherever a call is made."""
    if isinstance(stub_or_channel, grpc.aio.Channel):
        return generate_pb2_grpc.GenerationStub(stub_or_channel)
    return stub_or_channel


def build_request(
    prompt: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    *,
    constraint: Constraint | None = None,
    prediction: str | None = None,
    **controls: Any,
) -> generate_pb2.GenerateRequest:
    """A ``GenerateRequest`` from plain Python values.

    ``messages`` are ``{"role": ..., "content": ...}`` mappings (the OpenAI shape);
    ``constraint`` holds the output to a schema, regex, choice or grammar; ``prediction`` is
    text the reply is expected to repeat (OpenAI's Predicted Outputs), which the server may
    draft from without changing the reply. ``controls`` are the sampling and stopping controls
    by their names in `zerobubble.request_options` (``max_tokens=16, temperature=0.8,
    logprobs=True, stop=["\\n"]``, ...); one left out, or None, is left to the server's default.

    Raises:
        ValueError: not exactly one of ``prompt``, ``messages``, ``token_ids`` is given.
        TypeError: a keyword that is no control.
    """
    given = [
        name
        for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages, token_ids (got {given or 'none'})")
    request = generate_pb2.GenerateRequest()
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.messages.SetInParent()  # an empty conversation is still "messages", for the server to reject
        for message in messages:
            request.messages.messages.add(role=message["role"], content=message["content"])
    else:
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(token_ids or ())
    write_named_controls(controls, request)
    if constraint is not None:
        write_proto(constraint, request.constraint)
    if prediction is not None:
        request.prediction.text = prediction
    return request


async def generate_stream(
    stub_or_channel: StubOrChannel,
    request: generate_pb2.GenerateRequest,
    *,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """Yield the server's messages for ``request`` as they arrive.

    Leaving the loop early (break, exception, task cancellation) cancels the RPC, so the server
    frees the request's KV blocks instead of generating for nobody.

    Raises:
        grpc.aio.AioRpcError: the call failed (status code and details from the server).
    """
    call = as_stub(stub_or_channel).Generate(request, timeout=timeout, metadata=metadata)
    try:
        async for response in call:
            yield response
    finally:
        call.cancel()


async def complete(
    stub_or_channel: StubOrChannel,
    request: generate_pb2.GenerateRequest,
    *,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    on_response: Callable[[generate_pb2.GenerateResponse], None] | None = None,
) -> Completion:
    """Collect a whole reply, timing it; ``on_response`` sees each message as it arrives.

    A reply that ends with FINISH_REASON_ERROR is returned (``error`` set), not raised: the
    server did answer, and the benchmark records such requests.

    Raises:
        grpc.aio.AioRpcError: the call itself failed.
    """
    started = time.perf_counter()
    # One Completion per sequence index (n > 1 interleaves them on one stream).
    by_index: dict[int, Completion] = {}
    last_token_at: dict[int, float] = {}
    text_parts: dict[int, list[str]] = {}
    async for response in generate_stream(stub_or_channel, request, timeout=timeout, metadata=metadata):
        now = time.perf_counter()
        if on_response is not None:
            on_response(response)
        completion = by_index.setdefault(response.index, Completion())
        if response.token_ids:
            if response.index not in last_token_at:
                completion.ttft_s = now - started
            else:
                completion.itl.append(now - last_token_at[response.index])
            last_token_at[response.index] = now
        text_parts.setdefault(response.index, []).append(response.text)
        completion.token_ids.extend(response.token_ids)
        completion.logprobs.extend(response.logprobs)
        completion.top_logprobs.extend(list(zip(top.token_ids, top.logprobs)) for top in response.top_logprobs)
        completion.request_id = response.request_id or completion.request_id
        completion.num_prompt_tokens = response.num_prompt_tokens or completion.num_prompt_tokens
        completion.num_cached_prompt_tokens = response.num_cached_prompt_tokens or completion.num_cached_prompt_tokens
        completion.num_output_tokens = response.num_output_tokens or completion.num_output_tokens
        if response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            completion.finish_reason = finish_reason_name(response.finish_reason)
            completion.error = response.error
            # The final message's counts cover the whole reply.
            completion.num_accepted_prediction_tokens = response.num_accepted_prediction_tokens
            completion.num_rejected_prediction_tokens = response.num_rejected_prediction_tokens
            completion.e2e_s = now - started
    for index, completion in by_index.items():
        completion.text = "".join(text_parts.get(index, []))
        completion.e2e_s = completion.e2e_s or time.perf_counter() - started
    first = by_index.get(0, Completion())
    if len(by_index) > 1:
        first.choices = [by_index[i] for i in sorted(by_index)]
    first.e2e_s = time.perf_counter() - started
    return first


def finish_reason_name(value: int) -> str:
    """``FINISH_REASON_MAX_TOKENS`` -> ``"max_tokens"``; unknown future values keep their number."""
    return FINISH_REASON_NAMES.get(value, str(value))


def format_rpc_error(error: grpc.aio.AioRpcError) -> str:
    """``<CODE>: <details>``, the one-line form the CLI prints."""
    return f"{error.code().name}: {error.details()}"


def request_from_args(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    """The request ``zerobubble generate`` sends.

    Raises:
        ValueError: the input flags are missing, conflicting or not valid JSON.
    """
    if bool(args.prompt) == bool(args.messages_json):
        raise ValueError("give exactly one of --prompt and --messages-json")
    messages = None
    if args.messages_json:
        try:
            messages = json.loads(args.messages_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--messages-json is not valid JSON: {exc}") from exc
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError('--messages-json must be a list of {"role": ..., "content": ...} objects')
    elif args.chat:
        messages = [{"role": "user", "content": args.prompt}]
    return build_request(
        prompt=None if messages is not None else args.prompt,
        messages=messages,
        max_tokens=args.max_tokens or None,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        seed=args.seed if args.seed >= 0 else None,
        stop=args.stop,
        constraint=constraint_from_args(args),
    )


CONSTRAINT_FLAGS = ("--json-schema", "--regex", "--choice", "--grammar")


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The constraint of ``zerobubble generate``'s flags (at most one of them), named by its flag
    in the server's error messages.

    Raises:
        ValueError: several constraint flags, an unreadable file or a schema that is not JSON.
    """
    given = [flag for flag in CONSTRAINT_FLAGS if getattr(args, flag[2:].replace("-", "_"))]
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(CONSTRAINT_FLAGS)} (got {' and '.join(given)})")
    if not given:
        return None
    if args.json_schema:
        return Constraint("json_schema", _schema_text(args.json_schema), "--json-schema")
    if args.regex:
        return Constraint("regex", args.regex, "--regex")
    if args.choice:
        choices = [c for value in args.choice for c in value.split(",")]
        return Constraint("choice", json.dumps(choices), "--choice")
    try:
        return Constraint("grammar", Path(args.grammar).read_text(encoding="utf-8"), "--grammar")
    except OSError as exc:
        raise ValueError(f"--grammar: cannot read {args.grammar}: {exc.strerror}") from exc


def _schema_text(value: str) -> str:
    """``--json-schema``: the JSON text itself, or a file holding it."""
    text = value
    if not value.lstrip().startswith(("{", "true", "false")):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--json-schema: neither JSON nor a readable file ({exc.strerror})") from exc
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--json-schema: not valid JSON ({exc.msg} at character {exc.pos})") from exc
    return text


async def generate_async(args: argparse.Namespace, request: generate_pb2.GenerateRequest) -> int:
    """Send one request and print the reply; returns the exit status."""
    echo = _TextEcho()
    async with open_channel(ChannelSettings.from_args(args)) as channel:
        try:
            await wait_connected(channel, args.connect_timeout)
            completion = await complete(
                channel, request, timeout=args.timeout or None, on_response=None if args.json else echo
            )
        except grpc.aio.AioRpcError as exc:
            if echo.printed:
                sys.stdout.write("\n")
                sys.stdout.flush()
            print(f"error: {format_rpc_error(exc)}", file=sys.stderr)
            return 1
    if args.json:
        print(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                    "num_prompt_tokens": completion.num_prompt_tokens,
                    "ttft_s": completion.ttft_s,
                    "e2e_s": completion.e2e_s,
                    **({"error": completion.error} if completion.error else {}),
                },
                ensure_ascii=False,
            )
        )
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if completion.finish_reason == "error":
        print(f"error: {completion.error or 'the server ended the request with an error'}", file=sys.stderr)
        return 1
    return 0


class _TextEcho:
    """Streams reply text to stdout as it arrives, remembering whether it wrote anything."""

    def __init__(self) -> None:
        self.printed = False

    def __call__(self, response: generate_pb2.GenerateResponse) -> None:
        if response.text:
            sys.stdout.write(response.text)
            # Flush each piece, or a pipe would show the whole reply only at the end.
            sys.stdout.flush()
            self.printed = True


def run_generate(args: argparse.Namespace) -> int:
    """Entry point of ``zerobubble generate``; returns the exit status."""
    try:
        request = request_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(generate_async(args, request))
    except (OSError, ValueError) as exc:
        # Unreadable TLS files, or a target grpc cannot parse.
        print(f"error: {exc}", file=sys.stderr)
        return 1
