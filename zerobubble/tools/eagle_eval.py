"""Offline acceptance of a draft proposer along the target's own greedy answers.

A decode step is simulated from each accepted position ``p`` (the target has just sampled
``x[p+1]``): the proposer drafts ``k`` tokens, the longest prefix equal to the target's greedy
tokens is accepted, and the next step starts ``1 + accepted`` tokens later, as in serving. The
EAGLE chain feeds the head its own predicted hidden state after the first draft, as EAGLE does;
the n-gram proposer looks the suffix up in the sequence so far, as our prompt-lookup kernel does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zerobubble.tools.eagle_data import Sample
from zerobubble.worker_svc.eagle import EagleHead

# (sample, p, k) -> up to k drafted tokens for positions p+2 ...
DraftFn = Callable[[Sample, int, int], list[int]]


@dataclass(slots=True)
class Acceptance:
    """Counts over simulated steps: per draft position, how often it was accepted."""

    k: int
    steps: int = 0
    tokens: int = 0  # tokens produced: per step the accepted drafts and the target's own token
    accepted_at: list[int] = field(default_factory=list)  # [k]: steps whose draft i+1 was accepted

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.k

    def add(self, accepted: int, produced: int) -> None:
        self.steps += 1
        self.tokens += produced
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(1, self.steps)

    def rates(self) -> list[float]:
        """Fraction of steps whose draft at position i+1 was accepted (with all before it)."""
        return [n / max(1, self.steps) for n in self.accepted_at]


def simulate(samples: list[Sample], draft: DraftFn, k: int) -> Acceptance:
    """Walk every sample's answer step by step with ``draft``'s proposals; counts the acceptance."""
    result = Acceptance(k)
    for sample in samples:
        ids = sample.input_ids.tolist()
        p = sample.answer_start - 1  # the prefill step samples x[answer_start]
        while p + 2 < len(ids):
            limit = min(k, len(ids) - p - 2)
            drafts = draft(sample, p, limit)[:limit]
            accepted = 0
            for i, token in enumerate(drafts):
                if token != ids[p + 2 + i]:
                    break
                accepted += 1
            # The bonus token counts unless the answer ended with the last accepted draft.
            result.add(accepted, accepted + 1 if p + 2 + accepted < len(ids) else accepted)
            p += 1 + accepted
    return result


def ngram_drafter(min_n: int = 2, max_n: int = 4) -> DraftFn:
    """Prompt lookup: the longest suffix (``max_n`` down to ``min_n``) seen before, most recent match."""

    def draft(sample: Sample, p: int, k: int) -> list[int]:
        seq = sample.input_ids[: p + 2].tolist()
        for n in range(max_n, min_n - 1, -1):
            if len(seq) <= n:
                continue
            suffix = seq[-n:]
            for end in range(len(seq) - 1, n - 1, -1):  # `end` exclusive, the match's last index + 1
                if seq[end - n : end] == suffix:
                    return seq[end : end + k]
        return []

    return draft


class EagleDrafter:
    """The head's chain, teacher-forced over the real prefix and fed its own hidden states after.

    The head's rows over a sample's real tokens are computed once; a step from ``p`` reuses the
    cache of rows ``0..p`` and drafts one token at a time on top of it, the most likely among
    ``draft_ids`` when given, as the served head drafts.
    """

    def __init__(self, head: EagleHead, draft_ids: torch.Tensor | None = None) -> None:
        self.head = head
        self.draft_ids = draft_ids  # the served head's draft vocabulary (None: the whole one)
        self._key: int | None = None
        self._rows: torch.Tensor | None = None
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def _prepare(self, sample: Sample) -> None:
        if self._key == id(sample):
            return
        n = len(sample.input_ids) - 1
        ids = sample.input_ids[1 : n + 1].long()[None]
        self._rows, self._cache = self.head(ids, sample.hidden[:n][None])
        self._key = id(sample)

    @torch.no_grad()
    def __call__(self, sample: Sample, p: int, k: int) -> list[int]:
        self._prepare(sample)
        assert self._rows is not None and self._cache is not None
        hidden = self._rows[:, p : p + 1]  # predicted h[p+1] from (x[p+1], h[p])
        cache = (self._cache[0][:, :, : p + 1], self._cache[1][:, :, : p + 1])
        drafts: list[int] = []
        for i in range(k):
            logits = self.head.logits(hidden[0, -1])
            if self.draft_ids is None:
                token = int(logits.argmax())
            else:
                token = int(self.draft_ids[logits[self.draft_ids].argmax()])
            drafts.append(token)
            if i + 1 == k:
                break
            hidden, cache = self.head(torch.tensor([[token]]), hidden, start=p + 1 + i, cache=cache)
        return drafts
