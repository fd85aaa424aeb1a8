"""Prompt-lookup (n-gram) proposer, computed on the device for the whole batch at once.

It reads each request's token history from the pages that follow its KV block table, so its
memory grows with tokens actually held rather than with max_num_seqs x max_model_len.
"""

from __future__ import annotations

from typing import Any

import torch

from zerobubble.kernels.ngram import ngram_propose


class NgramProposer:
    """Proposes the tokens that followed the most recent earlier occurrence of the suffix."""

    method = "ngram"
    has_draft_probs = False

    def __init__(self, num_spec_tokens: int, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= --ngram-min ({ngram_min}) <= --ngram-max ({ngram_max})")
        self.k = num_spec_tokens
        self.num_lookahead_slots = 0  # proposals are read from history; nothing is written
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.runner: Any = None  # the ModelRunner, set by bind (it imports us)

    def bind(self, runner) -> None:
        self.runner = runner

    def admit(self, slot: int, num_cached_tokens: int) -> None:
        pass  # all state lives in the runner's history pages

    def observe(self, batch: object, hidden: torch.Tensor) -> None:
        pass  # the history pages are written by input assembly

    def propose(self, slots: torch.Tensor, batch: object = None) -> None:
        st = self.runner.state
        drafts, num = ngram_propose(
            slots,
            st.seq_len,
            st.last_token,
            st.block_table,
            st.history,
            self.runner.config.block_size,
            self.ngram_min,
            self.ngram_max,
            self.k,
            self.runner.kernels,
        )
        idx = slots.long()
        st.drafts[idx, : self.k] = drafts
        st.num_drafts[idx] = num

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        raise NotImplementedError("n-gram drafts have no distribution")
