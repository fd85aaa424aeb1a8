"""The adaptive draft-length chooser (`scheduler_svc/draft_length.py`): acceptance by position,
the step cost fit, and the slots a plan's rows get."""

from __future__ import annotations

import pytest

from tests.support.sim_worker import make_case
from zerobubble.api import worker_pb2
from zerobubble.config import DRAFT_LENGTHS, ConfigError, SchedulerConfig
from zerobubble.request_options import StoppingOptions
from zerobubble.scheduler_svc.draft_length import (
    CHOICES,
    DraftLengthChooser,
    DraftRow,
    PositionCounts,
    StepCostModel,
    plan_drafts,
)

K = 4


def _low_cost(chooser: DraftLengthChooser) -> None:
    """Steps of a memory-bound device: 10 ms, and 0.05 ms a token."""
    for num_tokens in (1, 3, 5, 2, 4, 8, 1, 6):
        chooser.observe_step(num_tokens, 0.010 + 0.00005 * num_tokens)


def _high_cost(chooser: DraftLengthChooser) -> None:
    """Steps of a compute-bound device: 2 ms, and 1 ms a token."""
    for num_tokens in range(16, 400, 12):
        chooser.observe_step(num_tokens, 0.002 + 0.001 * num_tokens)


def _step(chooser: DraftLengthChooser, counts: PositionCounts, num_accepted_of: int | None) -> int:
    """Plan one row alone and feed back its result: ``num_accepted_of`` None = every draft
    accepted, else that many at most."""
    k = chooser.choose([DraftRow("r", counts, K)], 1, 1)["r"]
    accepted = k if num_accepted_of is None else min(k, num_accepted_of)
    chooser.observe_row(counts, k, accepted)
    return k


def test_the_cost_fit_recovers_a_linear_step_time() -> None:
    model = StepCostModel(decay=0.99, prior_fixed_tokens=32)
    for num_tokens in range(1, 200, 7):
        model.observe(num_tokens, 0.004 + 0.0002 * num_tokens)
    a, b = model.fit()
    assert a == pytest.approx(0.004, rel=0.15)
    assert b == pytest.approx(0.0002, rel=0.1)


def test_the_cost_prior_holds_until_the_tokens_vary() -> None:
    model = StepCostModel(decay=0.99, prior_fixed_tokens=32)
    for _ in range(20):
        model.observe(4, 0.036)
    a, b = model.fit()
    # Always 4 tokens: the prior says the fixed cost is worth 32 tokens.
    assert b == pytest.approx(0.036 / 36)
    assert a == pytest.approx(0.032)
    model.observe(0, 1.0)  # a step that fed nothing says nothing
    model.observe(3, float("nan"))
    assert model.fit() == (a, b)


def test_a_request_whose_drafts_are_never_accepted_gets_none_after_a_few_steps() -> None:
    chooser = DraftLengthChooser()
    _low_cost(chooser)
    counts = PositionCounts()
    lengths = [_step(chooser, counts, 0) for _ in range(40)]
    assert lengths[0] == K  # the prior: worth trying at a low cost per token
    assert 0 in lengths[:8]
    # Then no drafts but a one-slot probe now and then (cheap at this cost per token).
    assert max(lengths[8:]) == 1 and lengths[8:].count(0) >= 2 * lengths[8:].count(1)


def test_a_request_without_drafts_is_probed_again_later() -> None:
    chooser = DraftLengthChooser()
    _low_cost(chooser)
    counts = PositionCounts()
    lengths = [_step(chooser, counts, 0) for _ in range(12)]
    while lengths[-1] != 0:
        lengths.append(_step(chooser, counts, 0))
    # The idle plans decay its record until a draft is tried; accepted ones bring the rest back.
    recovered = [_step(chooser, counts, None) for _ in range(20)]
    assert recovered[0] <= 1
    assert recovered[-1] == K and recovered.index(K) < 10


def test_a_request_whose_drafts_are_always_accepted_gets_the_full_k_at_low_cost() -> None:
    chooser = DraftLengthChooser()
    _low_cost(chooser)
    counts = PositionCounts()
    assert [_step(chooser, counts, None) for _ in range(10)] == [K] * 10
    assert chooser.acceptance(counts, K)[0] > 0.8


def test_a_request_accepting_one_draft_gets_about_two() -> None:
    chooser = DraftLengthChooser()
    _low_cost(chooser)
    counts = PositionCounts()
    lengths = [_step(chooser, counts, 1) for _ in range(30)]
    # Position 0 always accepted, 1 never: one slot pays, the second only now and then (a probe).
    assert 1 <= lengths[-1] <= 2
    p = chooser.acceptance(counts, 2)
    assert p[0] > 0.8 and p[1] < 0.2


def _batch(chooser: DraftLengthChooser, num_rows: int, acceptance: list[int]) -> list[DraftRow]:
    """``num_rows`` rows whose history accepted the drafts of ``acceptance`` in turn."""
    rows = [DraftRow(f"r{i}", PositionCounts(), K) for i in range(num_rows)]
    for row in rows:
        for num_accepted in acceptance:
            chooser.observe_row(row.counts, K, num_accepted)
    return rows


def test_a_high_cost_per_token_at_a_big_batch_cuts_drafts() -> None:
    history = [0, 1, 0, 2, 1, 0, 1, 3]
    cheap, dear = DraftLengthChooser(), DraftLengthChooser()
    _low_cost(cheap)
    _high_cost(dear)
    cheap_slots = cheap.choose(_batch(cheap, 64, history), 64, 64)
    dear_slots = dear.choose(_batch(dear, 64, history), 64, 64)
    assert min(cheap_slots.values()) >= 1
    assert sum(dear_slots.values()) < sum(cheap_slots.values()) / 4
    # At one row the same per-token cost is small against the step: drafts pay again.
    alone = dear.choose(_batch(dear, 1, history), 1, 1)
    assert alone["r0"] >= 1


def test_a_new_request_starts_from_the_workers_acceptance() -> None:
    fresh = DraftLengthChooser()
    _low_cost(fresh)
    # A new worker's prior (half the drafts accepted at each position) is worth k at low cost.
    assert fresh.choose([DraftRow("new", PositionCounts(), K)], 1, 1) == {"new": K}
    rejecting = DraftLengthChooser()
    _low_cost(rejecting)
    _batch(rejecting, 8, [0] * 20)
    accepting = DraftLengthChooser()
    _low_cost(accepting)
    _batch(accepting, 8, [K] * 20)
    p_rejecting = rejecting.acceptance(PositionCounts(), K)
    p_accepting = accepting.acceptance(PositionCounts(), K)
    assert p_rejecting[0] < 0.1 < 0.9 < p_accepting[0]
    assert rejecting.choose([DraftRow("new", PositionCounts(), K)], 1, 1) == {"new": 0}
    assert accepting.choose([DraftRow("new", PositionCounts(), K)], 1, 1) == {"new": K}


def test_row_limits_are_kept() -> None:
    chooser = DraftLengthChooser()
    rows = [DraftRow("a", PositionCounts(), 0), DraftRow("b", PositionCounts(), 2)]
    assert chooser.choose(rows, 2, 2) == {"a": 0, "b": 2}


def test_plan_drafts_leaves_predictions_out_and_keeps_max_tokens_and_the_cap() -> None:
    case = make_case(num_requests=3, num_spec_tokens=K, stopping=StoppingOptions(max_tokens=3), eos_per_mille=0)
    scheduler = case.scheduler
    for _ in range(3):  # prefill, then decodes in flight
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.on_step_result(case.worker.execute(plan))
    running = scheduler.running_requests()
    assert running and not any(req.is_prefilling for req in running)
    chooser = DraftLengthChooser()
    chosen = plan_drafts(chooser, running, K, 512)
    for req in running:
        assert chosen[req.req_id] <= max(req.max_tokens - req.num_pending_outputs - 1, 0)
    assert plan_drafts(chooser, running, 0, 512) == {}


def test_a_cuda_worker_gets_one_length_for_every_row() -> None:
    """CUDA graphs replay only decode steps whose rows are all of one width: the uniform choice
    gives every row the same length (bar a row's own limit), from the rows' gains together."""
    chooser = DraftLengthChooser()
    _low_cost(chooser)
    good = _batch(chooser, 6, [K] * 10)
    bad = _batch(chooser, 2, [0] * 10)
    for i, row in enumerate(bad):
        row.key = f"bad{i}"
    limited = DraftRow("limited", PositionCounts(), 1)
    chosen = chooser.choose([*good, *bad, limited], 9, 9, uniform=True)
    assert {chosen[row.key] for row in (*good, *bad)} == {K}
    assert chosen["limited"] == 1
    # Per row, the rows that never accept get nothing.
    per_row = chooser.choose([*good, *bad], 8, 8)
    assert [per_row[row.key] for row in bad] == [0, 0] and all(per_row[row.key] == K for row in good)
    dear = DraftLengthChooser()
    _high_cost(dear)
    assert set(dear.choose(_batch(dear, 64, [0, 1, 0, 2, 1, 0, 1, 3]), 64, 64, uniform=True).values()) == {0}


def test_the_scheduler_plans_one_length_for_a_cuda_worker() -> None:
    info = worker_pb2.WorkerInfo(num_blocks=8, block_size=4, max_model_len=64, device="cuda:0")
    assert SchedulerConfig().with_worker(info).uniform_draft_length
    info.device = "cpu"
    assert not SchedulerConfig().with_worker(info).uniform_draft_length


def test_an_unknown_draft_length_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="spec_draft_length"):
        SchedulerConfig(num_blocks=8, block_size=4, max_model_len=64, spec_draft_length="eager").validate()


def test_slots_left_without_a_draft_say_nothing_about_acceptance() -> None:
    """A worker skips its proposer after a plan that gave no decode row a slot, and n-gram finds
    no match at times: empty slots are neither accepted nor rejected drafts."""
    chooser = DraftLengthChooser()
    counts = PositionCounts()
    chooser.observe_row(counts, K, 0, num_offered=0)
    assert counts.num_tries == []
    chooser.observe_row(counts, K, 1, num_offered=1)  # its one draft accepted, the rest empty
    assert counts.num_tries == [1.0] and counts.num_accepted == [1.0]
    chooser.observe_row(counts, K, 1, num_offered=3)  # the second of three drafts rejected
    assert counts.num_tries[1] == 1.0 and counts.num_accepted[1] == 0.0


def test_the_flags_choices_are_the_choosers() -> None:
    assert DRAFT_LENGTHS == CHOICES
