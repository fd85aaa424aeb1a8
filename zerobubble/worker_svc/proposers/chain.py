"""The k-token draft chain shared by the model-backed proposers (a draft model, an EAGLE head).

A chain drafts for the rows that just sampled: step ``j`` feeds each row one token (its new last
token, then the draft just drawn) and draws draft ``j + 1`` for position ``seq_len + j + 1`` from
the logits the proposer's forward returns. Each draft is drawn with the request's own sampling
controls (logit bias, penalties whose counts include the drafts before it, temperature,
top-k/p, min-p), so the chain proposes what the target would sample if it were the target.

Every shape is known to the host and nothing is read back, so a chain never waits for the device.
A KV position past the blocks a request holds (the scheduler allocates the lookahead slots only
when blocks are free) or past the proposer's rotary table is written to the proposer's scratch
block instead, and the drafts from there on are not offered (``num_drafts``).

Two ways to verify (see `zerobubble.worker_svc.proposers.draft`): ``keyed`` draws each draft by
Gumbel-max with the same keyed noise the target's sampler uses at that position (accepted iff
equal to the target's own keyed sample); ``rejection`` keeps the draft distributions q for
rejection sampling and draws from them with a stream of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.kernels.keyed_random import keyed_uniform
from zerobubble.worker_svc import staging
from zerobubble.worker_svc.sampler import Penalties, SamplingTensors, sample, target_probs

# Keyed-noise stream for draft sampling under rejection sampling (independent of the verifier's
# streams 0-2); keyed acceptance draws drafts with the sampler's own stream instead.
DRAFT_STREAM = 3

# (j, fed tokens [N], KV positions [N], attention metadata) -> float32 logits [N, vocab], or
# [N, len(draft_ids)] when the chain is given a draft vocabulary
ChainForward = Callable[[int, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ChainCache:
    """Where a proposer's chain writes: its rotary table's length, its scratch block, and how far
    its KV entry sits before the fed token's position (0 for a draft model; 1 for an EAGLE head,
    whose entry ``t`` holds token ``t + 1``)."""

    max_pos: int
    scratch_block: int
    kv_offset: int = 0


def over_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits ``[N, len(ids)]`` over the token ids ``ids`` as ``[N, vocab_size]``, -inf elsewhere
    (a sampler then never draws an id outside ``ids``)."""
    full = torch.full((logits.shape[0], vocab_size), float("-inf"), dtype=logits.dtype, device=logits.device)
    return full.index_copy_(1, ids, logits)


def draft_chain(
    runner: Any,
    slots: torch.Tensor,
    batch: Any,
    k: int,
    cache: ChainCache,
    forward: ChainForward,
    with_probs: bool,
    draft_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Draw ``k`` drafts for ``slots`` (the rows of ``batch`` that sampled) into the runner's
    state; returns the draft distributions ``[rows, k, vocab]`` when ``with_probs``.

    ``draft_ids``: ``forward`` returns logits over these target ids only (a draft vocabulary).
    When sampling is the logits' plain argmax the drafts are taken among them; other controls
    see the whole vocabulary with -inf outside them.
    """
    st, dev, bs = runner.state, runner.device, runner.config.block_size
    idx = slots.long()
    sampled = [batch.rows[i] for i in batch.sampled.rows]
    num_rows = len(sampled)
    # Slots the request holds; host bookkeeping, uploaded like every other step input.
    caps = staging.to_device([len(r.block_ids) * bs for r in sampled], torch.int64, dev)
    seq_len = st.seq_len[idx].to(torch.int64)
    tables = st.block_table[idx]
    # The target's own per-row sampling tensors, with penalty counts over the written context
    # (positions < seq_len); the fed tokens are added to them as the chain grows.
    slot_ids = np.asarray([r.slot for r in sampled], np.int64)
    sampling = runner.sampling_tensors(slot_ids, np.ones(num_rows, np.int64), seq_len)
    penalties = sampling.penalties
    vocab_size = runner.model.spec.vocab_size
    qsl = torch.arange(num_rows + 1, dtype=torch.int32, device=dev)
    token = st.last_token[idx].to(torch.int64)
    drafts = torch.zeros(num_rows, k, dtype=torch.int32, device=dev)
    probs: torch.Tensor | None = None  # [rows, k, vocab], allocated at the first draw
    fed_pos, slot_mapping = _chain_slots(seq_len, caps, tables, k, cache, bs)
    for j in range(k):
        if penalties is not None:
            _count_fed(penalties, token)
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=(fed_pos[j] + 1).to(torch.int32),
            block_tables=tables,
            max_query_len=1,
            max_seq_len=tables.shape[1] * bs,
            slot_mapping=slot_mapping[j],
        )
        logits = forward(j, token, fed_pos[j], meta)
        sampling_j = dataclasses.replace(sampling, positions=seq_len + j + 1)
        token, q = _next_draft(logits, sampling_j, with_probs, draft_ids, vocab_size)
        if q is not None:
            if probs is None:
                probs = torch.zeros(num_rows, k, q.shape[1], dtype=torch.float32, device=dev)
            probs[:, j] = q
        drafts[:, j] = token.to(torch.int32)
    st.drafts[idx, :k] = drafts
    # Draft j is offered only if every entry written up to it went to the real cache.
    num_real = caps.clamp(max=cache.max_pos) - seq_len + cache.kv_offset
    st.num_drafts[idx] = num_real.clamp(min=0, max=k).to(torch.int32)
    return probs


def _count_fed(penalties: Penalties, token: torch.Tensor) -> None:
    """Add each row's fed token to its penalty counts: it is an output token of the context of
    the position it feeds (seq_len + j + 1 at chain step j)."""
    fed = token[penalties.rows][:, None]
    if penalties.output_counts is not None:
        penalties.output_counts.scatter_add_(1, fed, torch.ones_like(fed, dtype=torch.int32))
    if penalties.seen is not None:
        penalties.seen.scatter_(1, fed, True)


def _next_draft(
    logits: torch.Tensor,
    sampling: SamplingTensors,
    with_probs: bool,
    draft_ids: torch.Tensor | None,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chain step's draft per row from the proposer's logits (over ``draft_ids`` when
    given), and the distribution drawn from when ``with_probs``."""
    if draft_ids is not None and sampling.is_raw_argmax and not with_probs:
        # Among the ids alone: spreading the logits over the whole vocabulary first costs
        # more than the argmax. Ties go to the first of the ids: the lowest, as the spread's
        # argmax would pick, when they are sorted (as `draft_vocab` writes them).
        return draft_ids[logits.argmax(dim=-1)], None
    if draft_ids is not None:
        logits = over_vocab(logits, draft_ids, vocab_size)
    return _draw(logits, sampling, with_probs)


def _chain_slots(
    seq_len: torch.Tensor, caps: torch.Tensor, tables: torch.Tensor, k: int, cache: ChainCache, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chain step ``j`` (dim 0) and row: the KV entry's position and its cache slot, for
    the fed token at position ``seq_len + j``; computed for every step at once, so each step
    only takes its row."""
    kv_pos = seq_len[None, :] + torch.arange(k, device=seq_len.device)[:, None] - cache.kv_offset
    # Past the rotary table a position would index out of range (on CUDA a device-side
    # assert that poisons the context): such entries go to the scratch block, clamped.
    fed_pos = kv_pos.clamp(max=cache.max_pos - 1)
    room = (kv_pos < caps[None, :]) & (kv_pos < cache.max_pos)
    block_index = (fed_pos // block_size).clamp(max=tables.shape[1] - 1)
    block = tables.gather(1, block_index.t()).t().to(torch.int64)
    offset = fed_pos % block_size
    slot_mapping = torch.where(room, block * block_size + offset, cache.scratch_block * block_size + offset)
    return fed_pos, slot_mapping


def _draw(logits: torch.Tensor, t: SamplingTensors, with_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row from ``logits [rows, vocab]`` with the request's controls ``t``, and
    the distribution drawn from when ``with_probs``."""
    if not with_probs:
        # The target's sampler on the proposer's logits: the same keyed noise at the same
        # position, so the draft is the target's own draw whenever the two agree.
        return sample(logits, t), None
    q = target_probs(logits, t)
    noise = keyed_uniform(t.seeds, t.positions, logits.shape[1], stream=DRAFT_STREAM)
    return torch.argmax(torch.log(q) - torch.log(-torch.log(noise)), dim=-1), q
