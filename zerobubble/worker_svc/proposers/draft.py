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
- `propose`, for the rows that sampled: k single-token forwards of the draft model through the
  shared chain (`zerobubble.worker_svc.proposers.chain`): the first feeds the new last token at
  position ``seq_len``, each next one the draft just drawn, with the request's own sampling
  controls; positions past the request's blocks go to a scratch block and are not offered.

Two ways to verify (`--draft-acceptance`, the same for an EAGLE head):

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

from typing import Any

import torch

from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.worker_svc.model import allocate_kv_cache
from zerobubble.worker_svc.proposers.chain import ChainCache, draft_chain

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
        max_pos = self.draft.model.rope.num_positions
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

    def observe(self, batch, hidden: torch.Tensor) -> None:
        """Run the draft on the target step's own inputs (writes its K/V at the same slots)."""
        self.draft.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)

    def propose(self, slots: torch.Tensor, batch) -> None:
        def forward(j: int, token: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            return self.draft.model.compute_logits(self.draft.model(token, pos, meta, self.kv_caches))

        # The draft covers every position the target computes (`bind`); its chain near the end
        # of the model length runs past the table and stops offering drafts there.
        cache = ChainCache(self.draft.model.rope.num_positions, self.scratch_block)
        probs = draft_chain(self.runner, slots, batch, self.k, cache, forward, self.has_draft_probs)
        if probs is not None:
            self.probs[slots.long()] = probs

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        return self.probs[slots.long(), :k]
