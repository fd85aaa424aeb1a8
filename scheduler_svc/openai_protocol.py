"""The OpenAI wire format: request bodies of `/v1/chat/completions` and `/v1/completions`, how they
map onto a `GenerateRequest`, and the pieces of the replies (choices, logprobs, usage).

The HTTP layer checks only what the JSON shape decides (types, which fields go together, what
the proto cannot carry, e.g. `n: 0`, which is the proto's "unset"). Every range check lives in
the scheduler's one validator (`GenerationServicer._validate`); its messages name proto paths
(`sampling.temperature: ...`), which :func:`openai_param` turns back into the OpenAI name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from zerobubble.api import generate_pb2

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


def build_requests(body: Body, request_id: str) -> list[generate_pb2.GenerateRequest]:
    """The `GenerateRequest`s a body stands for: one, or one per prompt of a completions list.

    Omitted fields keep OpenAI's defaults where they differ from ours (temperature 1).

    Raises:
        ParamError: a field the proto cannot carry as given, or an unsupported feature.
    """
    if body.n < 1:
        raise ParamError("n", f"must be >= 1, got {body.n}")
    template = generate_pb2.GenerateRequest(model=body.model or "")
    s, st, resp = template.sampling, template.stopping, template.response
    s.temperature = 1.0 if body.temperature is None else body.temperature
    if body.top_p is not None:
        s.top_p = body.top_p
    if body.top_k is not None:
        s.top_k = 0 if body.top_k == -1 else body.top_k  # vLLM spells "off" as -1
    if body.seed is not None:
        s.seed = body.seed % (1 << 64)  # the proto's uint64; a negative seed is still a seed
    s.presence_penalty = body.presence_penalty
    s.frequency_penalty = body.frequency_penalty
    if body.repetition_penalty is not None:
        s.repetition_penalty = body.repetition_penalty
    s.min_p = body.min_p
    s.n = body.n
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise ParamError("logit_bias", f"keys must be token ids, got {key!r}") from None
        s.logit_bias[token_id] = bias
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is not None:
        st.max_tokens = max_tokens
    st.min_tokens = body.min_tokens
    st.ignore_eos = body.ignore_eos
    st.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop or [])
    st.stop_token_ids.extend(body.stop_token_ids or [])
    if isinstance(body, ChatCompletionBody):
        if body.tools:
            raise ParamError("tools", "tool calls are not supported")
        if body.top_logprobs is not None and not body.logprobs:
            raise ParamError("top_logprobs", "requires logprobs: true")
        resp.logprobs = body.logprobs
        resp.top_logprobs = body.top_logprobs or 0
        template.messages.SetInParent()
        if not body.messages:
            raise ParamError("messages", "must not be empty")
        for i, message in enumerate(body.messages):
            template.messages.messages.add(role=message.role, content=_message_text(i, message))
        template.request_id = request_id
        return [template]
    if body.echo:
        raise ParamError("echo", "echo is not supported")
    if body.suffix:
        raise ParamError("suffix", "suffix is not supported")
    if body.logprobs is not None:
        resp.logprobs = True
        resp.top_logprobs = body.logprobs
    requests = []
    prompts = _prompts(body)
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
