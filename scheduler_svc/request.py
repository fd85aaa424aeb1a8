"""Per-request state kept by the scheduler.

Counters follow DESIGN.md's async + speculative contract:

- `num_computed` counts every token slot scheduled to the worker in the current admission
  (prefill chunks, and 1 + k per decode, drafts included) minus the draft slots that results
  later rejected. It is optimistic: it runs ahead of what the worker has really written.
- `num_placeholders` counts output slots scheduled whose tokens are not back yet.

So `len(output_token_ids) + num_placeholders` is the most tokens the request could have once
every in-flight step is answered, which is what limits how far ahead it may be scheduled.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_svc.block_pool import BlockHash
from scheduler_svc.detokenizer import Detokenizer
from zerobubble.api import generate_pb2

if TYPE_CHECKING:
    from scheduler_svc.tokenizer import Tokenizer
    from zerobubble.api.worker_pb2 import WorkerInfo


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True)
class SamplingOptions:
    """How tokens are drawn. Defaults are greedy; `seed` None means the scheduler picks one."""

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


@dataclass(slots=True)
class StoppingOptions:
    """When generation ends. `max_tokens` None means up to the model length."""

    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


# Our own input limits: far below the transport cap so oversized input gets a clear message.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries in sampling.logit_bias


class InvalidRequest(ValueError):
    """A client field is invalid; the message names the field (INVALID_ARGUMENT, HTTP 400)."""


def require(cond: bool, message: str) -> None:
    """:class:`InvalidRequest` with ``message`` unless ``cond``."""
    if not cond:
        raise InvalidRequest(message)


MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool")


# Sequences per request (n), far below what the transport allows so that too many gets a
# clear message; each holds its own KV blocks past the shared prompt.
MAX_N = 16


def num_sequences(request: generate_pb2.GenerateRequest) -> int:
    """``sampling.n`` (0 means 1); :class:`InvalidRequest` outside [1, MAX_N]. The other
    sampling controls are checked with every option by `validate_options`."""
    n = request.sampling.n or 1
    require(1 <= n <= MAX_N, f"sampling.n: must be in [1, {MAX_N}], got {request.sampling.n}")
    return n


def request_prompt_ids(
    request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest, tokenizer: Tokenizer, info: WorkerInfo
) -> list[int]:
    """The prompt of a `GenerateRequest` (or `TokenizeRequest`) as token ids: its text tokenized, its messages through
    the chat template, or its ids checked against the vocabulary. The one place a request's
    input is read, in the scheduler and in a front (`scheduler_svc/front.py`), which tokenizes
    before relaying.

    Raises:
        InvalidRequest: an empty, too long or malformed input.
    """
    kind = request.WhichOneof("input")
    if kind == "prompt":
        require(len(request.prompt) > 0, "prompt: must not be empty")
        require(
            len(request.prompt) <= MAX_PROMPT_CHARS,
            f"prompt: {len(request.prompt)} characters, limit is {MAX_PROMPT_CHARS}",
        )
        ids = tokenizer.encode(request.prompt)
    elif kind == "messages":
        msgs = request.messages.messages
        require(len(msgs) > 0, "messages: must not be empty")
        require(len(msgs) <= MAX_MESSAGES, f"messages: {len(msgs)} messages, limit is {MAX_MESSAGES}")
        total = sum(len(m.content) for m in msgs)
        require(total <= MAX_PROMPT_CHARS, f"messages: {total} characters of content, limit is {MAX_PROMPT_CHARS}")
        for i, m in enumerate(msgs):
            require(m.role in CHAT_ROLES, f"messages[{i}].role: unknown role {m.role!r}")
        try:
            ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs])
        except Exception as exc:  # a template's raise_exception, e.g. bad role order
            raise InvalidRequest(f"messages: chat template rejected them: {exc}") from exc
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        require(len(ids) > 0, "token_ids: must not be empty")
        vocab = info.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        require(not bad, f"token_ids: {bad[0] if bad else 0} is outside the vocabulary [0, {vocab})")
    else:
        raise InvalidRequest("input: one of prompt, messages or token_ids is required")
    require(len(ids) > 0, "input: tokenizes to no tokens")
    return ids


def tokenize_response(
    request: generate_pb2.TokenizeRequest, tokenizer: Tokenizer, info: WorkerInfo
) -> generate_pb2.TokenizeResponse:
    """The answer to `Tokenize`: the request's input as `request_prompt_ids` reads it, with
    each id's token string; the scheduler and a front answer it alike.

    Raises:
        InvalidRequest: an empty, too long or malformed input.
    """
    ids = request_prompt_ids(request, tokenizer, info)
    return generate_pb2.TokenizeResponse(token_ids=ids, tokens=[tokenizer.id_to_token(i) or "" for i in ids])


def validate_options(
    prompt: list[int], sampling: SamplingOptions, stopping: StoppingOptions, *, vocab_size: int, max_len: int
) -> None:
    """The one validator of a request's prompt and options; :class:`InvalidRequest` names the
    field as the client API spells it (``sampling.top_p``, ``stopping.max_tokens``, ...).

    ``max_len`` is the longest sequence the request may reach (model length, capped by the
    KV cache so that a preempted request can always be resumed).
    """
    require(len(prompt) > 0, "input: tokenizes to no tokens")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    require(not bad, f"token_ids: {bad[0] if bad else 0} is outside the vocabulary [0, {vocab_size})")
    require(
        len(prompt) < max_len,
        f"input: prompt is {len(prompt)} tokens, the model length is {max_len} (at least one token must fit after it)",
    )
    t = sampling.temperature
    require(math.isfinite(t) and t >= 0, f"sampling.temperature: must be >= 0, got {t}")
    require(sampling.top_k >= 0, f"sampling.top_k: must be >= 0, got {sampling.top_k}")
    require(0 < sampling.top_p <= 1, f"sampling.top_p: must be in (0, 1], got {sampling.top_p}")
    require(
        sampling.seed is None or 0 <= sampling.seed < 2**64,
        f"sampling.seed: must fit in 64 unsigned bits, got {sampling.seed}",
    )
    if stopping.max_tokens is not None:
        require(stopping.max_tokens > 0, f"stopping.max_tokens: must be > 0, got {stopping.max_tokens}")
        require(
            stopping.max_tokens <= max_len,
            f"stopping.max_tokens: {stopping.max_tokens} exceeds the model length {max_len}",
        )
    require(stopping.min_tokens >= 0, f"stopping.min_tokens: must be >= 0, got {stopping.min_tokens}")
    if stopping.max_tokens is not None:
        require(
            stopping.min_tokens <= stopping.max_tokens,
            f"stopping.min_tokens: {stopping.min_tokens} exceeds max_tokens {stopping.max_tokens}",
        )
    require(
        len(stopping.stop) <= MAX_STOP_STRINGS,
        f"stopping.stop: {len(stopping.stop)} stop strings, limit is {MAX_STOP_STRINGS}",
    )
    for i, text in enumerate(stopping.stop):
        require(0 < len(text) <= MAX_STOP_CHARS, f"stopping.stop[{i}]: must be 1 to {MAX_STOP_CHARS} characters")
    for i, tid in enumerate(stopping.stop_token_ids):
        require(0 <= tid < vocab_size, f"stopping.stop_token_ids[{i}]: {tid} is outside the vocabulary")
    validate_sampling_controls(sampling, vocab_size)


def validate_sampling_controls(sampling: SamplingOptions, vocab_size: int) -> None:
    """Penalties, min_p, logit_bias and top_logprobs (part of `validate_options`).

    Ranges follow OpenAI (penalties in [-2, 2], logit_bias values in [-100, 100], top_logprobs
    up to 20) and vLLM for the extras (repetition_penalty > 0, min_p in [0, 1]). NaN fails
    every range check.
    """
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        require(-2.0 <= value <= 2.0, f"sampling.{name}: must be in [-2, 2], got {value}")
    rep = sampling.repetition_penalty
    require(0.0 < rep and math.isfinite(rep), f"sampling.repetition_penalty: must be > 0, got {rep}")
    require(0.0 <= sampling.min_p <= 1.0, f"sampling.min_p: must be in [0, 1], got {sampling.min_p}")
    bias = sampling.logit_bias
    require(len(bias) <= MAX_LOGIT_BIAS, f"sampling.logit_bias: {len(bias)} entries, limit is {MAX_LOGIT_BIAS}")
    for token_id, value in sorted(bias.items()):
        require(
            0 <= token_id < vocab_size,
            f"sampling.logit_bias: token id {token_id} is outside the vocabulary [0, {vocab_size})",
        )
        require(-100.0 <= value <= 100.0, f"sampling.logit_bias[{token_id}]: must be in [-100, 100], got {value}")
    top = sampling.top_logprobs
    require(0 <= top <= MAX_TOP_LOGPROBS, f"response.top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {top}")


@dataclass(slots=True, eq=False)  # identity: `list.remove` on the running list compared every field
class Request:
    """One generation request as the scheduler tracks it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions  # seed always set once the scheduler accepted the request
    stopping: StoppingOptions
    max_tokens: int  # effective limit: the client's, capped by the model length
    eos_token_ids: frozenset[int]
    # None: the request's text and stop strings are its front's (`scheduler_svc/front.py`),
    # and its events carry token ids only.
    detokenizer: Detokenizer | None
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    num_placeholders: int = 0
    # Known tokens (prompt + confirmed outputs) at the latest admission: what the prefill covers.
    num_prefill_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Hash chain of the confirmed full blocks (content only, so it survives preemption).
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Leading entries of `block_ids` already offered to the prefix cache in this admission.
    num_registered_blocks: int = 0
    # Identifies the current admission; 0 while not running. Results of steps planned under
    # another value are stale (planned before a preemption) and are discarded.
    admission_id: int = 0
    # While deferred behind the first sequence of its n > 1 request: that request's id.
    waits_for: str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache, first admission
    finish_reason: int = 0  # generate_pb2.FinishReason; UNSPECIFIED while not finished
    error: str = ""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Confirmed output tokens."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known (confirmed) tokens: prompt + outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_outputs(self) -> int:
        """Outputs confirmed or still in flight: the most the request may have after replies."""
        return len(self.output_token_ids) + self.num_placeholders

    @property
    def is_prefilling(self) -> bool:
        """Whether the current admission still has known tokens left to schedule."""
        return self.num_computed < self.num_prefill_tokens

    def all_token_ids(self) -> list[int]:
        """Prompt followed by the confirmed outputs."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """Known tokens at positions [start, stop), without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]
