"""Suffix decoding on the worker (`--spec-method suffix`).

The scheduler finds each request's continuation (`scheduler_svc/suffix.py`) from the tokens it
knows, a step late, and sends it in a plan with the sequence length it follows; the worker
keeps it as the request's *dynamic prediction* in `PredictionDrafts`, whose on-device
alignment keeps the part the tokens produced since still follow, and drafts by prompt lookup
where none does. So every row drafts through `PredictionDrafts` (`step.propose`), and this
proposer only names the method and its draft count; nothing here reads the device.
"""

from __future__ import annotations

from typing import Any

import torch


class SuffixProposer:
    """`--spec-method suffix`: drafts come from `PredictionDrafts`, which the runner builds
    with ``dynamic=True`` for it (see the module's docstring)."""

    method = "suffix"
    has_draft_probs = False
    num_lookahead_slots = 0

    def __init__(self, num_spec_tokens: int) -> None:
        self.k = num_spec_tokens
        self.runner: Any = None

    def bind(self, runner: object) -> None:
        self.runner = runner

    def admit(self, slot: int, num_cached_tokens: int) -> None:
        pass  # the slot's continuation starts empty (`PredictionDrafts.admit`)

    def observe(self, batch: object, hidden: torch.Tensor) -> None:
        pass

    def propose(self, slots: torch.Tensor, batch: object = None) -> None:
        pass  # every row of a suffix worker drafts from its dynamic prediction

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        raise NotImplementedError("suffix drafts have no distribution")
