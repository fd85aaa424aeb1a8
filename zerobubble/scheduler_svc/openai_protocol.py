"""The OpenAI wire format: request bodies of `/v1/chat/completions` and `/v1/completions`, how they
map onto a `GenerateRequest`, and the pieces of the replies (choices, logprobs, usage).

Every parameter of OpenAI's two request schemas is declared here and is served, refused by
name (`_REFUSED`), or accepted and ignored, as docs/openai-api.md lists; a top-level parameter
not declared is refused. The sampling and stopping controls that are body parameters of their
own name are not written here: their fields come from the request model's declarations
(`body_controls`), and so do their rows in the doc. The HTTP layer checks what the JSON shape
decides (types, which fields go together); a body becomes the request model's options (`zerobubble/request_options.py`),
whose one validator owns every range and runs before any protobuf is built, so a value the wire
cannot carry is a named 400. Its messages name proto paths (`sampling.temperature: ...`), which :func:`openai_param`
turns back into the OpenAI name.

The fields that constrain the output (`response_format`, vLLM's `structured_outputs` and
`guided_*`, `tools` with a forcing `tool_choice`) become one `zerobubble.structured.Constraint`
whose `field_name` is the parameter as the client wrote it, so that the servicer's verdict on
its grammar names that parameter. A conversation with tools is written for the model's chat
template: rendered here with the tools when the template reads them (the wire's messages carry
none), else with the tools described in a system message (`tool_calls.py`).
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, create_model

from zerobubble.api import generate_pb2
from zerobubble.request_options import (
    CHAT_ROLES,
    Constraint,
    InvalidRequest,
    SamplingOptions,
    StoppingOptions,
    shown,
    validate_token_ids,
    wires,
    write_generate_request,
)
from zerobubble.scheduler_svc import tool_calls
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.structured import tool_call_grammar

# Strict primitives: "0.5" is not a temperature and true is not an integer.
Float = StrictFloat | StrictInt
MAX_PROMPTS = 64  # prompts in one /v1/completions call (each runs as its own request)
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (and the dot some use)

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
    # Unknown fields inside a body's objects are ignored: clients send a reply's message back
    # as history with the fields OpenAI added to it (`refusal`, `annotations`, `audio`).
    model_config = ConfigDict(extra="ignore")


class _RequestBody(_Body):
    # An unknown top-level parameter is a 400 naming it, as OpenAI answers: a parameter dropped
    # silently is an answer to a question the client did not ask. Every parameter OpenAI
    # defines is declared (served, refused by name, or ignored: docs/openai-api.md).
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    """`stream_options`: a last chunk with the usage when `include_usage`. `include_obfuscation`
    pads chunks against length side channels; chunks are sent unpadded."""

    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None


class ContentPart(_Body):
    """One part of a message's content list; only text parts are served."""

    type: StrictStr
    text: StrictStr | None = None


class Prediction(_Body):
    """`prediction`: text the output is expected to repeat (OpenAI's Predicted Outputs)."""

    type: Literal["content"]
    content: StrictStr | list[ContentPart]


class FunctionCall(_Body):
    """An earlier call's function: its name and arguments (a JSON text, as OpenAI sends them)."""

    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class MessageToolCall(_Body):
    """A call of an earlier assistant message (`messages[i].tool_calls[j]`)."""

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One chat message; an assistant's may carry the calls it made, a tool's the id it answers."""

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: the schema (`schema`) and OpenAI's name for it."""

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """`response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: one of its keys. Unknown keys are refused, not ignored: a
    constraint we dropped silently would be unconstrained output."""

    model_config = ConfigDict(extra="forbid")

    json_value: dict[str, Any] | StrictBool | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class FunctionDefinition(_Body):
    """A function tool: its name, what it does, and its parameters' JSON schema."""

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    """One entry of `tools` (function tools only)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    """`tool_choice.function`."""

    name: StrictStr


class NamedToolChoice(_Body):
    """`tool_choice` naming the function that must be called."""

    type: Literal["function"]
    function: NamedFunction


# The body type of a control's Python type: strict, so that "0.5" is no number and true no integer.
_BODY_TYPES: dict[Any, Any] = {float: Float, int: StrictInt, bool: StrictBool, list[int]: list[StrictInt]}


def body_controls(options: type) -> list[str]:
    """The controls of an options dataclass that are body parameters of the same name (those
    declared with a `BodyParam`); a body leaves each out with null, or by omitting it."""
    return [name for name, wire in wires(options) if wire.body is not None]


def _control_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for options in (SamplingOptions, StoppingOptions):
        hints = typing.get_type_hints(options)
        fields.update({name: (_BODY_TYPES[hints[name]] | None, None) for name in body_controls(options)})
    return fields


# The controls as body parameters, generated from the request model so that a new one needs no
# code here (its row in docs/openai-api.md is generated from the same declaration).
_ControlsBody = create_model("_ControlsBody", __base__=_RequestBody, **_control_fields())


class _CommonBody(_ControlsBody):  # type: ignore[valid-type,misc]
    """Fields both endpoints take: OpenAI's, then the extras vLLM accepts (and the controls)."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Float | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    logit_bias: dict[str, Float] | None = None
    user: StrictStr | None = None  # ignored: an end user's id for OpenAI's abuse monitoring
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    prediction: Prediction | None = None
    top_k: StrictInt | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictBool | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


class ChatCompletionBody(_CommonBody):
    """`POST /v1/chat/completions`. The parameters `_REFUSED` names are typed loosely so that any
    value asking for them gets the refusal's reason; the ignored ones are hints about OpenAI's
    own storage, caching and billing."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True  # false: "required" makes exactly one call
    modalities: list[Literal["text", "audio"]] | None = None
    store: StrictBool | None = None
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    moderation: Any = None
    reasoning_effort: StrictStr | None = None
    verbosity: Any = None
    web_search_options: Any = None
    metadata: dict[StrictStr, StrictStr] | None = None  # ignored, as nothing is stored
    service_tier: StrictStr | None = None  # ignored: every request is served alike
    safety_identifier: StrictStr | None = None  # ignored, as `user`
    prompt_cache_key: StrictStr | None = None  # ignored: prefixes are cached by their tokens
    prompt_cache_options: dict[str, Any] | None = None  # ignored, as prompt_cache_key
    prompt_cache_retention: StrictStr | None = None  # ignored, as prompt_cache_key


class CompletionBody(_CommonBody):
    """`POST /v1/completions`: text, token ids, or a list of either (one choice set per prompt)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: Annotated[StrictInt, Field()] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


Body = ChatCompletionBody | CompletionBody


def _joined_text(content: str | list[ContentPart] | None, name: str) -> str:
    """A content's text: the string, or its text parts joined (other parts are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ParamError(f"{name}[{j}]", f"only text parts are supported, got type {part.type!r}")
        parts.append(part.text)
    return "".join(parts)


def _message_text(index: int, message: ChatMessage) -> str:
    return _joined_text(message.content, f"messages[{index}].content")


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


def echoed_prompts(body: Body, tokenizer: Tokenizer) -> list[str]:
    """The text each prompt's choices start with under completions' `echo` (none without):
    a text prompt as given, token ids decoded as they are (special tokens shown)."""
    if not isinstance(body, CompletionBody) or not body.echo:
        return []
    return [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in _prompts(body)]


def body_options(body: Body) -> tuple[SamplingOptions, StoppingOptions]:
    """The options a body asks for, not validated. Omitted fields keep OpenAI's defaults where
    they differ from ours (temperature 1).

    Raises:
        ParamError: a field that no option can stand for (a logit_bias key that is no number,
            two constraints at once).
    """
    sampling = SamplingOptions(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=0 if body.top_k in (None, -1) else body.top_k,  # vLLM spells "off" as -1
        seed=None if body.seed is None else body.seed % (1 << 64),  # a negative seed is still a seed
        logit_bias=_logit_bias(body.logit_bias or {}),
        n=body.n,
        constraint=body_constraint(body),
        prediction_text="" if body.prediction is None else _joined_text(body.prediction.content, "prediction.content"),
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
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
    )
    _copy_controls(body, sampling)
    _copy_controls(body, stopping)
    return sampling, stopping


def _copy_controls(body: Body, options: SamplingOptions | StoppingOptions) -> None:
    """The body's control parameters onto ``options`` (those it leaves out keep our defaults)."""
    for name in body_controls(type(options)):
        value = getattr(body, name)
        if value is not None:
            setattr(options, name, list(value) if isinstance(value, list) else value)


def _logit_bias(raw: dict[str, float]) -> dict[int, float]:
    bias = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise ParamError("logit_bias", f"keys must be token ids, got {key[:32]!r}") from None
    return bias


# vLLM's constraint keys (in `structured_outputs`, and as `guided_<key>`) and the kind of each.
_VLLM_KEYS = (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar"))


def _constraint(kind: str, value: Any, field_name: str) -> Constraint:
    """A constraint from a body value: schemas may be objects or JSON text, choices a list."""
    if kind == "choice":
        return Constraint(kind, json.dumps(value), field_name)
    if kind == "json_schema" and not isinstance(value, str):
        return Constraint(kind, json.dumps(value), field_name)
    return Constraint(kind, value, field_name)


def _response_format(fmt: ResponseFormat) -> Constraint | None:
    if fmt.type == "json_object":
        return Constraint("json_object", "", "response_format")
    if fmt.type == "text":
        return None
    if fmt.json_schema is None:
        raise ParamError("response_format.json_schema", 'required when type is "json_schema"')
    if fmt.json_schema.schema_ is None:
        raise ParamError("response_format.json_schema.schema", 'required when type is "json_schema"')
    return _constraint("json_schema", fmt.json_schema.schema_, "response_format.json_schema.schema")


def _structured_outputs(outputs: StructuredOutputs) -> list[Constraint]:
    """The constraints of `structured_outputs`' keys (more than one is a conflict)."""
    found = []
    for key, kind in _VLLM_KEYS:
        value = getattr(outputs, "json_value" if key == "json" else key)
        if value is not None:
            found.append(_constraint(kind, value, f"structured_outputs.{key}"))
    if outputs.json_object:
        found.append(Constraint("json_object", "", "structured_outputs.json_object"))
    return found


def _constraint_sources(body: Body) -> list[tuple[str, Constraint]]:
    """(parameter, constraint) of every field of ``body`` that constrains the output."""
    sources: list[tuple[str, Constraint]] = []
    fmt = _response_format(body.response_format) if body.response_format is not None else None
    if fmt is not None:
        sources.append(("response_format", fmt))
    if body.structured_outputs is not None:
        sources += [(c.field_name, c) for c in _structured_outputs(body.structured_outputs)]
    for key, kind in _VLLM_KEYS:
        value = getattr(body, f"guided_{key}")
        if value is not None:
            sources.append((f"guided_{key}", _constraint(kind, value, f"guided_{key}")))
    tool_call = _tool_constraint(body) if isinstance(body, ChatCompletionBody) else None
    if tool_call is not None:
        sources.append(("tool_choice", tool_call))
    return sources


def body_constraint(body: Body) -> Constraint | None:
    """The one constraint a body's fields ask for (None: unconstrained).

    Raises:
        ParamError: two fields that each constrain the output, or a malformed one.
    """
    sources = _constraint_sources(body)
    if len(sources) > 1:
        (first, _), (second, _) = sources[:2]
        raise ParamError(second, f"conflicts with {first}: a request takes one constraint")
    return sources[0][1] if sources else None


def _check_tools(tools: list[Tool]) -> None:
    if len(tools) > MAX_TOOLS:
        raise ParamError("tools", f"{len(tools)} tools, limit is {MAX_TOOLS}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not TOOL_NAME.fullmatch(name):
            raise ParamError(f"tools[{i}].function.name", "must be 1 to 64 of a-z, A-Z, 0-9, _, . and -")
        if name in names:
            raise ParamError(f"tools[{i}].function.name", f"{name!r} names two tools")
        names.add(name)


def _tool_constraint(body: ChatCompletionBody) -> Constraint | None:
    """The grammar forcing a call: for `tool_choice` "required" or a named function."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None:
            raise ParamError("tool_choice", "requires tools")
        return None
    _check_tools(body.tools)
    if choice is None or isinstance(choice, str) and choice != "required":
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if choice == "required":
        return tool_call_grammar(tools, None, "tools", parallel=body.parallel_tool_calls)
    name = choice.function.name
    if all(tool.function.name != name for tool in body.tools):
        raise ParamError("tool_choice", f"no function named {name[:64]!r} in tools")
    return tool_call_grammar(tools, name, "tools")


def parses_tool_calls(body: Body) -> bool:
    """Whether the replies read tool calls out of the output (tools given, not turned off)."""
    return isinstance(body, ChatCompletionBody) and bool(body.tools) and body.tool_choice != "none"


def shown_tools(body: ChatCompletionBody) -> list[dict[str, Any]] | None:
    """The tools the prompt describes: none with `tool_choice` "none", so the model answers."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def mentions_tools(body: Body) -> bool:
    """Whether rendering the conversation depends on how the chat template treats tools."""
    return isinstance(body, ChatCompletionBody) and (
        shown_tools(body) is not None or any(m.tool_calls or m.role == "tool" for m in body.messages)
    )


def _given(value: Any) -> bool:
    return value is not None


# Parameters asking for what is not served: (parameter, whether its value asks for it, why).
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("audio", _given, "audio output is not served"),
    ("modalities", lambda v: v is not None and v != ["text"], 'only ["text"] is served'),
    ("function_call", _given, "deprecated by OpenAI and not served: use tool_choice"),
    ("functions", _given, "deprecated by OpenAI and not served: use tools"),
    ("moderation", _given, "no moderation model is served"),
    ("reasoning_effort", lambda v: v not in (None, "none"), "the served models take no reasoning effort"),
    ("verbosity", _given, "the served models take no verbosity setting"),
    ("web_search_options", _given, "web search is not served"),
    ("store", lambda v: v is True, "completions are not stored"),
    ("suffix", bool, "fill in the middle is not supported"),
)
MAX_SEED = 2**63 - 1  # OpenAI's and vLLM's seeds are signed 64-bit integers


def _check_unsupported(body: Body) -> None:
    """ParamError for a feature we do not serve, or a field that needs another one."""
    for name, asks, why in _REFUSED:
        if asks(getattr(body, name, None)):
            raise ParamError(name, why)
    if body.stream_options is not None and not body.stream:
        raise ParamError("stream_options", "only allowed with stream: true")
    if body.seed is not None and not -MAX_SEED - 1 <= body.seed <= MAX_SEED:
        raise ParamError("seed", f"must fit in 64 signed bits, got {shown(body.seed)}")
    if isinstance(body, ChatCompletionBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise ParamError("top_logprobs", "requires logprobs: true")
        if not body.messages:
            raise ParamError("messages", "must not be empty")
    else:
        if body.best_of is not None and body.best_of != body.n:
            raise ParamError("best_of", "choosing the best of more sequences than n is not supported")
        if body.echo and body.logprobs is not None:
            raise ParamError("logprobs", "with echo it needs the prompt's log-probabilities, which are not computed")


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


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates that know tools read it (arguments as objects)."""
    out: dict[str, Any] = {"role": message.role, "content": _message_text(index, message)}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _plain_message(index: int, message: ChatMessage) -> dict[str, str]:
    """A message for a template that knows no tools: calls and results written in the Hermes
    format, which the tools' system message describes."""
    text = _message_text(index, message)
    if message.role == "tool":
        return {"role": "user", "content": tool_calls.response_text(text)}
    calls = [tool_calls.call_text(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return {"role": message.role, "content": "\n".join([text, *calls] if text else calls)}


def _plain_conversation(body: ChatCompletionBody) -> list[dict[str, str]]:
    """The messages for a template that knows no tools, the tools described in a system message."""
    messages = [_plain_message(i, m) for i, m in enumerate(body.messages)]
    tools = shown_tools(body)
    if tools is not None:
        described = tool_calls.system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{described}"}
        else:
            messages.insert(0, {"role": "system", "content": described})
    return messages


def _write_chat_input(
    body: ChatCompletionBody, request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None
) -> None:
    """The conversation into ``request``: as messages, or, when the template renders tools
    itself, as the prompt text it renders (the wire's messages carry no tools)."""
    if tokenizer is not None and tokenizer.template_takes_tools and mentions_tools(body):
        for i, message in enumerate(body.messages):  # the servicer checks the roles of messages only
            if message.role not in CHAT_ROLES:
                raise ParamError(f"messages[{i}].role", f"unknown role {shown(message.role)}")
        rendered = [_template_message(i, m) for i, m in enumerate(body.messages)]
        try:
            request.prompt = tokenizer.render_chat_template(rendered, tools=shown_tools(body))
        except ValueError as exc:
            raise ParamError("messages", str(exc)) from None
        return
    request.messages.SetInParent()
    for plain in _plain_conversation(body):
        request.messages.messages.add(role=plain["role"], content=plain["content"])


def build_requests(
    body: Body, request_id: str, tokenizer: Tokenizer | None = None
) -> list[generate_pb2.GenerateRequest]:
    """The `GenerateRequest`s a body stands for: one, or one per prompt of a completions list.
    ``tokenizer``: the served model's, needed when `mentions_tools` (whether its chat template
    renders tools decides how the conversation is sent).

    Raises:
        ParamError: a field out of range, or an unsupported feature.
    """
    _check_unsupported(body)
    prompts = [] if isinstance(body, ChatCompletionBody) else _prompts(body)
    sampling, stopping = _validated(body, prompts)
    template = generate_pb2.GenerateRequest(model=body.model or "")
    write_generate_request(sampling, stopping, template)
    if isinstance(body, ChatCompletionBody):
        _write_chat_input(body, template, tokenizer)
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
        # A control's proto path (`stopping.stop[2]`) names its body parameter (`stop[2]`).
        param = path.partition(".")[2] if base.startswith(("stopping.", "response.")) else base
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


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """A call's token counts, summed over its prompts and sequences."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    accepted_prediction: int = 0  # the prediction's tokens that the output kept
    rejected_prediction: int = 0  # those it did not (in OpenAI's completion_tokens, not in ours)


def usage(counts: TokenCounts) -> dict[str, Any]:
    """The `usage` object, with OpenAI's details (no audio or reasoning tokens here)."""
    return {
        "prompt_tokens": counts.prompt,
        "completion_tokens": counts.completion,
        "total_tokens": counts.prompt + counts.completion,
        "prompt_tokens_details": {"cached_tokens": counts.cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": counts.accepted_prediction,
            "rejected_prediction_tokens": counts.rejected_prediction,
        },
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
