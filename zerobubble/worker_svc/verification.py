"""Sampling and verification: the tokens of a step's sampled rows from their logits.

A decode row feeds its last token and the drafts proposed after it; every fed slot is sampled,
and the drafts are accepted up to the first mismatch (greedy and keyed sampling), or by
rejection sampling against the draft model's distribution when the proposer has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerobubble.kernels.verify import count_accepted, rejection_sample
from zerobubble.worker_svc.batch import StepBatch
from zerobubble.worker_svc.grammar import StepMasks
from zerobubble.worker_svc.proposers import Proposer
from zerobubble.worker_svc.sampler import sample, target_probs, token_logprobs, top_logprobs
from zerobubble.worker_svc.slot_table import DeviceState


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """What sampling and verification produced for the sampled rows (still on the device)."""

    tokens: torch.Tensor  # [S, width] sampled tokens; the first num_accepted+1 are emitted
    num_accepted: torch.Tensor  # [S] accepted drafts
    num_verified: torch.Tensor  # [S] drafts actually verified (real drafts fed)
    logprobs: torch.Tensor | None  # [S, width]
    top_ids: torch.Tensor | None = None  # [S, width, N] when a row wants top-N logprobs
    top_logprobs: torch.Tensor | None = None  # [S, width, N]
    prediction_drafts: torch.Tensor | None = None  # [S] bool: the row's drafts were its prediction's


def fed_drafts(batch: StepBatch, state: DeviceState) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts fed to the sampled rows (``[S, width - 1]``) and how many of them are real (``[S]``).

    Drafts are the inputs after the first slot of each decode row; only the ones the
    proposer really produced count (the rest were filler and must be rejected).
    """
    s = batch.sampled
    assert s is not None
    num_verified = torch.minimum(state.num_drafts[s.slots.long()], s.layout.num_cols - 1)
    if s.layout.width == 1:
        return batch.input_ids.new_zeros((len(s.rows), 0)), num_verified
    col = torch.arange(s.layout.width - 1, device=batch.input_ids.device)
    draft_idx = (s.layout.row_start[:, None] + 1 + col[None, :]).clamp(max=batch.num_tokens - 1)
    return batch.input_ids[draft_idx], num_verified


def sample_and_verify(
    batch: StepBatch,
    logits: torch.Tensor,
    state: DeviceState,
    proposer: Proposer | None,
    num_proposed: int,
    masks: StepMasks | None = None,
    prediction_drafts: torch.Tensor | None = None,
) -> StepOutputs:
    """Sample every real slot of the sampled rows, verify their drafts, and compute the
    logprobs asked for (``logits``: ``[G, vocab]``, one row per real slot). ``masks``: the
    grammar's allowed tokens for the constrained rows, and their drafts cut where it forbids
    one; log-probabilities stay those of the model. ``num_proposed``: the proposer's drafts per
    row; ``prediction_drafts``: ``[S]`` bool, rows fed their prediction's drafts instead."""
    s = batch.sampled
    assert s is not None
    width = s.layout.width
    draft_tokens, num_verified = fed_drafts(batch, state)
    raw_logits = logits
    if masks is not None:
        # Log-probs are the model's: mask a copy when a row reports them.
        logits, num_verified = masks.apply(logits, num_verified, in_place=not (s.want_logprobs or s.num_top))
    if proposer is not None and proposer.has_draft_probs:
        probs = s.spread(target_probs(logits, s.sampling))
        q = proposer.draft_probs(s.slots, min(num_proposed, width - 1))
        if prediction_drafts is not None or q.shape[1] < width - 1:
            q = _with_point_drafts(q, draft_tokens, prediction_drafts)
        out_tokens, num_accepted = rejection_sample(
            probs,
            q,
            draft_tokens,
            num_verified,
            s.spread(s.sampling.seeds)[:, 0],
            s.spread(s.positions)[:, 0],
        )
    else:
        out_tokens = s.spread(sample(logits, s.sampling))
        num_accepted = (
            count_accepted(out_tokens, draft_tokens, num_verified)
            if width > 1
            else torch.zeros(len(s.rows), dtype=torch.int32, device=batch.input_ids.device)
        )
    lp = None
    if s.want_logprobs:
        # Rejection sampling leaves -1 after the emitted token; those columns are never
        # returned, but gathering at -1 would fail the whole step.
        tokens = out_tokens.reshape(-1)
        if s.layout.logprob_index is not None:
            tokens = tokens[s.layout.logprob_index]
        lp = s.spread(token_logprobs(raw_logits, tokens.long().clamp(min=0)))
    top_ids = top_lps = None
    if s.num_top:
        # Column c holds the distribution the token at column c was drawn from.
        top_ids, top_lps = (s.spread(t) for t in top_logprobs(raw_logits, max(s.num_top)))
    return StepOutputs(out_tokens, num_accepted, num_verified, lp, top_ids, top_lps, prediction_drafts)


def _with_point_drafts(
    q: torch.Tensor, draft_tokens: torch.Tensor, prediction_drafts: torch.Tensor | None
) -> torch.Tensor:
    """Draft distributions ``[S, width - 1, vocab]`` for rejection sampling where some drafts
    are not the proposer's: a prediction's draft (and any column past the proposer's) is a
    certain token, a point mass, which rejection sampling accepts with the target's
    probability of it and otherwise resamples from the rest of the target's distribution."""
    point = torch.nn.functional.one_hot(draft_tokens.long().clamp(min=0), q.shape[-1]).to(q.dtype)
    k = q.shape[1]
    if prediction_drafts is not None:
        q = torch.where(prediction_drafts[:, None, None], point[:, :k], q)
    return torch.cat([q, point[:, k:]], dim=1)
