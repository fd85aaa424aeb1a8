"""The request model: how tokens are drawn (`SamplingOptions`) and when generation ends
(`StoppingOptions`), every range they may take, and their conversions at each wire boundary.

A request's options travel as these two types from the moment they leave a wire form: the
client's `GenerateRequest` (`from_generate_request`), an OpenAI body (`scheduler_svc/
openai_protocol.py`, which writes them back with `write_generate_request`), and the plan row to
the worker (`to_worker_sampling`). The ranges live here alone: the HTTP layer checks them before
it builds a protobuf (so a value the wire cannot carry is a named 400, not a crash), the gRPC
servicer and the scheduler check them again with the model's vocabulary and length.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class SamplingOptions:
    """How tokens are drawn. Defaults are greedy; `seed` None means the scheduler picks one.

    Ranges follow OpenAI (penalties in [-2, 2], logit_bias values in [-100, 100], top_logprobs
    up to 20) and vLLM for the extras (repetition_penalty > 0, min_p in [0, 1]).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int = 0  # also the N most likely tokens per emitted token
    n: int = 1  # sequences sharing the prompt; the scheduler runs each as its own request
    constraint: Constraint | None = None  # structured output (`zerobubble.structured`)
    # The constraint's llguidance grammar, compiled and checked by the scheduler at submission:
    # what the worker receives.
    grammar: str = ""
    # A predicted output (OpenAI's `prediction`): its text as the client gave it, and its token
    # ids (the client's, or the text's tokenized by the scheduler at submission): what the
    # worker drafts from. Empty: none.
    prediction_text: str = ""
    prediction_token_ids: list[int] = field(default_factory=list)

    def validate(self, vocab_size: int | None = None) -> None:
        """Every range; :class:`InvalidRequest` names the field as the client API spells it.
        Without ``vocab_size`` token ids are checked against what the wire can carry."""
        t = self.temperature
        require(0 <= t <= FLOAT32_MAX, f"sampling.temperature: must be a finite number >= 0, got {shown(t)}")
        require_in(self.top_k, 0, INT32_MAX, "sampling.top_k")
        require(0 < self.top_p <= 1, f"sampling.top_p: must be in (0, 1], got {shown(self.top_p)}")
        require(
            self.seed is None or 0 <= self.seed <= UINT64_MAX,
            f"sampling.seed: must fit in 64 unsigned bits, got {shown(self.seed)}",
        )
        require_in(self.presence_penalty, -2.0, 2.0, "sampling.presence_penalty")
        require_in(self.frequency_penalty, -2.0, 2.0, "sampling.frequency_penalty")
        rep = self.repetition_penalty
        require(0.0 < rep <= FLOAT32_MAX, f"sampling.repetition_penalty: must be > 0 and finite, got {shown(rep)}")
        require_in(self.min_p, 0.0, 1.0, "sampling.min_p")
        require_in(self.top_logprobs, 0, MAX_TOP_LOGPROBS, "response.top_logprobs")
        require_in(self.n, 1, MAX_N, "sampling.n")
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


@dataclass(slots=True)
class StoppingOptions:
    """When generation ends. `max_tokens` None means up to the model length."""

    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None, max_len: int | None = None) -> None:
        """Every range; :class:`InvalidRequest` names the field. ``max_len`` is the longest
        sequence the request may reach; without it (and ``vocab_size``) the limits are the wire's."""
        if self.max_tokens is not None:
            require_in(self.max_tokens, 1, INT32_MAX, "stopping.max_tokens")
            require(
                max_len is None or self.max_tokens <= max_len,
                f"stopping.max_tokens: {self.max_tokens} exceeds the model length {max_len}",
            )
        require_in(self.min_tokens, 0, INT32_MAX, "stopping.min_tokens")
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


def from_generate_request(request: generate_pb2.GenerateRequest) -> tuple[SamplingOptions, StoppingOptions]:
    """The options of a client `GenerateRequest` (unset optional fields take our defaults;
    ``n`` 0 is the proto's "unset", one sequence). Not validated: see `validate_options`."""
    s, st, resp = request.sampling, request.stopping, request.response
    sampling = SamplingOptions(
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=resp.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        min_p=s.min_p,
        logit_bias=dict(s.logit_bias),
        top_logprobs=resp.top_logprobs,
        n=s.n or 1,
        constraint=from_proto(request.constraint) if request.HasField("constraint") else None,
    )
    if request.HasField("prediction"):
        pred = request.prediction
        if pred.WhichOneof("content") == "token_ids":
            sampling.prediction_token_ids = list(pred.token_ids.ids)
        else:
            sampling.prediction_text = pred.text
    stopping = StoppingOptions(
        max_tokens=st.max_tokens if st.HasField("max_tokens") else None,
        min_tokens=st.min_tokens,
        stop=list(st.stop),
        stop_token_ids=list(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
    )
    return sampling, stopping


def write_generate_request(
    sampling: SamplingOptions, stopping: StoppingOptions, request: generate_pb2.GenerateRequest
) -> None:
    """Set ``request``'s sampling, stopping and response fields from validated options (the
    inverse of `from_generate_request`). Raises ValueError for a value the wire cannot carry,
    which `SamplingOptions.validate` and `StoppingOptions.validate` rule out."""
    s, st, resp = request.sampling, request.stopping, request.response
    s.temperature = sampling.temperature
    s.top_k = sampling.top_k
    s.top_p = sampling.top_p
    if sampling.seed is not None:
        s.seed = sampling.seed
    s.presence_penalty = sampling.presence_penalty
    s.frequency_penalty = sampling.frequency_penalty
    s.repetition_penalty = sampling.repetition_penalty
    s.min_p = sampling.min_p
    s.logit_bias.update(sampling.logit_bias)
    s.n = sampling.n
    resp.logprobs = sampling.logprobs
    resp.top_logprobs = sampling.top_logprobs
    if stopping.max_tokens is not None:
        st.max_tokens = stopping.max_tokens
    st.min_tokens = stopping.min_tokens
    st.stop.extend(stopping.stop)
    st.stop_token_ids.extend(stopping.stop_token_ids)
    st.ignore_eos = stopping.ignore_eos
    if sampling.constraint is not None:
        write_proto(sampling.constraint, request.constraint)
    if sampling.prediction_text:
        request.prediction.text = sampling.prediction_text
    elif sampling.prediction_token_ids:
        request.prediction.token_ids.ids.extend(sampling.prediction_token_ids)


def to_worker_sampling(sampling: SamplingOptions, num_prompt_tokens: int) -> worker_pb2.SamplingParams:
    """The plan row's sampling parameters: the one conversion from the scheduler to the worker
    (which reads them as `zerobubble.worker_svc.sampler.SamplingLike`)."""
    return worker_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed or 0,
        logprobs=sampling.logprobs,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        min_p=sampling.min_p,
        logit_bias=sampling.logit_bias,
        top_logprobs=sampling.top_logprobs,
        num_prompt_tokens=num_prompt_tokens,
        grammar=sampling.grammar,
        prediction_token_ids=sampling.prediction_token_ids,
    )


def for_sequence(sampling: SamplingOptions, seed: int) -> SamplingOptions:
    """A copy of ``sampling`` for one of its ``n`` sequences, drawing with ``seed``."""
    return dataclasses.replace(
        sampling,
        seed=seed,
        logit_bias=dict(sampling.logit_bias),
        n=1,
        prediction_token_ids=list(sampling.prediction_token_ids),
    )
