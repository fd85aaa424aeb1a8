"""Plans and results carry most rows in columns (`DecodeColumns`, `RowColumns`): what goes in
comes out, through the wire bytes, in the worker's order; columns that do not line up are a
clear error, and a worker given them fails that step only."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.api import worker_pb2
from zerobubble.rows import PlanRow, add_decode_columns, add_row_columns, plan_rows, result_rows
from zerobubble.worker_svc.server import WorkerConfig, build_runner
from zerobubble.worker_svc.step_loop import run_step

_ids = st.lists(st.integers(0, 2**31 - 1), max_size=5)
_decode = st.tuples(st.integers(0, 8), _ids)  # (draft slots, new block ids)
_prefill = st.tuples(st.lists(st.integers(0, 50_000), min_size=1, max_size=6), _ids, st.booleans(), st.booleans())


@settings(max_examples=200, deadline=None)
@given(decodes=st.lists(_decode, max_size=12), prefills=st.lists(_prefill, max_size=6))
def test_plan_rows_are_the_rows_written_decodes_first(decodes, prefills) -> None:
    plan = worker_pb2.StepPlan(step_id=3)
    add_decode_columns(
        plan,
        [f"d{i}" for i in range(len(decodes))],
        [k for k, _ in decodes],
        [len(blocks) for _, blocks in decodes],
        [b for _, blocks in decodes for b in blocks],
    )
    for i, (tokens, blocks, is_new, sample) in enumerate(prefills):
        entry = plan.requests.add(req_id=f"p{i}", token_ids=tokens, new_block_ids=blocks, is_new=is_new, sample=sample)
        if is_new:
            entry.sampling.spec.sampling.seed = i + 1
    rows = plan_rows(worker_pb2.StepPlan.FromString(plan.SerializeToString()))
    expected = [PlanRow(f"d{i}", (), k, blocks) for i, (k, blocks) in enumerate(decodes)]
    expected += [
        PlanRow(f"p{i}", tokens, 0, blocks, is_new, 0, sample, None)
        for i, (tokens, blocks, is_new, sample) in enumerate(prefills)
    ]
    assert [
        (r.req_id, list(r.token_ids), r.num_draft_slots, list(r.new_block_ids), r.is_new, r.sample) for r in rows
    ] == [(r.req_id, list(r.token_ids), r.num_draft_slots, list(r.new_block_ids), r.is_new, r.sample) for r in expected]
    for row, (_, _, is_new, _) in zip(rows[len(decodes) :], prefills):
        assert (row.sampling is not None) == is_new
        assert row.sampling is None or row.sampling.seed >= 1


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.lists(st.integers(0, 50_000), max_size=4), st.integers(0, 3)), max_size=12))
def test_result_rows_are_the_rows_written(rows) -> None:
    result = worker_pb2.StepResult(step_id=1)
    add_row_columns(
        result,
        [f"r{i}" for i in range(len(rows))],
        [len(tokens) for tokens, _ in rows],
        [t for tokens, _ in rows for t in tokens],
        [d for _, d in rows],
    )
    result.results.add(req_id="m", token_ids=[7, 8], num_draft_tokens=2, num_accepted=1, logprobs=[-0.5, -1.0])
    got = result_rows(worker_pb2.StepResult.FromString(result.SerializeToString()))
    for i, (tokens, drafts) in enumerate(rows):
        row = got[f"r{i}"]
        assert (row.token_ids, row.num_draft_tokens, row.num_accepted) == (tokens, drafts, max(len(tokens) - 1, 0))
    assert got["m"].token_ids == [7, 8] and got["m"].num_accepted == 1 and list(got["m"].logprobs) == [-0.5, -1.0]


def test_columns_that_do_not_line_up_are_refused() -> None:
    plan = worker_pb2.StepPlan(step_id=1)
    plan.decodes.req_ids.extend(["a", "b"])
    plan.decodes.num_draft_slots.extend([1, 1])
    plan.decodes.num_new_blocks.extend([1, 0])  # one block counted, none given
    with pytest.raises(ValueError, match="do not line up"):
        plan_rows(plan)
    with pytest.raises(ValueError, match="unequal lengths"):
        add_decode_columns(plan, ["c"], [1, 2], [0], [])
    with pytest.raises(ValueError, match="unequal lengths"):
        add_row_columns(worker_pb2.StepResult(), ["c"], [2], [5], [0])


def test_a_plan_with_broken_columns_fails_that_step_and_the_worker_goes_on() -> None:
    runner, _ = build_runner(
        WorkerConfig(simulate_device_ms=0.0, max_num_seqs=4, kv_cache_memory_gb=0.05, spec_method="none")
    )
    prefill = worker_pb2.ScheduledRequest(req_id="a", token_ids=[5, 6, 7], new_block_ids=[0], is_new=True, sample=True)
    prefill.sampling.spec.sampling.seed = 1
    first = run_step(runner, worker_pb2.StepPlan(step_id=1, requests=[prefill]))
    assert not isinstance(first, worker_pb2.StepResult)
    assert len(result_rows(first.materialize(0.0, runner.num_proposed))["a"].token_ids) == 1
    broken = worker_pb2.StepPlan(step_id=2)
    broken.decodes.req_ids.append("a")  # no draft count, no block count
    failed = run_step(runner, broken)
    assert isinstance(failed, worker_pb2.StepResult) and "do not line up" in failed.error
    # Its request lost its state (a failed step's rows do); a new one runs on the same worker.
    assert "a" not in runner.slots
    again = worker_pb2.ScheduledRequest(req_id="b", token_ids=[5, 6], new_block_ids=[1], is_new=True, sample=True)
    nxt = run_step(runner, worker_pb2.StepPlan(step_id=3, requests=[again]))
    assert not isinstance(nxt, worker_pb2.StepResult)
    pending = nxt
    plan = worker_pb2.StepPlan(step_id=4)
    add_decode_columns(plan, ["b"], [0], [0], [])
    decoded = run_step(runner, plan)
    assert not isinstance(decoded, worker_pb2.StepResult)
    assert len(result_rows(pending.materialize(0.0, runner.num_proposed))["b"].token_ids) == 1
    assert len(result_rows(decoded.materialize(0.0, runner.num_proposed))["b"].token_ids) == 1
