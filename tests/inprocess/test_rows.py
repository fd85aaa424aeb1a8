"""Plans and results carry their rows in columns (`PlanRows`, `ResultRows`): what a builder puts
in comes out of the reader, through the wire bytes, in the order the worker runs it; columns
that do not line up are a clear error, and a worker given them fails that step only."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hand_plans import make_plan
from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, to_worker_sampling
from zerobubble.rows import (
    NewRow,
    PlanBuilder,
    PlanRow,
    ResultBuilder,
    read_plan,
    result_rows,
    speculation_counts,
)
from zerobubble.scheduler_svc.worker_link import plan_tokens
from zerobubble.worker_svc.server import WorkerConfig, build_runner
from zerobubble.worker_svc.step_loop import run_step

_ids = st.lists(st.integers(0, 2**31 - 1), max_size=5)
_decode = st.tuples(st.integers(0, 8), _ids)  # (draft slots, new block ids)
# (tokens, draft slots, new block ids, sample, new: (cached tokens, seed) or None); no tokens
# is a decode row written among the others.
_other = st.tuples(
    st.lists(st.integers(0, 50_000), max_size=6),
    st.integers(0, 3),
    _ids,
    st.booleans(),
    st.none() | st.tuples(st.integers(0, 64), st.integers(1, 1000)),
)


def _wire(plan: worker_pb2.StepPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan.FromString(plan.SerializeToString())


def _row_fields(row: PlanRow) -> tuple:
    seed = row.sampling.seed if row.sampling is not None else None
    tokens, blocks = list(row.token_ids), list(row.new_block_ids)
    return (row.req_id, tokens, row.num_draft_slots, blocks, row.is_new, row.num_cached_tokens, row.sample, seed)


@settings(max_examples=200, deadline=None)
@given(decodes=st.lists(_decode, max_size=12), others=st.lists(_other, max_size=6))
def test_plan_rows_are_the_rows_written_decodes_first(decodes, others) -> None:
    builder = PlanBuilder()
    expected: list[tuple] = []
    # Added interleaved, as the scheduler does; the decode rows still come first.
    pending = list(enumerate(decodes))
    for i, (tokens, drafts, blocks, sample, new) in enumerate(others):
        if pending:
            j, (k, decode_blocks) = pending.pop(0)
            builder.add_decode(f"d{j}", k, decode_blocks)
        new_row = None if new is None else NewRow(new[0], to_worker_sampling(SamplingOptions(seed=new[1]), 0))
        builder.add(f"o{i}", tokens, num_draft_slots=drafts, new_block_ids=blocks, sample=sample, new=new_row)
        cached, seed = new if new is not None else (0, None)
        expected.append((f"o{i}", tokens, drafts, blocks, new is not None, cached, sample, seed))
    for j, (k, decode_blocks) in pending:
        builder.add_decode(f"d{j}", k, decode_blocks)
    decode_rows: list[tuple] = [(f"d{j}", [], k, blocks, False, 0, True, None) for j, (k, blocks) in enumerate(decodes)]
    plan = worker_pb2.StepPlan(step_id=3)
    builder.write(plan)
    assert len(builder) == len(decodes) + len(others)
    cols = read_plan(_wire(plan))
    assert [_row_fields(r) for r in cols.rows()] == decode_rows + expected
    # The worker takes as columns the leading rows that are plain decodes, and only those.
    rows = cols.rows()
    num_leading = next((i for i, r in enumerate(rows) if r.token_ids or r.is_new or not r.sample), len(rows))
    leading = cols.leading_decodes()
    assert leading.req_ids == [r.req_id for r in rows[:num_leading]]
    assert leading.num_draft_slots == [r.num_draft_slots for r in rows[:num_leading]]
    assert leading.num_new_blocks == [len(r.new_block_ids) for r in rows[:num_leading]]
    assert leading.new_block_ids == [b for r in rows[:num_leading] for b in r.new_block_ids]
    assert [_row_fields(r) for r in cols.rows(num_leading)] == [_row_fields(r) for r in rows[num_leading:]]


def test_an_empty_plan_has_no_rows() -> None:
    builder = PlanBuilder()
    plan = worker_pb2.StepPlan(step_id=1, finished_req_ids=["a"])
    builder.write(plan)
    cols = read_plan(_wire(plan))
    assert len(builder) == 0 and cols.rows() == [] and cols.leading_decodes().req_ids == []


def test_a_new_row_carries_its_sampling() -> None:
    options = SamplingOptions(temperature=0.5, top_k=5, seed=11, logprobs=True, top_logprobs=2, grammar="{}")
    builder = PlanBuilder()
    builder.add("n", [4, 5, 6], new_block_ids=[2], new=NewRow(16, to_worker_sampling(options, 3)))
    plan = worker_pb2.StepPlan()
    builder.write(plan)
    [row] = read_plan(_wire(plan)).rows()
    assert row.is_new and row.num_cached_tokens == 16 and row.sampling is not None
    assert (row.sampling.temperature, row.sampling.top_k, row.sampling.seed) == (0.5, 5, 11)
    assert (row.sampling.logprobs, row.sampling.top_logprobs, row.sampling.grammar) == (True, 2, "{}")
    assert row.sampling.num_prompt_tokens == 3


def test_a_plan_feeds_its_chunks_and_one_plus_the_drafts_of_each_decode() -> None:
    builder = PlanBuilder()
    builder.add_decode("a", 3)
    builder.add_decode("b", 0, [7])
    builder.add("c", [1, 2, 3, 4, 5], new=NewRow())
    builder.add("d", [6, 7], sample=False)
    builder.add("e", num_draft_slots=2)  # a decode after the chunks
    plan = worker_pb2.StepPlan()
    builder.write(plan)
    assert plan_tokens(plan) == (1 + 3) + 1 + 5 + 2 + (1 + 2)


def _broken_plans() -> dict[str, worker_pb2.StepPlan]:
    """Plans whose columns cannot be read, by what is wrong with them."""
    plans = {}
    for name in ("counts", "blocks", "tokens", "negative", "order", "range", "sampling"):
        plan = make_plan(1, [PlanRow("a", [1, 2], is_new=True), PlanRow("b", [3], sample=False)])
        rows = plan.rows
        if name == "counts":
            rows.num_draft_slots.append(0)  # three draft counts for two rows
        elif name == "blocks":
            rows.num_new_blocks[0] = 1  # one block counted, none given
        elif name == "tokens":
            del rows.token_ids[0]
        elif name == "negative":
            rows.num_cached_tokens[0] = -16
        elif name == "order":
            rows.unsampled_rows.append(1)  # row 1 listed twice
        elif name == "range":
            rows.new_rows.append(5)
            rows.num_cached_tokens.append(0)
            rows.sampling.add()
        else:
            rows.sampling.add()  # two sampling messages for one new row
        plans[name] = plan
    return plans


@pytest.mark.parametrize("name", sorted(_broken_plans()))
def test_columns_that_do_not_line_up_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="plan rows"):
        read_plan(_broken_plans()[name])


# (tokens, drafts, prediction, logprobs wanted, top-N wanted, error)
_result_row = st.tuples(
    st.lists(st.integers(0, 50_000), max_size=4),
    st.integers(0, 3),
    st.booleans(),
    st.booleans(),
    st.integers(0, 3),
    st.sampled_from(["", "", "", "row refused"]),
)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(_result_row, max_size=12))
def test_result_rows_are_the_rows_written(rows) -> None:
    builder = ResultBuilder()
    expected: dict[str, tuple] = {}
    for i, (tokens, drafts, predicted, want_logprobs, num_top, error) in enumerate(rows):
        req_id = f"r{i}"
        if error:
            builder.add_error(req_id, error)
            expected[req_id] = ([], 0, False, [], [], error)
            continue
        logprobs = [-0.5 - t for t in range(len(tokens))] if want_logprobs else None
        tops = [([t, t + 1, t + 2][:num_top], [-0.1, -0.2, -0.3][:num_top]) for t in tokens] if num_top else None
        builder.add(req_id, tokens, drafts, prediction_drafts=predicted, logprobs=logprobs, top_logprobs=tops)
        expected[req_id] = (tokens, drafts, predicted, logprobs or [], tops or [], "")
    result = worker_pb2.StepResult(step_id=1)
    builder.write(result)
    wire = worker_pb2.StepResult.FromString(result.SerializeToString())
    got = result_rows(wire)
    assert list(got) == list(expected)
    for req_id, (tokens, drafts, predicted, logprobs, tops, error) in expected.items():
        row = got[req_id]
        assert (row.token_ids, row.num_draft_tokens, row.prediction_drafts, row.error) == (
            tokens,
            drafts,
            predicted,
            error,
        )
        assert row.num_accepted == max(len(tokens) - 1, 0)
        assert row.logprobs == pytest.approx(logprobs)
        assert [ids for ids, _ in row.top_logprobs] == [ids for ids, _ in tops]
        assert [lps for _, lps in row.top_logprobs] == [pytest.approx(lps) for _, lps in tops]
    # The prediction flags go out only when some row's drafts came from a prediction.
    assert bool(wire.rows.prediction_drafts) == any(r[2] for r in rows if not r[5])


def test_speculation_counts_split_prediction_drafts_from_the_proposers() -> None:
    builder = ResultBuilder()
    builder.add("a", [1, 2, 3], 3)  # two of three drafts accepted
    builder.add("b", [4], 2)  # none of two
    builder.add("p", [5, 6, 7, 8], 5, prediction_drafts=True)  # three of five, from a prediction
    builder.add("c", [9])  # a prefill sample: no drafts
    builder.add_error("e", "refused")
    result = worker_pb2.StepResult()
    builder.write(result)
    counts = speculation_counts(result.rows)
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted) == (2, 5, 2)
    assert (counts.num_prediction_draft_tokens, counts.num_prediction_accepted) == (5, 3)


def test_logprobs_not_one_per_token_are_refused() -> None:
    builder = ResultBuilder()
    with pytest.raises(ValueError, match="one per token"):
        builder.add("a", [1, 2], logprobs=[-0.5])
    with pytest.raises(ValueError, match="one per token"):
        builder.add("a", [1, 2], top_logprobs=[([1], [-0.5])])
    with pytest.raises(ValueError, match="unequal lengths"):
        builder.add("a", [1], top_logprobs=[([1, 2], [-0.5])])


def test_a_plan_with_broken_columns_fails_that_step_and_the_worker_goes_on() -> None:
    runner, _ = build_runner(
        WorkerConfig(simulate_device_ms=0.0, max_num_seqs=4, kv_cache_memory_gb=0.05, spec_method="none")
    )
    prefill = PlanRow("a", [5, 6, 7], new_block_ids=[0], is_new=True, sampling=SamplingOptions(seed=1))
    first = run_step(runner, make_plan(1, [prefill]))
    assert not isinstance(first, worker_pb2.StepResult)
    assert len(result_rows(first.materialize(0.0, runner.num_proposed))["a"].token_ids) == 1
    broken = worker_pb2.StepPlan(step_id=2)
    broken.rows.req_ids.append("a")  # no token count, no draft count, no block count
    failed = run_step(runner, broken)
    assert isinstance(failed, worker_pb2.StepResult) and "plan rows" in failed.error
    # Its request lost its state (a failed step's rows do); a new one runs on the same worker.
    assert "a" not in runner.slots
    nxt = run_step(runner, make_plan(3, [PlanRow("b", [5, 6], new_block_ids=[1], is_new=True)]))
    assert not isinstance(nxt, worker_pb2.StepResult)
    pending = nxt
    decoded = run_step(runner, make_plan(4, [PlanRow("b")]))
    assert not isinstance(decoded, worker_pb2.StepResult)
    assert len(result_rows(pending.materialize(0.0, runner.num_proposed))["b"].token_ids) == 1
    assert len(result_rows(decoded.materialize(0.0, runner.num_proposed))["b"].token_ids) == 1
