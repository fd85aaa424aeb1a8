"""The request model: how tokens are drawn (`SamplingOptions`) and when generation ends
(`StoppingOptions`), every range they may take, and their conversions at each wire boundary.

The two dataclasses are the one Python mirror of `generate.proto`'s `RequestSpec` (whose
messages a `GenerateRequest` carries and the worker's `SamplingParams` embeds). Each control is
declared once, as a field made by `control`: its path in the `RequestSpec`, its range and, for
a body parameter of the OpenAI front, its row in docs/openai-api.md. Everything else follows
from that declaration: the validator (`validate`), the converters each way (`read_controls`,
`write_controls`: from and to a `GenerateRequest`, the plan row to the worker, and the client's
`build_request`), the OpenAI body's fields (`scheduler_svc/openai_protocol.py`) and the doc's
rows (`tools/control_table.py`). So a new control is its field here, its field in
`generate.proto` and its stage in `worker_svc/sampler.py`.

The ranges live here alone: the HTTP layer checks them before it builds a protobuf (so a value
the wire cannot carry is a named 400, not a crash), the gRPC servicer and the scheduler check
them again with the model's vocabulary and length.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zerobubble.api import generate_pb2, worker_pb2

# What the wire can carry: int32 fields and float32 fields (larger floats become infinity).
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
UINT64_MAX = 2**64 - 1

# Our own input limits: far below the transport cap so that oversized input gets a clear message.
MAX_PROMPT_CHARS = 1_000_000  # of a prompt, or of all the messages' content together
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries in sampling.logit_bias
# Sequences per request (n); each holds its own KV blocks past the shared prompt.
MAX_N = 16


class InvalidRequest(ValueError):
    """A client field is invalid; the message names the field (INVALID_ARGUMENT, HTTP 400)."""


def require(cond: bool, message: str) -> None:
    """:class:`InvalidRequest` with ``message`` unless ``cond``."""
    if not cond:
        raise InvalidRequest(message)


def shown(value: object) -> str:
    """A client's value for an error message, cut short: an absurd one can be megabytes."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def require_in(value: float, low: float, high: float, name: str) -> None:
    """``low <= value <= high``, else :class:`InvalidRequest` naming ``name``. Python compares
    ints and floats exactly, so an integer too large for a float, infinity and NaN all fail."""
    require(low <= value <= high, f"{name}: must be in [{low}, {high}], got {shown(value)}")


def validate_token_ids(ids: Sequence[int], name: str, vocab_size: int | None = None) -> None:
    """Every id in [0, vocab_size), or in the wire's int32 range when the vocabulary is unknown."""
    limit = vocab_size if vocab_size is not None else INT32_MAX + 1
    for token_id in ids:
        require(0 <= token_id < limit, f"{name}: {shown(token_id)} is outside the vocabulary [0, {limit})")


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match. ``value``: the schema (JSON text), the regex, the
    choices (a JSON list), the grammar or the tool-call grammar; empty for ``json_object``.
    ``field_name``: the parameter as the client named it, for error messages."""

    kind: str
    value: str = ""
    field_name: str = ""

    @property
    def field(self) -> str:
        return self.field_name or f"constraint.{self.kind}"


def from_proto(message: generate_pb2.Constraint) -> Constraint | None:
    """The constraint of a `GenerateRequest` (None when it has none)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        value = ""
    elif kind == "choice":
        value = json.dumps(list(message.choice.choices))
    else:
        value = getattr(message, kind)
    return Constraint(kind, value, message.field_name)


def write_proto(constraint: Constraint, message: generate_pb2.Constraint) -> None:
    """Set ``message`` from ``constraint`` (the inverse of `from_proto`)."""
    if constraint.kind == "json_object":
        message.json_object = True
    elif constraint.kind == "choice":
        message.choice.choices.extend(json.loads(constraint.value))
    else:
        setattr(message, constraint.kind, constraint.value)
    message.field_name = constraint.field_name


@dataclass(frozen=True, slots=True)
class Range:
    """A control's range, ``[low, high]`` or ``(low, high]``. Python compares ints and floats
    exactly, so an integer too large for a float, infinity and NaN all fall outside it."""

    low: float
    high: float
    low_open: bool = False

    def check(self, value: float, name: str) -> None:
        inside = (self.low < value if self.low_open else self.low <= value) and value <= self.high
        opening = "(" if self.low_open else "["
        require(inside, f"{name}: must be in {opening}{self.low}, {self.high}], got {shown(value)}")


@dataclass(frozen=True, slots=True)
class BodyParam:
    """A control the OpenAI front takes as a body parameter of the same name, documented from
    here: its row's example value and notes in docs/openai-api.md (`make docs`)."""

    example: object
    note: str


@dataclass(frozen=True, slots=True)
class Wire:
    """Where one option travels in a `RequestSpec` (and so in a `GenerateRequest`, numbered
    alike): ``path`` is ``message.field``. An unset optional field reads as the option's default,
    a value in ``unset`` too (the proto's zero standing for "not given")."""

    path: str
    bounds: Range | None = None
    body: BodyParam | None = None
    unset: tuple[object, ...] = ()

    @property
    def message(self) -> str:
        return self.path.partition(".")[0]

    @property
    def field(self) -> str:
        return self.path.partition(".")[2]


def control(
    default: Any = None,
    path: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    bounds: Range | None = None,
    body: BodyParam | None = None,
    unset: tuple[object, ...] = (),
) -> Any:
    """A dataclass field that is a request control: converted, checked and (with ``body``)
    served and documented by the OpenAI front from this declaration alone."""
    wire = Wire(path, bounds, body, unset)
    if factory is not None:
        return field(default_factory=factory, metadata={"wire": wire})
    return field(default=default, metadata={"wire": wire})


def wires(options: type) -> list[tuple[str, Wire]]:
    """(field name, wire) of every control of an options dataclass, in declaration order."""
    return [(f.name, f.metadata["wire"]) for f in dataclasses.fields(options) if "wire" in f.metadata]


def _check_ranges(options: object) -> None:
    for name, wire in wires(type(options)):
        value = getattr(options, name)
        if wire.bounds is not None and value is not None:
            wire.bounds.check(value, wire.path)


@dataclass(slots=True)
class SamplingOptions:
    """How tokens are drawn, and what the reply reports of them: the Python mirror of a
    `RequestSpec`'s `sampling` and `response` messages. Defaults are greedy; `seed` None means
    the scheduler picks one.

    A control declared with `control` is converted to and from the wire, range-checked and
    (given a `BodyParam`) taken by the OpenAI front with no other code. Ranges follow OpenAI
    (penalties in [-2, 2], logit_bias values in [-100, 100], top_logprobs up to 20) and vLLM for
    the extras (repetition_penalty > 0, min_p in [0, 1]).
    """

    temperature: float = control(0.0, "sampling.temperature")
    top_k: int = control(0, "sampling.top_k", bounds=Range(0, INT32_MAX))
    top_p: float = control(1.0, "sampling.top_p", bounds=Range(0, 1, low_open=True), body=BodyParam(0.9, "in (0, 1]"))
    seed: int | None = control(None, "sampling.seed")
    logprobs: bool = control(False, "response.logprobs")
    # OpenAI semantics, over output tokens.
    presence_penalty: float = control(
        0.0, "sampling.presence_penalty", bounds=Range(-2.0, 2.0), body=BodyParam(0.5, "in [-2, 2]")
    )
    frequency_penalty: float = control(
        0.0, "sampling.frequency_penalty", bounds=Range(-2.0, 2.0), body=BodyParam(0.5, "in [-2, 2]")
    )
    # HF semantics, over prompt + output tokens.
    repetition_penalty: float = control(
        1.0, "sampling.repetition_penalty", body=BodyParam(1.1, "vLLM extra; > 0, over prompt and output tokens")
    )
    min_p: float = control(0.0, "sampling.min_p", bounds=Range(0.0, 1.0), body=BodyParam(0.1, "vLLM extra; in [0, 1]"))
    logit_bias: dict[int, float] = control(path="sampling.logit_bias", factory=dict)
    # Locally typical sampling (HF's TypicalLogitsWarper), after min_p.
    typical_p: float = control(
        1.0,
        "sampling.typical_p",
        bounds=Range(0, 1, low_open=True),
        body=BodyParam(0.9, "Hugging Face's typical sampling; in (0, 1], 1 is off"),
    )
    # Also the N most likely tokens per emitted token.
    top_logprobs: int = control(0, "response.top_logprobs", bounds=Range(0, MAX_TOP_LOGPROBS))
    # Sequences sharing the prompt; the scheduler runs each as its own request (0 on the wire: one).
    n: int = control(1, "sampling.n", bounds=Range(1, MAX_N), unset=(0,))
    constraint: Constraint | None = None  # structured output (`zerobubble.structured`)
    # The constraint's llguidance grammar, compiled and checked by the scheduler at submission:
    # what the worker receives.
    grammar: str = ""
    # A predicted output (OpenAI's `prediction`): its text as the client gave it, and its token
    # ids (the client's, or the text's tokenized by the scheduler at submission): what the
    # worker drafts from. Empty: none.
    prediction_text: str = ""
    prediction_token_ids: list[int] = field(default_factory=list)
    # For the worker: the prompt's length, past which presence and frequency penalties count
    # (a request resumed after preemption prefills prompt + outputs, and those outputs count).
    num_prompt_tokens: int = 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Every range; :class:`InvalidRequest` names the field as the client API spells it.
        Without ``vocab_size`` token ids are checked against what the wire can carry."""
        t = self.temperature
        require(0 <= t <= FLOAT32_MAX, f"sampling.temperature: must be a finite number >= 0, got {shown(t)}")
        require(
            self.seed is None or 0 <= self.seed <= UINT64_MAX,
            f"sampling.seed: must fit in 64 unsigned bits, got {shown(self.seed)}",
        )
        rep = self.repetition_penalty
        require(0.0 < rep <= FLOAT32_MAX, f"sampling.repetition_penalty: must be > 0 and finite, got {shown(rep)}")
        _check_ranges(self)
        self._validate_logit_bias(vocab_size)
        require(
            len(self.prediction_text) <= MAX_PROMPT_CHARS,
            f"prediction: {len(self.prediction_text)} characters, limit is {MAX_PROMPT_CHARS}",
        )
        validate_token_ids(self.prediction_token_ids, "prediction", vocab_size)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        require(len(bias) <= MAX_LOGIT_BIAS, f"sampling.logit_bias: {len(bias)} entries, limit is {MAX_LOGIT_BIAS}")
        validate_token_ids(sorted(bias), "sampling.logit_bias", vocab_size)
        for token_id, value in sorted(bias.items()):
            require_in(value, -100.0, 100.0, f"sampling.logit_bias[{token_id}]")


def has_penalty(p: SamplingOptions) -> bool:
    """Whether a request uses any of the repetition, frequency or presence penalties."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty not in (0.0, 1.0))


def reads_whole_context(p: SamplingOptions) -> bool:
    """Whether the worker reads a request's tokens from the start of its context while it runs:
    penalties count every token, and a resumed constrained request replays its outputs into its
    grammar. Both read the token pages that follow the KV blocks, so a sliding-window model's
    scheduler keeps such a request's blocks instead of freeing those behind the window."""
    return has_penalty(p) or bool(p.grammar)


@dataclass(slots=True)
class StoppingOptions:
    """When generation ends: the Python mirror of a `RequestSpec`'s `stopping` message.
    `max_tokens` None means up to the model length."""

    max_tokens: int | None = control(None, "stopping.max_tokens")
    min_tokens: int = control(0, "stopping.min_tokens", bounds=Range(0, INT32_MAX), body=BodyParam(1, "vLLM extra"))
    stop: list[str] = control(path="stopping.stop", factory=list)
    stop_token_ids: list[int] = control(path="stopping.stop_token_ids", factory=list, body=BodyParam([2], "vLLM extra"))
    ignore_eos: bool = control(False, "stopping.ignore_eos", body=BodyParam(True, "vLLM extra"))

    def validate(self, vocab_size: int | None = None, max_len: int | None = None) -> None:
        """Every range; :class:`InvalidRequest` names the field. ``max_len`` is the longest
        sequence the request may reach; without it (and ``vocab_size``) the limits are the wire's."""
        if self.max_tokens is not None:
            require_in(self.max_tokens, 1, INT32_MAX, "stopping.max_tokens")
            require(
                max_len is None or self.max_tokens <= max_len,
                f"stopping.max_tokens: {self.max_tokens} exceeds the model length {max_len}",
            )
        _check_ranges(self)
        if self.max_tokens is not None:
            require(
                self.min_tokens <= self.max_tokens,
                f"stopping.min_tokens: {self.min_tokens} exceeds max_tokens {self.max_tokens}",
            )
        require(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"stopping.stop: {len(self.stop)} stop strings, limit is {MAX_STOP_STRINGS}",
        )
        for i, text in enumerate(self.stop):
            require(0 < len(text) <= MAX_STOP_CHARS, f"stopping.stop[{i}]: must be 1 to {MAX_STOP_CHARS} characters")
        require(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"stopping.stop_token_ids: {len(self.stop_token_ids)} ids, limit is {MAX_STOP_TOKEN_IDS}",
        )
        validate_token_ids(self.stop_token_ids, "stopping.stop_token_ids", vocab_size)


def validate_options(
    prompt: Sequence[int], sampling: SamplingOptions, stopping: StoppingOptions, *, vocab_size: int, max_len: int
) -> None:
    """The one validator of a request's prompt and options against a model; :class:`InvalidRequest`
    names the field as the client API spells it (``sampling.top_p``, ``stopping.max_tokens``, ...).

    ``max_len`` is the longest sequence the request may reach (model length, capped by the
    KV cache so that a preempted request can always be resumed).
    """
    require(len(prompt) > 0, "input: tokenizes to no tokens")
    validate_token_ids(prompt, "token_ids", vocab_size)
    require(
        len(prompt) < max_len,
        f"input: prompt is {len(prompt)} tokens, the model length is {max_len} (at least one token must fit after it)",
    )
    sampling.validate(vocab_size)
    stopping.validate(vocab_size, max_len)


def read_controls(options: Any, spec: Any) -> None:
    """Set ``options``' controls from ``spec``: a `RequestSpec`, or any message with its
    `sampling` / `stopping` / `response` fields (a `GenerateRequest`). Unset optional fields and
    their ``unset`` values keep the option's default; repeated and map fields are copied."""
    for name, wire in wires(type(options)):
        message = getattr(spec, wire.message)
        value = getattr(message, wire.field)
        if message.DESCRIPTOR.fields_by_name[wire.field].has_presence and not message.HasField(wire.field):
            continue
        if value in wire.unset:
            continue
        if isinstance(value, (str, bytes, int, float)):
            setattr(options, name, value)
        elif hasattr(value, "items"):
            setattr(options, name, dict(value.items()))
        else:
            setattr(options, name, list(value))


def write_controls(options: Any, spec: Any, names: Iterable[str] | None = None) -> None:
    """Set ``spec``'s fields from ``options``' controls (the inverse of `read_controls`); only
    ``names`` when given. None values stay unset. Raises ValueError for a value the wire cannot
    carry, which `SamplingOptions.validate` and `StoppingOptions.validate` rule out."""
    chosen = None if names is None else set(names)
    for name, wire in wires(type(options)):
        value = getattr(options, name)
        if value is None or chosen is not None and name not in chosen:
            continue
        message = getattr(spec, wire.message)
        if isinstance(value, Mapping):
            getattr(message, wire.field).update(value)
        elif isinstance(value, list | tuple):
            getattr(message, wire.field).extend(value)
        else:
            setattr(message, wire.field, value)


def write_named_controls(controls: Mapping[str, Any], request: generate_pb2.GenerateRequest) -> None:
    """Set the controls named in ``controls`` (fields of `SamplingOptions` or `StoppingOptions`)
    on ``request``; a None value leaves its field to the server's default.

    Raises:
        TypeError: a name that is no control.
    """
    names = set(controls)
    for options in (SamplingOptions(), StoppingOptions()):
        mine = names & {name for name, _ in wires(type(options))}
        for name in mine:
            setattr(options, name, controls[name])
        write_controls(options, request, mine)
        names -= mine
    if names:
        raise TypeError(f"not a sampling or stopping control: {', '.join(sorted(names))}")


def from_generate_request(request: generate_pb2.GenerateRequest) -> tuple[SamplingOptions, StoppingOptions]:
    """The options of a client `GenerateRequest` (unset optional fields take our defaults;
    ``n`` 0 is the proto's "unset", one sequence). Not validated: see `validate_options`."""
    sampling, stopping = SamplingOptions(), StoppingOptions()
    read_controls(sampling, request)
    read_controls(stopping, request)
    if request.HasField("constraint"):
        sampling.constraint = from_proto(request.constraint)
    if request.HasField("prediction"):
        pred = request.prediction
        if pred.WhichOneof("content") == "token_ids":
            sampling.prediction_token_ids = list(pred.token_ids.ids)
        else:
            sampling.prediction_text = pred.text
    return sampling, stopping


def write_generate_request(
    sampling: SamplingOptions, stopping: StoppingOptions, request: generate_pb2.GenerateRequest
) -> None:
    """Set ``request``'s sampling, stopping and response fields from validated options (the
    inverse of `from_generate_request`). Raises ValueError for a value the wire cannot carry,
    which `SamplingOptions.validate` and `StoppingOptions.validate` rule out."""
    write_controls(sampling, request)
    write_controls(stopping, request)
    if sampling.constraint is not None:
        write_proto(sampling.constraint, request.constraint)
    if sampling.prediction_text:
        request.prediction.text = sampling.prediction_text
    elif sampling.prediction_token_ids:
        request.prediction.token_ids.ids.extend(sampling.prediction_token_ids)


def to_worker_sampling(sampling: SamplingOptions, num_prompt_tokens: int) -> worker_pb2.SamplingParams:
    """The plan row's sampling parameters: the one conversion from the scheduler to the worker,
    which reads them back with `from_worker_sampling`."""
    params = worker_pb2.SamplingParams(
        num_prompt_tokens=num_prompt_tokens,
        grammar=sampling.grammar,
        prediction_token_ids=sampling.prediction_token_ids,
    )
    write_controls(sampling, params.spec)
    return params


def from_worker_sampling(params: worker_pb2.SamplingParams) -> SamplingOptions:
    """A plan row's sampling parameters as the worker keeps them (the inverse of
    `to_worker_sampling`)."""
    sampling = SamplingOptions(
        num_prompt_tokens=params.num_prompt_tokens,
        grammar=params.grammar,
        prediction_token_ids=list(params.prediction_token_ids),
    )
    read_controls(sampling, params.spec)
    return sampling


def for_sequence(sampling: SamplingOptions, seed: int) -> SamplingOptions:
    """A copy of ``sampling`` for one of its ``n`` sequences, drawing with ``seed``."""
    return dataclasses.replace(
        sampling,
        seed=seed,
        logit_bias=dict(sampling.logit_bias),
        n=1,
        prediction_token_ids=list(sampling.prediction_token_ids),
    )
