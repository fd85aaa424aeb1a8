"""The OpenAI wire format: request bodies of `/v1/chat/completions` and `/v1/completions`, how they
map onto a `GenerateRequest`, and the pieces of the replies (choices, logprobs, usage).

The HTTP layer checks what the JSON shape decides (types, which fields go together); a body
becomes the request model's options (`zerobubble/request_options.py`), whose one validator owns
every range and runs before any protobuf is built, so a value the wire cannot carry is a named
400. Its messages name proto paths (`sampling.temperature: ...`), which :func:`openai_param`
turns back into the OpenAI name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from zerobubble.api import generate_pb2
from zerobubble.request_options import (
    InvalidRequest,
    SamplingOptions,
    StoppingOptions,
    validate_token_ids,
    write_generate_request,
)

# Strict primitives: "0.5" is not a temperature and true is not an integer.
Float = StrictFloat | StrictInt
MAX_PROMPTS = 64  # prompts in one /v1/completions call (each runs as its own request)

FINISH_REASONS: dict[int, str] = {
    generate_pb2.FINISH_REASON_EOS: "stop",
    generate_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    generate_pb2.FINISH_REASON_MAX_TOKENS: "length",
    generate_pb2.FINISH_REASON_CANCELLED: "abort",  # vLLM's word for a server-side abort
    generate_pb2.FINISH_REASON_ERROR: "error",
}


class ParamError(ValueError):
    """A request field is wrong; `param` is its OpenAI name (the error object's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does: clients send vendor fields we have no use for.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    """`stream_options`: a last chunk with the usage when `include_usage`."""

    include_usage: StrictBool = False


class ContentPart(_Body):
    """One part of a message's content list; only text parts are served."""

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Body):
    """One chat message."""

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None


class _CommonBody(_Body):
    """Fields both endpoints take: OpenAI's, then the extras vLLM accepts."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: dict[str, Float] | None = None
    user: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    top_k: StrictInt | None = None
    min_p: Float = 0.0
    repetition_penalty: Float | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None


class ChatCompletionBody(_CommonBody):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None


class CompletionBody(_CommonBody):
    """`POST /v1/completions`: text, token ids, or a list of either (one choice set per prompt)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: Annotated[StrictInt, Field()] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None


Body = ChatCompletionBody | CompletionBody


def _message_text(index: int, message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise ParamError(
                f"messages[{index}].content[{j}]", f"only text parts are supported, got type {part.type!r}"
            )
        parts.append(part.text)
    return "".join(parts)


def _prompts(body: CompletionBody) -> list[str | list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    if not prompt:
        raise ParamError("prompt", "must not be empty")
    if len(prompt) > MAX_PROMPTS:
        raise ParamError("prompt", f"{len(prompt)} prompts, limit is {MAX_PROMPTS}")
    return list(prompt)  # type: ignore[arg-type]


def body_options(body: Body) -> tuple[SamplingOptions, StoppingOptions]:
    """The options a body asks for, not validated. Omitted fields keep OpenAI's defaults where
    they differ from ours (temperature 1).

    Raises:
        ParamError: a field that no option can stand for (a logit_bias key that is no number).
    """
    sampling = SamplingOptions(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=0 if body.top_k in (None, -1) else body.top_k,  # vLLM spells "off" as -1
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=None if body.seed is None else body.seed % (1 << 64),  # a negative seed is still a seed
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_p=body.min_p,
        logit_bias=_logit_bias(body.logit_bias or {}),
        n=body.n,
    )
    if isinstance(body, ChatCompletionBody):
        sampling.logprobs = body.logprobs
        sampling.top_logprobs = body.top_logprobs or 0
    elif body.logprobs is not None:
        sampling.logprobs = True
        sampling.top_logprobs = body.logprobs
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    stopping = StoppingOptions(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
    )
    return sampling, stopping


def _logit_bias(raw: dict[str, float]) -> dict[int, float]:
    bias = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise ParamError("logit_bias", f"keys must be token ids, got {key[:32]!r}") from None
    return bias


def _check_unsupported(body: Body) -> None:
    """ParamError for a feature we do not serve."""
    if isinstance(body, ChatCompletionBody):
        if body.tools:
            raise ParamError("tools", "tool calls are not supported")
        if body.top_logprobs is not None and not body.logprobs:
            raise ParamError("top_logprobs", "requires logprobs: true")
        if not body.messages:
            raise ParamError("messages", "must not be empty")
    else:
        if body.echo:
            raise ParamError("echo", "echo is not supported")
        if body.suffix:
            raise ParamError("suffix", "suffix is not supported")


def _validated(body: Body, prompts: list[str | list[int]]) -> tuple[SamplingOptions, StoppingOptions]:
    """The body's options, checked against every range the request model knows without the
    model (the servicer checks again with its vocabulary and length). Anything a protobuf could
    not carry is refused here, by name."""
    sampling, stopping = body_options(body)
    try:
        sampling.validate()
        stopping.validate()
        for prompt in prompts:
            if not isinstance(prompt, str):
                validate_token_ids(prompt, "token_ids")
    except InvalidRequest as exc:
        param, message = openai_param(str(exc), body)
        raise ParamError(param or "body", message.partition(": ")[2] or message) from None
    return sampling, stopping


def build_requests(body: Body, request_id: str) -> list[generate_pb2.GenerateRequest]:
    """The `GenerateRequest`s a body stands for: one, or one per prompt of a completions list.

    Raises:
        ParamError: a field out of range, or an unsupported feature.
    """
    _check_unsupported(body)
    prompts = [] if isinstance(body, ChatCompletionBody) else _prompts(body)
    sampling, stopping = _validated(body, prompts)
    template = generate_pb2.GenerateRequest(model=body.model or "")
    write_generate_request(sampling, stopping, template)
    if isinstance(body, ChatCompletionBody):
        template.messages.SetInParent()
        for i, message in enumerate(body.messages):
            template.messages.messages.add(role=message.role, content=_message_text(i, message))
        template.request_id = request_id
        return [template]
    requests = []
    for i, prompt in enumerate(prompts):
        request = generate_pb2.GenerateRequest()
        request.CopyFrom(template)
        request.request_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.token_ids.SetInParent()
            request.token_ids.ids.extend(prompt)
        requests.append(request)
    return requests


# Proto paths of the validator's messages -> OpenAI parameter names.
_PARAM_NAMES = {
    "stopping.max_tokens": "max_tokens",
    "stopping.min_tokens": "min_tokens",
    "stopping.stop": "stop",
    "stopping.stop_token_ids": "stop_token_ids",
    "response.logprobs": "logprobs",
    "response.top_logprobs": "top_logprobs",
}


def openai_param(message: str, body: Body) -> tuple[str | None, str]:
    """(OpenAI parameter name, message naming it) for a validator message `path: text`."""
    path, sep, rest = message.partition(": ")
    if not sep or " " in path:
        return None, message
    base = path.split("[", 1)[0]
    if base in ("input", "prompt", "token_ids", "messages"):
        param = "messages" if isinstance(body, ChatCompletionBody) else "prompt"
        if base == "messages":
            param = path  # messages[3].role
    elif base.startswith("sampling."):
        # The parameter is the field (`logit_bias`); the message keeps the entry (`logit_bias[10]`).
        param = base.removeprefix("sampling.")
        return param, f"{path.removeprefix('sampling.')}: {rest}"
    else:
        param = _PARAM_NAMES.get(base, base)
        if "[" in path and base in _PARAM_NAMES:
            param += path[len(base) :]
    if (
        param.startswith("max_tokens")
        and isinstance(body, ChatCompletionBody)
        and body.max_completion_tokens is not None
    ):
        param = "max_completion_tokens"
    elif param == "top_logprobs" and isinstance(body, CompletionBody):
        param = "logprobs"  # completions ask for the top N with `logprobs: N`
    return param, f"{param}: {rest}"


def finish_reason(value: int) -> str | None:
    """OpenAI's finish reason for ours (None while unfinished)."""
    return FINISH_REASONS.get(value)


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    """The `usage` object."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def _token_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    token_texts: Sequence[str], logprobs: Sequence[float], top: Sequence[Sequence[tuple[str, float]]]
) -> dict[str, Any]:
    """Chat `logprobs`: one entry per token, each with its `top_logprobs` (may be empty)."""
    content = []
    for i, (text, logprob) in enumerate(zip(token_texts, logprobs)):
        entry = _token_entry(text, logprob)
        entry["top_logprobs"] = [_token_entry(t, lp) for t, lp in top[i]] if i < len(top) else []
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    token_texts: Sequence[str], logprobs: Sequence[float], top: Sequence[Sequence[tuple[str, float]]], text_offset: int
) -> dict[str, Any]:
    """Legacy completions `logprobs`: parallel lists, offsets into the choice's text."""
    offsets = []
    for text in token_texts:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": list(token_texts),
        "token_logprobs": list(logprobs),
        "top_logprobs": [dict(top[i]) if i < len(top) else {} for i in range(len(token_texts))],
        "text_offset": offsets,
    }


ObjectKind = Literal["chat.completion", "text_completion"]
