"""The OpenAI-compatible HTTP front of the scheduler: FastAPI app served by uvicorn.

It runs inside the scheduler process, as one more task on the scheduler's asyncio event loop,
so a request goes through exactly the gRPC path (`Frontend.submit` / `responses`:
one validator, one router, one set of metrics) with no extra hop or thread. FastAPI + uvicorn
is the stack vLLM and SGLang serve their OpenAI APIs with; uvicorn's `Server.serve()` is a
plain coroutine, so it shares the loop instead of owning one.

Errors are OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`) with the
HTTP status the gRPC status stands for: 400 bad parameter (named), 401 token, 404 unknown
model or route, 429 queue full, 503 no ready worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from zerobubble.api import generate_pb2
from zerobubble.scheduler_svc import openai_protocol as oa
from zerobubble.scheduler_svc import tool_calls
from zerobubble.scheduler_svc.submission import Frontend, RequestError, Submission

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


# Parts of a pydantic error location that name a union branch, not a field: str, list[int],
# literal[...], Model.
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|literal\[.*\]|[A-Z]\w*)$")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An OpenAI error object with `status`."""
    return JSONResponse(status_code=status, content=error_object(status, message, param, code))


def error_object(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}
    }


class HTTPError(Exception):
    """Answer with an error object (raised anywhere inside a handler)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _rejected(exc: RequestError, body: oa.Body) -> HTTPError:
    if exc.unknown_model:
        return HTTPError(404, exc.message, "model", "model_not_found")
    status = _HTTP_STATUS.get(exc.code, 500)
    param, message = oa.openai_param(exc.message, body) if status == 400 else (None, exc.message)
    return HTTPError(status, message, param)


@dataclass(slots=True)
class Choice:
    """What one choice (prompt × sequence) has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[str, float]]] = field(default_factory=list)
    num_chars: int = 0  # text length so far, for completions' text_offset
    finish_reason: str | None = None
    started: bool = False
    echo: str = ""  # the prompt, sent before the text (completions' `echo`); a stream's once
    accepted_prediction: int = 0  # running totals of the sequence's last reply
    rejected_prediction: int = 0
    call_parser: tool_calls.ToolCallParser | None = None  # a streamed reply's, when it parses tool calls


@dataclass(slots=True)
class Exchange:
    """One HTTP call in flight: its body, the submitted requests and their running totals."""

    body: oa.Body
    chat: bool
    response_id: str
    model: str
    token_text: Callable[[int], str]
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    parse_tool_calls: bool = False  # read tool calls out of the output (`oa.parses_tool_calls`)
    echoes: list[str] = field(default_factory=list)  # per prompt, with completions' `echo`

    def choice(self, prompt_index: int, reply: generate_pb2.GenerateResponse) -> Choice:
        index = prompt_index * self.body.n + reply.index
        if index not in self.choices:
            parser = tool_calls.ToolCallParser() if self.parse_tool_calls and self.body.stream else None
            echo = self.echoes[prompt_index] if self.echoes else ""
            self.choices[index] = Choice(index, call_parser=parser, echo=echo)
        return self.choices[index]

    def add(self, prompt_index: int, reply: generate_pb2.GenerateResponse) -> tuple[Choice, dict | None]:
        """Account one reply message; returns its choice and the logprobs object of its tokens."""
        choice = self.choice(prompt_index, reply)
        self.prompt_tokens[prompt_index] = reply.num_prompt_tokens or self.prompt_tokens.get(prompt_index, 0)
        self.cached_tokens[prompt_index] = reply.num_cached_prompt_tokens or self.cached_tokens.get(prompt_index, 0)
        choice.text.append(reply.text)
        choice.token_ids.extend(reply.token_ids)
        # A front rebuilds a reply of tokens alone without these totals: keep the largest.
        choice.accepted_prediction = max(choice.accepted_prediction, reply.num_accepted_prediction_tokens)
        choice.rejected_prediction = max(choice.rejected_prediction, reply.num_rejected_prediction_tokens)
        logprobs_obj = None
        if self.wants_logprobs and reply.token_ids:
            texts = [self.token_text(t) for t in reply.token_ids]
            top = [
                [(self.token_text(t), lp) for t, lp in zip(entry.token_ids, entry.logprobs)]
                for entry in reply.top_logprobs
            ]
            choice.logprobs.extend(reply.logprobs)
            choice.top.extend(top)
            if self.chat:
                logprobs_obj = oa.chat_logprobs(texts, list(reply.logprobs), top)
            else:
                logprobs_obj = oa.completion_logprobs(texts, list(reply.logprobs), top, choice.num_chars)
        choice.num_chars += len(reply.text)
        if reply.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            choice.finish_reason = oa.finish_reason(reply.finish_reason)
            if reply.finish_reason == generate_pb2.FINISH_REASON_ERROR:
                raise HTTPError(500, reply.error or "the request failed on the server")
        return choice, logprobs_obj

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.body.logprobs) or (not self.chat and self.body.logprobs is not None)

    def usage(self) -> dict[str, Any]:
        choices = self.choices.values()
        return oa.usage(
            oa.TokenCounts(
                prompt=sum(self.prompt_tokens.values()),
                completion=sum(len(c.token_ids) for c in choices),
                cached=sum(self.cached_tokens.values()),
                accepted_prediction=sum(c.accepted_prediction for c in choices),
                rejected_prediction=sum(c.rejected_prediction for c in choices),
            )
        )

    def envelope(self, choices: list[dict], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def final_choices(self) -> list[dict]:
        out = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.text)
            logprobs = None
            if self.wants_logprobs:
                texts = [self.token_text(t) for t in c.token_ids]
                logprobs = (
                    oa.chat_logprobs(texts, c.logprobs, c.top)
                    if self.chat
                    else oa.completion_logprobs(texts, c.logprobs, c.top, 0)
                )
            if self.chat:
                message, reason = self._message(text, c.finish_reason)
                out.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                out.append(
                    {"index": index, "text": c.echo + text, "logprobs": logprobs, "finish_reason": c.finish_reason}
                )
        return out

    def _message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole chat reply's message and finish reason, its tool calls read out when asked."""
        if not self.parse_tool_calls:
            return {"role": "assistant", "content": text}, reason
        content, calls = tool_calls.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, _with_tool_calls(reason, bool(calls))


def _with_tool_calls(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason of a reply that made calls: "tool_calls" when it ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason


async def _merged(
    servicer: Frontend, submissions: Sequence[Submission]
) -> AsyncGenerator[tuple[int, generate_pb2.GenerateResponse], None]:
    """(prompt index, reply) from every submission as they arrive; leaving early aborts them all."""
    if len(submissions) == 1:
        async with contextlib.aclosing(servicer.responses(submissions[0])) as replies:
            async for reply in replies:
                yield 0, reply
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, submission: Submission) -> None:
        try:
            async with contextlib.aclosing(servicer.responses(submission)) as replies:
                async for reply in replies:
                    queue.put_nowait((i, reply))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(submissions)]
    try:
        remaining = len(tasks)
        while remaining:
            i, reply = await queue.get()
            if reply is None:
                remaining -= 1
                continue
            yield i, reply
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(servicer: Frontend, auth_token: str = "") -> FastAPI:
    """The FastAPI app over a scheduler servicer; `auth_token` guards `/v1/*` like gRPC's."""
    app = FastAPI(title="zerobubble", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    if auth_token:
        _install_auth(app, auth_token)

    @app.get("/health")
    async def health() -> Response:
        _ready_link(servicer)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": package_version()}

    @app.get("/v1/models")
    async def models() -> dict:
        return _models(_ready_link(servicer).info)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(servicer, request, oa.ChatCompletionBody, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(servicer, request, oa.CompletionBody, chat=False)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every refusal, ours or the framework's (404 route, 405 method), as an OpenAI error object."""

    @app.exception_handler(HTTPError)
    async def on_http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def on_starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


def _install_auth(app: FastAPI, auth_token: str) -> None:
    """Require ``Authorization: Bearer <auth_token>`` on `/v1/*` (health and version stay open)."""
    expected = f"Bearer {auth_token}".encode()

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            # Constant-time comparison, as on the gRPC port.
            if not hmac.compare_digest(given, expected):
                return error_response(401, "missing or invalid bearer token", code="invalid_api_key")
        return await call_next(request)


def _ready_link(servicer: Frontend) -> Any:
    link = servicer.router.any_ready()
    if link is None:
        raise HTTPError(503, "no worker is ready")
    return link


def _models(info: Any) -> dict:
    """`/v1/models`: the one served model."""
    return {
        "object": "list",
        "data": [
            {
                "id": info.model,
                "object": "model",
                "created": 0,
                "owned_by": "zerobubble",
                "root": info.model,
                "max_model_len": info.max_model_len,
            }
        ],
    }


async def read_body(request: Request, model: type[oa.Body]) -> oa.Body:
    """The request's JSON body as ``model``; HTTPError 400 naming the field (or the body)."""
    try:
        raw = await request.json()
    except ValueError:
        raise HTTPError(400, "the body is not valid JSON", "body") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise HTTPError(400, "the body is nested too deeply", "body") from None
    if not isinstance(raw, dict):
        raise HTTPError(400, "the body must be a JSON object", "body")
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _UNION_TAG.match(str(p)))
        message = "unknown parameter" if first["type"] == "extra_forbidden" else first["msg"]
        raise HTTPError(400, f"{param}: {message}", param or None) from None


async def generate(servicer: Frontend, request: Request, model: type[oa.Body], chat: bool) -> Response:
    """A chat or text completion: the body's requests submitted through ``servicer``, answered
    whole or as server-sent events."""
    body = await read_body(request, model)
    response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    # How a conversation with tools is sent depends on the model's chat template (without a
    # ready worker the body is still checked: a 400 comes before the 503).
    ready = servicer.router.any_ready() if oa.mentions_tools(body) else None
    template = ready.tokenizer if ready is not None else None
    try:
        requests = oa.build_requests(body, response_id, template)
    except oa.ParamError as exc:
        raise HTTPError(400, str(exc), exc.param) from None
    link = _ready_link(servicer)
    tokenizer = link.tokenizer
    exchange = Exchange(
        body=body,
        chat=chat,
        response_id=response_id,
        model=body.model or link.info.model,
        token_text=lambda t: tokenizer.decode([t], skip_special_tokens=False),
        parse_tool_calls=oa.parses_tool_calls(body),
        echoes=oa.echoed_prompts(body, tokenizer),
    )
    submissions = await _submit_all(servicer, requests, body)
    if body.stream:
        return StreamingResponse(
            _stream(servicer, exchange, submissions),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    async with contextlib.aclosing(_merged(servicer, submissions)) as replies:
        async for prompt_index, reply in replies:
            exchange.add(prompt_index, reply)
    result = exchange.envelope(exchange.final_choices(), chunk=False)
    result["usage"] = exchange.usage()
    return JSONResponse(result)


async def _submit_all(
    servicer: Frontend, requests: list[generate_pb2.GenerateRequest], body: oa.Body
) -> list[Submission]:
    """Submit every request of one call, or none: a refused later prompt withdraws the earlier."""
    submissions: list[Submission] = []
    try:
        for req in requests:
            await servicer.precheck(req)
            submissions.append(servicer.submit(req))
        for submission in submissions:
            await servicer.admitted(submission)
    except RequestError as exc:
        for submission in submissions:
            servicer.withdraw(submission)
        raise _rejected(exc, body) from None
    return submissions


def _stream_chunk(
    exchange: Exchange, choice: Choice, reply: generate_pb2.GenerateResponse, logprobs: dict | None
) -> dict[str, Any] | None:
    """The chunk entry of one reply, or None when it carries nothing to send."""
    if not reply.text and not reply.token_ids and choice.finish_reason is None and not choice.echo:
        return None
    if choice.call_parser is not None:
        delta = _tool_call_delta(choice, reply.text)
        if not delta and logprobs is None and choice.finish_reason is None:
            return None  # text held back: it may be the start of a call
        entry: dict[str, Any] = {"index": choice.index, "delta": delta}
    elif exchange.chat:
        delta = {"content": reply.text} if reply.text or choice.finish_reason is None else {}
        entry = {"index": choice.index, "delta": delta}
    else:
        entry = {"index": choice.index, "text": choice.echo + reply.text}
        choice.echo = ""  # sent
    entry["logprobs"] = logprobs
    entry["finish_reason"] = choice.finish_reason
    return entry


def _tool_call_delta(choice: Choice, text: str) -> dict[str, Any]:
    """The delta of a streamed reply that parses tool calls: the content that cannot be part
    of a call, and each call once complete. The last one also ends the choice's reason."""
    parser = choice.call_parser
    assert parser is not None
    content, calls = parser.feed(text)
    if choice.finish_reason is not None:
        content += parser.finish()
        choice.finish_reason = _with_tool_calls(choice.finish_reason, bool(parser.calls))
    delta: dict[str, Any] = {"content": content} if content else {}
    if calls:
        first = len(parser.calls) - len(calls)
        delta["tool_calls"] = [call.to_openai(first + k) for k, call in enumerate(calls)]
    return delta


def _role_chunk(choice: Choice) -> dict[str, Any]:
    """A chat choice's first chunk: the assistant role, no content yet (as OpenAI sends it)."""
    return {
        "index": choice.index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


async def _stream(servicer: Frontend, exchange: Exchange, submissions: list[Submission]) -> AsyncIterator[str]:
    """The server-sent events of a streamed call, then ``[DONE]``."""
    body = exchange.body
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}
    try:
        async with contextlib.aclosing(_merged(servicer, submissions)) as replies:
            async for prompt_index, reply in replies:
                choice, logprobs = exchange.add(prompt_index, reply)
                if exchange.chat and not choice.started:
                    choice.started = True
                    yield _sse({**exchange.envelope([_role_chunk(choice)], chunk=True), **extra})
                entry = _stream_chunk(exchange, choice, reply, logprobs)
                if entry is not None:
                    yield _sse({**exchange.envelope([entry], chunk=True), **extra})
    except HTTPError as exc:
        # Headers are out already: the error travels as an event, as vLLM does.
        yield _sse(error_object(exc.status, exc.message, exc.param, exc.code))
    else:
        if include_usage:
            yield _sse({**exchange.envelope([], chunk=True), "usage": exchange.usage()})
    yield "data: [DONE]\n\n"


def package_version() -> str:
    """The installed distribution's version (the source tree's when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zerobubble")
    except PackageNotFoundError:
        return "0+unknown"


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the scheduler's stop event shuts it down."""

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # uvicorn >= 0.29
        yield


@dataclass(slots=True)
class HTTPFront:
    """A running HTTP front: its port, and how to stop it."""

    port: int
    server: uvicorn.Server
    task: asyncio.Task

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let running replies finish for up to `grace_s`, then close."""
        self.server.config.timeout_graceful_shutdown = max(int(grace_s), 1)
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def start_http(
    servicer: Frontend,
    host: str,
    port: int,
    *,
    auth_token: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    reuse_port: bool = False,
) -> HTTPFront:
    """Bind `host:port` (0 = a free port) and serve the app on the running event loop;
    `reuse_port`: share the port with other processes that set it too (fronts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    config = uvicorn.Config(
        build_app(servicer, auth_token),
        lifespan="off",
        log_config=None,
        access_log=False,
        ssl_certfile=tls_cert or None,
        ssl_keyfile=tls_key or None,
        timeout_graceful_shutdown=10,
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-front")
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.01)
    return HTTPFront(sock.getsockname()[1], server, task)
