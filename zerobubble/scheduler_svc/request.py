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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zerobubble.api import generate_pb2
from zerobubble.request_options import (
    CHAT_ROLES,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    InvalidRequest,
    SamplingOptions,
    StoppingOptions,
    require,
    shown,
    validate_token_ids,
)
from zerobubble.scheduler_svc.block_pool import BlockHash
from zerobubble.scheduler_svc.detokenizer import Detokenizer
from zerobubble.scheduler_svc.draft_length import PositionCounts

if TYPE_CHECKING:
    from zerobubble.api.worker_pb2 import WorkerInfo
    from zerobubble.scheduler_svc.suffix import SuffixState
    from zerobubble.scheduler_svc.tokenizer import Tokenizer


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


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
            require(m.role in CHAT_ROLES, f"messages[{i}].role: unknown role {shown(m.role)}")
        try:
            ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs])
        except Exception as exc:  # a template's raise_exception, e.g. bad role order
            raise InvalidRequest(f"messages: chat template rejected them: {exc}") from exc
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        require(len(ids) > 0, "token_ids: must not be empty")
        validate_token_ids(ids, "token_ids", info.vocab_size)
    else:
        raise InvalidRequest("input: one of prompt, messages or token_ids is required")
    require(len(ids) > 0, "input: tokenizes to no tokens")
    return ids


def prediction_ids(text: str, tokenizer: Tokenizer, info: WorkerInfo) -> list[int]:
    """A prediction's token ids: its text tokenized as output text is (no special tokens),
    cut at the model length, past which no output token can follow it."""
    require(
        len(text) <= MAX_PROMPT_CHARS,
        f"prediction: {len(text)} characters, limit is {MAX_PROMPT_CHARS}",
    )
    return tokenizer.encode(text)[: info.max_model_len]


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


@dataclass(slots=True)
class PredictionProgress:
    """How a request's predicted output fares: its drafts verified and accepted so far (OpenAI's
    ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``), and the draft slots its next
    decode may carry.

    The slots double while every prediction draft is accepted, fall back to one more than were
    accepted (at least a quarter of the limit) otherwise, and halve (to that quarter) after a
    decode the prediction gave no draft: a prediction the output follows gets long drafts, one
    it left shorter ones until the worker finds the output back in it (a wrong draft, or a
    slot no draft fills on an accelerator, where a plan's slots are kept, is computed for
    nothing). The quarter keeps an edit in the middle of a file from costing the steps of
    growing back from one slot: a 2-core CPU verifies 17 tokens of a row in about the time of
    one, and the scheduler cannot know how far the edit goes.
    """

    max_drafts: int
    limit: int  # the worker's `num_prediction_tokens`
    num_accepted: int = 0
    num_rejected: int = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One result row whose ``num_drafts`` verified drafts were the prediction's."""
        self.num_accepted += num_accepted
        self.num_rejected += num_drafts - num_accepted
        if num_accepted >= num_drafts:
            self.max_drafts = min(self.limit, 2 * self.max_drafts)
        else:
            self.max_drafts = max(self._floor, num_accepted + 1)

    def unaligned(self) -> None:
        """A decode with draft slots got no draft from the prediction."""
        self.max_drafts = max(self._floor, self.max_drafts // 2)

    @property
    def _floor(self) -> int:
        return max(1, self.limit // 4)


@dataclass(slots=True, eq=False)  # identity: `list.remove` on the running list compared every field
class Request:
    """One generation request as the scheduler tracks it.

    Its counters (computed, placeholders, pending outputs), block list and stop state are read
    and written for every request on every step of the planning loop, so they stay flat fields of
    one object rather than groups behind further attribute lookups (it holds more than 15)."""

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
    # Leading entries of `block_ids` given back because no later query can attend them (a
    # sliding-window model, `scheduler_svc/window.py`). Their ids stay in the list, so entry i
    # is still the block of positions [i * block_size, (i + 1) * block_size), as on the worker.
    num_freed_blocks: int = 0
    # Draft slots of this admission's decodes still in flight: how far their rejection may yet
    # move the real position back from the optimistic `num_computed`.
    num_inflight_drafts: int = 0
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
    prediction: PredictionProgress | None = None  # with a predicted output the worker drafts from
    suffix: SuffixState | None = None  # suffix decoding (`scheduler_svc/suffix.py`), from its first decode
    # Its drafts' recent acceptance by position (`scheduler_svc/draft_length.py`).
    draft_counts: PositionCounts = field(default_factory=PositionCounts)
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
