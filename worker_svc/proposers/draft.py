"""Draft-model proposer: a smaller model with the same tokenizer proposes k tokens per request.

The draft model keeps its own paged KV cache, indexed by the SAME block tables as the target (the
scheduler's blocks cover both), so no second allocator exists.

Every shape is known to the host and nothing is read back, so proposing never waits for the
device (and is fit for CUDA graphs):

- `observe`: the draft runs on exactly the inputs of every target step (prefill chunks, decode
  rows with their drafts) and writes its K/V at the same slots. So the draft cache holds a
  position whenever the target cache does, computed from the same tokens; a rejected draft's
  entry is overwritten when the target re-feeds that position, as in the target cache. (Blocks
  shared through the prefix cache therefore carry draft K/V too.)
- `propose`, for the rows that sampled: k single-token forwards. The first feeds the new last
  token at position ``seq_len``, each next one the draft just drawn. Draft ``j`` (position
  ``seq_len + 1 + j``) is drawn from the draft's logits processed with the request's own sampling
  controls (logit bias, penalties whose counts include drafts ``0..j-1``, temperature, top-k/p,
  min-p), so the draft proposes what the target would sample if it were the target. A position
  past the blocks the request holds (the scheduler allocates the k lookahead slots only when
  blocks are free) is written to a scratch block instead, and the drafts from there on are not
  offered (``num_drafts``).

Two ways to verify (`--draft-acceptance`):

- ``keyed`` (the default): the draft is drawn by Gumbel-max with the SAME keyed noise the target's
  sampler uses at that position, and the verifier accepts it iff it equals the target's own
  keyed sample there (as for n-gram drafts). Every emitted token is then the token `sample`
  draws without speculation, so seeded output does not depend on the drafter, on where
  verification rows start, sync or async, or the batch. Lossless; a draft is accepted with the
  probability that both Gumbel-max draws agree, at least ``(1 - d) / (1 + d)`` for total
  variation distance ``d`` between the two processed distributions (1 when they are equal).
- ``rejection`` (DESIGN.md's original method): standard rejection sampling against the
  kept distribution q (accept with ``min(1, p/q)``, resample from the residual): acceptance
  ``1 - d``, the most any scheme gets,
  but the emitted token at a draft position depends on q and on the residual draw, so seeded
  output differs from the unspeculated one and between runs whose verification rows start at
  other positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.kernels.keyed_random import keyed_uniform
from zerobubble.worker_svc import staging
from zerobubble.worker_svc.model import allocate_kv_cache
from zerobubble.worker_svc.sampler import sample, target_probs

# Keyed-noise stream for draft sampling under rejection sampling (independent of the verifier's
# streams 0-2); keyed acceptance draws drafts with the sampler's own stream instead.
DRAFT_STREAM = 3
ACCEPTANCE_METHODS = ("keyed", "rejection")


class DraftModelProposer:
    """Runs a draft model beside the target over the runner's block tables."""

    method = "draft"

    def __init__(self, draft, num_spec_tokens: int, acceptance: str = "keyed") -> None:
        if acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"unknown draft acceptance {acceptance!r} (expected keyed or rejection)")
        self.draft = draft  # a zerobubble.worker_svc.model_loader.LoadedModel
        self.k = num_spec_tokens
        # Rejection sampling needs the draft distributions; keyed verification needs nothing.
        self.has_draft_probs = acceptance == "rejection"
        # The draft model writes its k-token chain into the KV slots past the step's tokens.
        self.num_lookahead_slots = num_spec_tokens
        self.runner: Any = None  # the ModelRunner (not imported: it imports the proposers)

    def bind(self, runner: Any) -> None:
        if self.draft.hf_config.vocab_size != runner.loaded.hf_config.vocab_size:
            raise ValueError(
                f"draft model vocab {self.draft.hf_config.vocab_size} differs from the "
                f"target's {runner.loaded.hf_config.vocab_size}: they must share a tokenizer"
            )
        cfg = runner.config
        max_pos = self.draft.model.rope_cos.shape[0]
        if max_pos < cfg.max_model_len:
            # It runs on every position the target computes (`observe`): past its rotary
            # table it could not (an out-of-range index; on CUDA a device-side assert).
            raise ValueError(
                f"the draft model covers {max_pos} positions, fewer than max_model_len {cfg.max_model_len}: "
                "lower --max-model-len or use a draft model with a longer context"
            )
        self.runner = runner
        # The draft's forwards stop where the target's would: once a later plan has finished
        # every row they serve (`ModelRunner._moot`).
        self.draft.model.interrupt = runner.model.interrupt
        # One block more than the target: the scratch block that takes writes without room.
        self.scratch_block = cfg.num_blocks
        self.kv_caches = allocate_kv_cache(
            self.draft.hf_config, cfg.num_blocks + 1, cfg.block_size, self.draft.model.dtype, runner.device
        )
        num_slots = cfg.max_num_seqs if self.has_draft_probs else 0
        self.probs = torch.zeros(
            num_slots, self.k, self.draft.hf_config.vocab_size, dtype=torch.float32, device=runner.device
        )

    def admit(self, slot: int, num_cached_tokens: int) -> None:
        pass  # the draft cache follows the target cache block for block (see `observe`)

    def observe(self, batch) -> None:
        """Run the draft on the target step's own inputs (writes its K/V at the same slots)."""
        self.draft.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)

    def propose(self, slots: torch.Tensor, batch) -> None:
        runner = self.runner
        st = runner.state
        dev = runner.device
        bs = runner.config.block_size
        idx = slots.long()
        sampled = [batch.rows[i] for i in batch.sampled.rows]
        num_rows = len(sampled)
        # Slots the request holds; host bookkeeping, uploaded like every other step input.
        caps = staging.to_device([len(r.block_ids) * bs for r in sampled], torch.int64, dev)
        seq_len = st.seq_len[idx].to(torch.int64)
        tables = st.block_table[idx]
        # The target's own per-row sampling tensors, with penalty counts over the written
        # context (positions < seq_len); the fed tokens are added to them as the chain grows.
        slot_ids = np.asarray([r.slot for r in sampled], np.int64)
        sampling = runner.sampling_tensors(slot_ids, np.ones(num_rows, np.int64), seq_len)
        penalties = sampling.penalties
        vocab_size = self.draft.hf_config.vocab_size
        qsl = torch.arange(num_rows + 1, dtype=torch.int32, device=dev)
        max_seq_len = tables.shape[1] * bs
        # Positions the draft's rotary table covers (at least the model length, see `bind`).
        # The chain of a request near the end of the model length runs past it: indexing the
        # table there would be out of range, a device-side assert that poisons a CUDA context.
        # Such positions feed the draft a clamped position and write to the scratch block, and
        # their drafts are never offered (num_drafts below).
        max_pos = self.draft.model.rope_cos.shape[0]
        token = st.last_token[idx].to(torch.int64)
        drafts = torch.zeros(num_rows, self.k, dtype=torch.int32, device=dev)
        probs = (
            torch.zeros(num_rows, self.k, vocab_size, dtype=torch.float32, device=dev) if self.has_draft_probs else None
        )
        for j in range(self.k):
            pos = seq_len + j  # the fed token's position; it drafts position pos + 1
            fed_pos = pos.clamp(max=max_pos - 1)
            if penalties is not None:
                # The fed token is an output token of the context of position pos + 1.
                fed = token[penalties.rows][:, None]
                if penalties.output_counts is not None:
                    penalties.output_counts.scatter_add_(1, fed, torch.ones_like(fed, dtype=torch.int32))
                if penalties.seen is not None:
                    penalties.seen.scatter_(1, fed, True)
            room = (pos < caps) & (pos < max_pos)
            block = tables.gather(1, (fed_pos // bs).clamp(max=tables.shape[1] - 1)[:, None])[:, 0]
            slot_mapping = torch.where(
                room, block.to(torch.int64) * bs + fed_pos % bs, self.scratch_block * bs + fed_pos % bs
            )
            meta = AttentionMetadata(
                query_start_loc=qsl,
                seq_lens=(fed_pos + 1).to(torch.int32),
                block_tables=tables,
                max_query_len=1,
                max_seq_len=max_seq_len,
                slot_mapping=slot_mapping,
            )
            hidden = self.draft.model(token, fed_pos, meta, self.kv_caches)
            logits = self.draft.model.compute_logits(hidden)
            t = dataclasses.replace(sampling, positions=pos + 1)
            if probs is None:
                # The target's sampler on the draft's logits: the same keyed noise at the same
                # position, so the draft is the target's own draw whenever the two agree.
                token = sample(logits, t)
            else:
                q = target_probs(logits, t)
                noise = keyed_uniform(t.seeds, t.positions, vocab_size, stream=DRAFT_STREAM)
                token = torch.argmax(torch.log(q) - torch.log(-torch.log(noise)), dim=-1)
                probs[:, j] = q
            drafts[:, j] = token.to(torch.int32)
        st.drafts[idx, : self.k] = drafts
        # Draft j is offered only if every position fed up to it was written to the real cache.
        st.num_drafts[idx] = (caps.clamp(max=max_pos) - seq_len).clamp(min=0, max=self.k).to(torch.int32)
        if probs is not None:
            self.probs[idx] = probs

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        return self.probs[slots.long(), :k]
