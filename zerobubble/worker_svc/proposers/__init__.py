"""Draft proposers. A proposer runs on the worker's device right after sampling and fills the
runner's `drafts` / `num_drafts` state for the requests that just sampled."""

from __future__ import annotations

from typing import Protocol

import torch


class Proposer(Protocol):
    """What the runner needs from a proposer (n-gram lookup or a draft model)."""

    # True when proposals come with a draft distribution (rejection sampling verifies them);
    # False for proposals verified by keyed sample-and-compare (n-gram; draft models by default).
    has_draft_probs: bool
    # `--spec-method` it implements ("ngram", "suffix", "draft" or "eagle"), reported in `WorkerInfo.spec_method`.
    method: str
    # KV slots the proposer writes past a step's tokens; the scheduler must allocate them
    # (reported to it in `WorkerInfo.num_lookahead_slots`).
    num_lookahead_slots: int

    def bind(self, runner: object) -> None:
        """Attach to the runner whose device state the proposer reads and writes."""

    def admit(self, slot: int, num_cached_tokens: int) -> None:
        """A request (new or resumed) takes `slot`."""

    def observe(self, batch: object, hidden: torch.Tensor) -> None:
        """See every step's target inputs (`StepBatch`) and the target's final hidden states
        ``[T, hidden]`` right after the target forward."""

    def propose(self, slots: torch.Tensor, batch: object) -> None:
        """Write drafts for `slots` (the rows of `batch` that sampled) into the runner state."""

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        """[len(slots), k, vocab] draft distributions of the current drafts."""


def build_proposer(
    method: str,
    num_spec_tokens: int,
    ngram_min: int = 2,
    ngram_max: int = 4,
    draft_model: object | None = None,
    draft_acceptance: str = "keyed",
) -> Proposer | None:
    """The proposer for `--spec-method` (None for `none` or k = 0)."""
    if method == "none" or num_spec_tokens <= 0:
        return None
    if method == "ngram":
        from zerobubble.worker_svc.proposers.ngram import NgramProposer

        return NgramProposer(num_spec_tokens, ngram_min, ngram_max)
    if method == "suffix":
        from zerobubble.worker_svc.proposers.suffix import SuffixProposer

        return SuffixProposer(num_spec_tokens)
    if method == "draft":
        from zerobubble.worker_svc.proposers.draft import DraftModelProposer

        if draft_model is None:
            raise ValueError("--spec-method draft needs --draft-model")
        return DraftModelProposer(draft_model, num_spec_tokens, draft_acceptance)
    if method == "eagle":
        from zerobubble.worker_svc.proposers.eagle import EagleProposer

        if draft_model is None:
            raise ValueError("--spec-method eagle needs --draft-model (an EAGLE head)")
        return EagleProposer(draft_model, num_spec_tokens, draft_acceptance)  # type: ignore[arg-type]
    raise ValueError(f"unknown --spec-method {method!r} (expected none, ngram, suffix, draft or eagle)")
