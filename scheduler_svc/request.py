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

from scheduler_svc.block_pool import BlockHash
from scheduler_svc.detokenizer import Detokenizer


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


@dataclass(slots=True)
class Request:
    """One generation request as the scheduler tracks it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions  # seed always set once the scheduler accepted the request
    stopping: StoppingOptions
    max_tokens: int  # effective limit: the client's, capped by the model length
    eos_token_ids: frozenset[int]
    detokenizer: Detokenizer
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_text: str = ""
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
