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
  token at position ``seq_len``, each next one the draft just drawn. Draft ``j`` is drawn from the
  draft's processed distribution with keyed noise (position ``seq_len + 1 + j``), and that
  distribution is kept for rejection sampling. A position past the blocks the request holds
  (the scheduler allocates the k lookahead slots only when blocks are free) is written to a
  scratch block instead, and the drafts from there on are not offered (``num_drafts``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kernels.attention import AttentionMetadata
from kernels.keyed_random import keyed_uniform
from worker_svc import staging
from worker_svc.model import allocate_kv_cache
from worker_svc.sampler import SEED_MASK, SamplingTensors, target_probs

# Keyed-noise stream for draft sampling; 0-2 belong to the target's sampler and verifier.
DRAFT_STREAM = 3


class DraftModelProposer:
    """Runs a draft model beside the target over the runner's block tables."""

    has_draft_probs = True

    def __init__(self, draft, num_spec_tokens: int) -> None:
        self.draft = draft  # a worker_svc.model_loader.LoadedModel
        self.k = num_spec_tokens
        # The draft model writes its k-token chain into the KV slots past the step's tokens.
        self.num_lookahead_slots = num_spec_tokens
        self.runner: Any = None  # the ModelRunner (not imported: it imports the proposers)

    def bind(self, runner: Any) -> None:
        if self.draft.hf_config.vocab_size != runner.loaded.hf_config.vocab_size:
            raise ValueError(
                f"draft model vocab {self.draft.hf_config.vocab_size} differs from the "
                f"target's {runner.loaded.hf_config.vocab_size}: they must share a tokenizer"
            )
        self.runner = runner
        cfg = runner.config
        # One block more than the target: the scratch block that takes writes without room.
        self.scratch_block = cfg.num_blocks
        self.kv_caches = allocate_kv_cache(
            self.draft.hf_config, cfg.num_blocks + 1, cfg.block_size, self.draft.model.dtype, runner.device
        )
        num_slots = cfg.max_num_seqs
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
        params = [r.sampling for r in sampled]
        sampling = SamplingTensors.from_params(
            temperatures=[p.temperature for p in params],
            top_ks=[p.top_k for p in params],
            top_ps=[p.top_p if p.top_p > 0 else 1.0 for p in params],
            seeds=[p.seed & SEED_MASK for p in params],
            positions=seq_len,
            device=dev,
        )
        qsl = torch.arange(num_rows + 1, dtype=torch.int32, device=dev)
        max_seq_len = tables.shape[1] * bs
        token = st.last_token[idx].to(torch.int64)
        drafts = torch.zeros(num_rows, self.k, dtype=torch.int32, device=dev)
        probs = torch.zeros(num_rows, self.k, self.draft.hf_config.vocab_size, dtype=torch.float32, device=dev)
        for j in range(self.k):
            pos = seq_len + j  # the fed token's position; it drafts position pos + 1
            room = pos < caps
            block = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1)[:, None])[:, 0]
            slot_mapping = torch.where(room, block.to(torch.int64) * bs + pos % bs, self.scratch_block * bs + pos % bs)
            meta = AttentionMetadata(
                query_start_loc=qsl,
                seq_lens=(pos + 1).to(torch.int32),
                block_tables=tables,
                max_query_len=1,
                max_seq_len=max_seq_len,
                slot_mapping=slot_mapping,
            )
            hidden = self.draft.model(token, pos, meta, self.kv_caches)
            logits = self.draft.model.compute_logits(hidden)
            t = dataclasses.replace(sampling, positions=pos + 1)
            q = target_probs(logits, t)
            noise = keyed_uniform(t.seeds, t.positions, q.shape[-1], stream=DRAFT_STREAM)
            token = torch.argmax(torch.log(q) - torch.log(-torch.log(noise)), dim=-1)
            drafts[:, j] = token.to(torch.int32)
            probs[:, j] = q
        st.drafts[idx, : self.k] = drafts
        # Draft j is offered only if every position fed up to it was written to the real cache.
        st.num_drafts[idx] = (caps - seq_len).clamp(min=0, max=self.k).to(torch.int32)
        self.probs[idx] = probs

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        return self.probs[slots.long(), :k]
