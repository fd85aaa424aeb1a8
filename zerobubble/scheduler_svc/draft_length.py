"""Adaptive draft length: how many draft slots each decode row of a plan gets
(`--spec-draft-length adaptive`).

Two estimates feed the choice, both from what the scheduler already receives:

- per request and draft position j, ``p_j`` = P(draft j accepted | drafts before it accepted),
  from the request's own recent results (decayed per result, so recent steps weigh more) on a
  Beta prior whose mean is the worker-wide estimate for that position (itself decayed per plan,
  on a prior of ``prior_acceptance`` at position 0 and the previous position's estimate beyond);
- the step's cost, time ≈ a + b·tokens, an online least-squares fit of the results'
  ``forward_s`` against the tokens fed (decayed), shrunk towards a prior in which a step's fixed
  cost equals ``prior_fixed_tokens`` tokens until the tokens vary enough to tell.

With k drafts a row expects ``sum_{j<k} prod_{i<=j} p_i`` accepted tokens, so its slot j adds
``prod_{i<=j} p_i``, which never grows with j. Every row starts at 0 slots; the slot that adds
the most is taken while it raises the plan's expected tokens per second ((E+Δ)/(t+b) > E/t,
i.e. Δ·t > E·b) and adds at least ``min_gain``. Since each row's gains only fall, taking the
largest first and stopping at the first that does not pay is the best set for that ratio.

A slot the proposer left without a draft (no n-gram match; or none made, as a worker skips its
proposer after a plan that gave no decode row a slot) says nothing about acceptance and is not
counted.
A request that stopped getting slots receives no results to learn from, so its counts also
decay on each plan it decodes without drafts: its estimate drifts back to the worker's and it is
probed again now and then. Only the number of slots is chosen here; verification is untouched,
so outputs never depend on the choice.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

ADAPTIVE = "adaptive"
FIXED = "fixed"
CHOICES = (ADAPTIVE, FIXED)


@dataclass(frozen=True, slots=True)
class DraftLengthParams:
    """The chooser's constants (defaults set by hand, checked by tests/unit/test_draft_length.py
    and on the simulated device; not yet benchmarked on a model)."""

    # Beta prior strength, in results, of the worker-wide estimate behind each request's.
    prior_strength: float = 2.0
    # The worker-wide estimate's own prior (position 0) and its strength.
    prior_acceptance: float = 0.5
    worker_prior_strength: float = 2.0
    request_decay: float = 0.85  # per result of the request: about the last 7 weigh
    # Per plan, whatever it drafts: about the last 50 plans weigh, and a worker whose drafts all
    # failed a while (so none are planned) drifts back to its prior and probes again.
    worker_decay: float = 0.98
    idle_decay: float = 0.8  # per plan a request decodes without drafts: probes again after ~5
    # Expected tokens a slot must add: what the linear cost model does not see (the proposer's
    # work, the rollback, the scheduler's) makes hopeless drafts a loss even on a free slot.
    min_gain: float = 0.05
    cost_decay: float = 0.98  # per step result: about the last 50 steps weigh
    prior_fixed_tokens: float = 32.0  # the cost prior: a step's fixed cost = this many tokens


@dataclass(slots=True)
class PositionCounts:
    """Decayed tries and acceptances of drafts by position (position j is tried when the
    drafts before it were accepted and a slot j was scheduled)."""

    num_tries: list[float] = field(default_factory=list)
    num_accepted: list[float] = field(default_factory=list)

    def decay(self, factor: float) -> None:
        self.num_tries = [n * factor for n in self.num_tries]
        self.num_accepted = [n * factor for n in self.num_accepted]

    def add(self, num_slots: int, num_accepted: int, num_offered: int | None = None) -> None:
        """One result: ``num_slots`` slots scheduled, ``num_offered`` of them with a draft (None:
        all), the first ``num_accepted`` accepted. A position the proposer left empty after
        accepted drafts says nothing about acceptance."""
        offered = num_slots if num_offered is None else min(num_offered, num_slots)
        num_tried = min(offered, num_accepted + 1)
        if len(self.num_tries) < num_tried:
            grow = num_tried - len(self.num_tries)
            self.num_tries.extend([0.0] * grow)
            self.num_accepted.extend([0.0] * grow)
        for j in range(num_tried):
            self.num_tries[j] += 1.0
            if j < num_accepted:
                self.num_accepted[j] += 1.0

    def rate(self, j: int, prior: float, strength: float) -> float:
        """The Beta-posterior mean at position ``j`` for a prior mean ``prior``."""
        tries = self.num_tries[j] if j < len(self.num_tries) else 0.0
        accepted = self.num_accepted[j] if j < len(self.num_accepted) else 0.0
        return (accepted + strength * prior) / (tries + strength)


@dataclass(slots=True)
class StepCostModel:
    """time ≈ a + b·tokens of one worker's steps: a decayed least-squares fit whose slope is
    shrunk towards ``mean time / (mean tokens + prior_fixed_tokens)``."""

    decay: float
    prior_fixed_tokens: float
    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step's result (steps that fed nothing or were not timed are skipped)."""
        if num_tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        d, x = self.decay, float(num_tokens)
        self.weight = self.weight * d + 1.0
        self.sum_x = self.sum_x * d + x
        self.sum_y = self.sum_y * d + seconds
        self.sum_xx = self.sum_xx * d + x * x
        self.sum_xy = self.sum_xy * d + x * seconds

    def fit(self) -> tuple[float, float]:
        """(a, b): fixed seconds per step and seconds per token (relative units before any step)."""
        if self.weight <= 0:
            return self.prior_fixed_tokens, 1.0
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        var_x = max(self.sum_xx - self.weight * mean_x * mean_x, 0.0)
        cov_xy = self.sum_xy - self.weight * mean_x * mean_y
        prior_b = mean_y / (mean_x + self.prior_fixed_tokens)
        # The prior weighs as one step whose tokens differ from the mean by the mean itself:
        # it yields once the batch has varied about that much.
        shrink = (1.0 + mean_x) ** 2
        b = max((cov_xy + shrink * prior_b) / (var_x + shrink), 0.0)
        # A fixed cost below a tenth of the mean step would be a fit artefact (noise, few points).
        a = max(mean_y - b * mean_x, 0.1 * mean_y)
        return a, b


@dataclass(slots=True)
class DraftRow:
    """A decode row the chooser may give drafts: its request's counts and its slot limit."""

    key: str
    counts: PositionCounts
    limit: int


class DraftLengthChooser:
    """One worker's adaptive draft lengths: the worker-wide acceptance by position, its step
    cost fit, and the greedy choice of each plan's slots (see the module docstring)."""

    def __init__(self, params: DraftLengthParams | None = None) -> None:
        self.params = params or DraftLengthParams()
        self.worker = PositionCounts()
        self.cost = StepCostModel(self.params.cost_decay, self.params.prior_fixed_tokens)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step result's tokens fed and device seconds."""
        self.cost.observe(num_tokens, seconds)

    def observe_row(
        self, counts: PositionCounts, num_slots: int, num_accepted: int, num_offered: int | None = None
    ) -> None:
        """A row's result: ``num_slots`` draft slots scheduled, ``num_offered`` drafts verified
        (None: one per slot), ``num_accepted`` of them accepted. A row verifying none says
        nothing: the proposer found no match, or made none (a worker skips it after a plan that
        gave no decode row a slot, so the first plan back from that has no drafts)."""
        offered = num_slots if num_offered is None else min(num_offered, num_slots)
        if offered <= 0:
            return
        num_accepted = min(max(num_accepted, 0), offered)
        counts.decay(self.params.request_decay)
        counts.add(num_slots, num_accepted, offered)
        self.worker.add(num_slots, num_accepted, offered)

    def worker_rates(self, num_positions: int) -> list[float]:
        """The worker-wide ``p_j`` for j < ``num_positions`` (the requests' prior means)."""
        params = self.params
        rates: list[float] = []
        prior = params.prior_acceptance
        for j in range(num_positions):
            prior = self.worker.rate(j, prior, params.worker_prior_strength)
            rates.append(prior)
        return rates

    def acceptance(
        self, counts: PositionCounts, num_positions: int, worker_rates: list[float] | None = None
    ) -> list[float]:
        """A request's ``p_j`` for j < ``num_positions`` (``worker_rates``: `worker_rates`'
        answer, computed once per plan)."""
        priors = worker_rates if worker_rates is not None else self.worker_rates(num_positions)
        strength = self.params.prior_strength
        return [counts.rate(j, priors[j], strength) for j in range(num_positions)]

    def choose(
        self, rows: Sequence[DraftRow], num_base_tokens: int, num_base_outputs: int, uniform: bool = False
    ) -> dict[str, int]:
        """Draft slots per row key for a plan that also feeds ``num_base_tokens`` tokens (one per
        decode row, the prefill chunks) and samples ``num_base_outputs`` tokens without drafts.

        ``uniform``: one length for every row (up to its limit), for a device that replays
        captured graphs only for decode steps whose rows are all of one width (CUDA).
        """
        self.worker.decay(self.params.worker_decay)
        a, b = self.cost.fit()
        seconds = a + b * max(num_base_tokens, 0)
        expected = float(max(num_base_outputs, 1))
        priors = self.worker_rates(max((row.limit for row in rows), default=0))
        rates = [self.acceptance(row.counts, row.limit, priors) for row in rows]
        if uniform:
            chosen = self._choose_uniform(rows, rates, seconds, expected, b)
        else:
            chosen = self._choose_per_row(rows, rates, seconds, expected, b)
        for row in rows:
            if row.limit > 0 and chosen[row.key] == 0:
                row.counts.decay(self.params.idle_decay)
        return chosen

    def _choose_per_row(
        self, rows: Sequence[DraftRow], rates: list[list[float]], seconds: float, expected: float, b: float
    ) -> dict[str, int]:
        """The greedy choice of the module docstring, each row on its own."""
        chosen = {row.key: 0 for row in rows}
        # Max-heap of each row's next slot's gain: (-gain, row index, slot index).
        heap = [(-r[0], i, 0) for i, r in enumerate(rates) if r]
        heapq.heapify(heap)
        while heap:
            neg_gain, i, j = heapq.heappop(heap)
            gain = -neg_gain
            if gain < self.params.min_gain or gain * seconds <= expected * b:
                break
            chosen[rows[i].key] = j + 1
            expected += gain
            seconds += b
            if j + 1 < rows[i].limit:
                heapq.heappush(heap, (-(gain * rates[i][j + 1]), i, j + 1))
        return chosen

    def _choose_uniform(
        self, rows: Sequence[DraftRow], rates: list[list[float]], seconds: float, expected: float, b: float
    ) -> dict[str, int]:
        """One length for all rows: each level adds a slot to every row that may take it, and
        is taken while the level's gains pay for its slots as one slot does in the per-row choice."""
        gains = [1.0] * len(rows)
        length = 0
        for j in range(max((row.limit for row in rows), default=0)):
            takers = [i for i, row in enumerate(rows) if row.limit > j]
            for i in takers:
                gains[i] *= rates[i][j]
            gain = sum(gains[i] for i in takers)
            cost = b * len(takers)
            if gain < self.params.min_gain * len(takers) or gain * seconds <= expected * cost:
                break
            length, expected, seconds = j + 1, expected + gain, seconds + cost
        return {row.key: min(length, row.limit) for row in rows}


class Running(Protocol):
    """What the choice reads of a running request (`scheduler_svc/request.py`'s `Request`)."""

    req_id: str
    max_tokens: int
    num_computed: int
    num_prefill_tokens: int
    draft_counts: PositionCounts

    @property
    def prediction(self) -> object | None: ...

    @property
    def is_prefilling(self) -> bool: ...

    @property
    def num_pending_outputs(self) -> int: ...


def plan_drafts(
    chooser: DraftLengthChooser, running: Sequence[Running], max_drafts: int, budget: int, uniform: bool = False
) -> dict[str, int]:
    """The draft slots of the next plan's decode rows by request id, for the requests running as
    it starts (those with a predicted output keep their own budget and are left out).

    ``max_drafts``: the plan's cap (0 while `--spec-disable-batch-size` holds: no drafts);
    ``budget``: the plan's tokens. Each row is limited further by what its `max_tokens` can
    still verify; block capacity and the token budget are the plan's to apply as it is built.
    ``uniform``: one length for every row (see `DraftLengthChooser.choose`).
    """
    if max_drafts <= 0:
        return {}
    limit = max_drafts
    rows: list[DraftRow] = []
    num_base_tokens = 0
    for req in running:
        if req.is_prefilling:
            num_base_tokens += req.num_prefill_tokens - req.num_computed
            continue
        num_base_tokens += 1
        if req.prediction is None:
            room = req.max_tokens - req.num_pending_outputs - 1
            rows.append(DraftRow(req.req_id, req.draft_counts, max(min(limit, room), 0)))
    return chooser.choose(rows, min(num_base_tokens, budget), len(running), uniform)
