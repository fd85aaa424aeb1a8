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
from zerobubble.worker_svc.sampler import sample, target_probs

# Keyed-noise stream for draft sampling under rejection sampling (independent of the verifier's
# streams 0-2); keyed acceptance draws drafts with the sampler's own stream instead.
DRAFT_STREAM = 3

# (j, fed tokens [N], KV positions [N], attention metadata) -> float32 logits [N, vocab]
ChainForward = Callable[[int, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ChainCache:
    """Where a proposer's chain writes: its rotary table's length, its scratch block, and how far
    its KV entry sits before the fed token's position (0 for a draft model; 1 for an EAGLE head,
    whose entry ``t`` holds token ``t + 1``)."""

    max_pos: int
    scratch_block: int
    kv_offset: int = 0


def draft_chain(
    runner: Any, slots: torch.Tensor, batch: Any, k: int, cache: ChainCache, forward: ChainForward, with_probs: bool
) -> torch.Tensor | None:
    """Draw ``k`` drafts for ``slots`` (the rows of ``batch`` that sampled) into the runner's
    state; returns the draft distributions ``[rows, k, vocab]`` when ``with_probs``."""
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
    qsl = torch.arange(num_rows + 1, dtype=torch.int32, device=dev)
    token = st.last_token[idx].to(torch.int64)
    drafts = torch.zeros(num_rows, k, dtype=torch.int32, device=dev)
    probs: torch.Tensor | None = None  # [rows, k, vocab], allocated at the first draw
    for j in range(k):
        pos = seq_len + j  # the fed token's position; it drafts position pos + 1
        if penalties is not None:
            # The fed token is an output token of the context of position pos + 1.
            fed = token[penalties.rows][:, None]
            if penalties.output_counts is not None:
                penalties.output_counts.scatter_add_(1, fed, torch.ones_like(fed, dtype=torch.int32))
            if penalties.seen is not None:
                penalties.seen.scatter_(1, fed, True)
        kv_pos = pos - cache.kv_offset
        # Past the rotary table a position would index out of range (on CUDA a device-side
        # assert that poisons the context): such entries go to the scratch block, clamped.
        fed_pos = kv_pos.clamp(max=cache.max_pos - 1)
        room = (kv_pos < caps) & (kv_pos < cache.max_pos)
        block = tables.gather(1, (fed_pos // bs).clamp(max=tables.shape[1] - 1)[:, None])[:, 0]
        slot_mapping = torch.where(
            room, block.to(torch.int64) * bs + fed_pos % bs, cache.scratch_block * bs + fed_pos % bs
        )
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=(fed_pos + 1).to(torch.int32),
            block_tables=tables,
            max_query_len=1,
            max_seq_len=tables.shape[1] * bs,
            slot_mapping=slot_mapping,
        )
        logits = forward(j, token, fed_pos, meta)
        t = dataclasses.replace(sampling, positions=pos + 1)
        if not with_probs:
            # The target's sampler on the proposer's logits: the same keyed noise at the same
            # position, so the draft is the target's own draw whenever the two agree.
            token = sample(logits, t)
        else:
            q = target_probs(logits, t)
            noise = keyed_uniform(t.seeds, t.positions, logits.shape[1], stream=DRAFT_STREAM)
            token = torch.argmax(torch.log(q) - torch.log(-torch.log(noise)), dim=-1)
            if probs is None:
                probs = torch.zeros(num_rows, k, q.shape[1], dtype=torch.float32, device=dev)
            probs[:, j] = q
        drafts[:, j] = token.to(torch.int32)
    st.drafts[idx, :k] = drafts
    # Draft j is offered only if every entry written up to it went to the real cache.
    num_real = caps.clamp(max=cache.max_pos) - seq_len + cache.kv_offset
    st.num_drafts[idx] = num_real.clamp(min=0, max=k).to(torch.int32)
    return probs
