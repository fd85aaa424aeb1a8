"""Fault isolation inside a step, on the real SmolLM2 runner driven by the real scheduler.

Plans are sent three ahead of their results (as over the network), so when a row fails, later
plans already hold decode rows for its request. Those rows must be answered with a per-request
error, not fail the whole plan; the co-batched requests must come out token for token as in a
fault-free run, and the worker must keep no state for the failed requests.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
from collections.abc import Callable, Mapping

import pytest
import torch

from tests.support.drive import make_scheduler
from zerobubble.api import worker_pb2
from zerobubble.config import WorkerConfig
from zerobubble.request_options import StoppingOptions
from zerobubble.rows import plan_rows, read_plan, result_rows
from zerobubble.scheduler_svc.scheduler import FINISH_ERROR
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.worker_svc.faults import CopyDone
from zerobubble.worker_svc.server import build_runner, tokenizer_fields
from zerobubble.worker_svc.step_loop import materialize_result, run_jobs, run_step

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 8


class ScriptedFaults:
    """The runner's fault injector here: ``step`` may raise for a plan (the whole step fails),
    ``rows`` names rows to reject; neither is set between tests."""

    def __init__(self) -> None:
        self.step: Callable[[worker_pb2.StepPlan], None] | None = None
        self.rows: Callable[[worker_pb2.StepPlan], Mapping[str, str]] | None = None

    def step_fault(self, plan: worker_pb2.StepPlan) -> None:
        if self.step is not None:
            self.step(plan)

    def row_faults(self, plan: worker_pb2.StepPlan) -> Mapping[str, str] | None:
        return self.rows(plan) if self.rows is not None else None

    def copy_fault(self, step_number: int) -> CopyDone | None:
        return None


class RowByRow(ScriptedFaults):
    """Rejects no row, but makes the runner check every row on its own instead of the decode
    columns at once."""

    def row_faults(self, plan: worker_pb2.StepPlan) -> Mapping[str, str] | None:
        return {}


FAULTS = ScriptedFaults()


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    runner, _ = build_runner(
        WorkerConfig(dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=8, spec_method="ngram", num_spec_tokens=3),
        FAULTS,
    )
    return runner


class FailingCopy:
    """Stands for the CUDA event of a step whose kernels faulted: waiting for it raises."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def run(runner, mutate_plan=None, window: int = 3, late_after_step: int = 0, fault_at_copy: int = 0):
    """The prompts through Scheduler + runner (results `window - 1` plans late).

    With `late_after_step`, the last prompt joins right after that step was executed (so the
    plans in flight behind it mix it with the earlier requests). With `fault_at_copy`, waiting
    for that step's result copy raises, as CUDA reports a fault in a step's kernels. Returns req_id -> (tokens,
    finish reason, error) and the step-level errors seen.
    """
    scheduler = make_scheduler(runner, max_num_batched_tokens=64)
    fields = tokenizer_fields(runner.loaded.path)
    tok = Tokenizer(fields["tokenizer_json"], fields["chat_template"], fields["bos_token"], fields["eos_token"])
    runner.reset()

    def add(i: int) -> None:
        scheduler.add_request(
            f"r{i}", tok.encode(PROMPTS[i]), None, StoppingOptions(max_tokens=MAX_TOKENS, ignore_eos=True)
        )

    num_early = len(PROMPTS) - 1 if late_after_step else len(PROMPTS)
    for i in range(num_early):
        add(i)
    out: dict[str, list] = {f"r{i}": [[], None, ""] for i in range(len(PROMPTS))}
    step_errors: list[str] = []
    inflight = []
    while scheduler.has_unfinished() or inflight:
        while len(inflight) < window and (plan := scheduler.schedule()) is not None:
            if mutate_plan is not None:
                mutate_plan(plan)
            inflight.append(run_step(runner, plan))
            if plan.step_id == fault_at_copy:
                inflight[-1] = dataclasses.replace(inflight[-1], ready=FailingCopy())
            if plan.step_id == late_after_step:
                add(len(PROMPTS) - 1)
        pending = inflight.pop(0)
        result = (
            pending
            if isinstance(pending, worker_pb2.StepResult)
            else materialize_result(pending, 0.0, runner.num_spec_tokens)
        )
        if result.error:
            step_errors.append(result.error)
        for ev in scheduler.on_step_result(result):
            out[ev.req_id][0].extend(ev.token_ids)
            if ev.finish_reason is not None:
                out[ev.req_id][1:] = [ev.finish_reason, ev.error]
    # A last (empty) plan would carry the finish notices; release them as it would.
    for req_id in list(runner.slots):
        assert req_id not in {"r1", "r2"} or out[req_id][1] != FINISH_ERROR
    return out, step_errors


def test_failed_rows_end_only_their_requests(runner):
    reference, errors = run(runner)
    assert not errors and all(len(v[0]) == MAX_TOKENS for v in reference.values())

    fired: list[int] = []

    def reject_r1(plan: worker_pb2.StepPlan) -> dict[str, str]:
        # r1 fails at its first decode row; the two plans after it already hold rows for it.
        if not fired and any(row.req_id == "r1" and not row.token_ids for row in plan_rows(plan)):
            fired.append(plan.step_id)
            return {"r1": "request r1: injected row fault"}
        return {}

    def malformed(plan):
        # r2's first prefill chunk carries an id outside the vocabulary (a malformed entry).
        rows = plan.rows
        for i in rows.new_rows:
            if rows.req_ids[i] == "r2":
                rows.token_ids[sum(rows.num_tokens[:i])] = 10**6

    FAULTS.rows = reject_r1
    try:
        got, errors = run(runner, malformed)
    finally:
        FAULTS.rows = None
    assert not errors, errors  # no step failed as a whole
    assert fired, "r1 never had a decode row"
    assert got["r1"][1] == FINISH_ERROR and "injected row fault" in got["r1"][2]
    assert got["r2"][1] == FINISH_ERROR and "vocabulary" in got["r2"][2]
    for req_id in ("r0", "r3"):
        assert got[req_id][0] == reference[req_id][0], req_id
    assert not {"r1", "r2"} & set(runner.slots)


def test_a_step_that_raises_fails_its_requests_and_not_the_next_plans(runner):
    """Step 2 raises as a whole (as a crash in the model would); r3 joins right behind it, so
    the plans in flight hold r3's prefill next to decode rows of the failed requests."""
    reference, _ = run(runner, late_after_step=2)

    def fail_step_2(plan: worker_pb2.StepPlan) -> None:
        if plan.step_id == 2:
            raise RuntimeError("injected step fault")

    FAULTS.step = fail_step_2
    try:
        got, errors = run(runner, late_after_step=2)
    finally:
        FAULTS.step = None
    assert errors == ["step failed: injected step fault"]
    for req_id in ("r0", "r1", "r2"):
        assert got[req_id][1] == FINISH_ERROR and "injected step fault" in got[req_id][2]
    assert got["r3"][0] == reference["r3"][0] and len(got["r3"][0]) == MAX_TOKENS
    assert not {"r0", "r1", "r2"} & set(runner.slots)


def test_a_fault_at_the_result_copy_answers_its_step_with_an_error(runner):
    """On CUDA a fault in a step's kernels surfaces at the wait for its result copy, on the
    copier thread: the step is answered with an error (not left unanswered until the step
    deadline), its requests end with ERROR, and a request that joined behind it is unaffected."""
    reference, _ = run(runner, late_after_step=2)
    got, errors = run(runner, late_after_step=2, fault_at_copy=2)
    assert len(errors) == 1 and "illegal memory access" in errors[0]
    for req_id in ("r0", "r1", "r2"):
        assert got[req_id][1] == FINISH_ERROR and "illegal memory access" in got[req_id][2]
    assert got["r3"][0] == reference["r3"][0] and len(got["r3"][0]) == MAX_TOKENS


def test_the_copier_logs_a_failing_job_and_runs_the_next(caplog) -> None:
    """A job that raises on the copier thread (a delivery into a closed loop, say) must not end
    the thread: the results behind it would never be answered."""
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    done: list[int] = []

    def fail() -> None:
        raise RuntimeError("event loop is closed")

    for job in ((fail, ()), (done.append, (1,)), (fail, ()), (done.append, (2,)), None):
        jobs.put(job)
    with caplog.at_level(logging.ERROR, logger="zerobubble.worker_svc.step_loop"):
        run_jobs(jobs)  # returns at the None
    assert done == [1, 2]
    assert sum("copier's job failed" in r.message for r in caplog.records) == 2


def _decoding_runners(num_requests: int = 4):
    """Two simulated runners (no weights) in the same state, and the scheduler's next plan for
    them: every request a decode row, some gaining a block."""
    config = WorkerConfig(
        dtype="float32",
        simulate_device_ms=0.0,
        spec_method="ngram",
        num_spec_tokens=3,
        max_num_seqs=8,
        kv_cache_memory_gb=1.0,
    )
    # The twin checks every row on its own, the other the decode columns at once.
    runners = [build_runner(config)[0], build_runner(config, RowByRow())[0]]
    scheduler = make_scheduler(runners[0], max_num_batched_tokens=256)
    for i in range(num_requests):
        scheduler.add_request(
            f"r{i}", list(range(100 + i, 115 + i)), None, StoppingOptions(max_tokens=200, ignore_eos=True)
        )
    for _ in range(200):
        plan = scheduler.schedule()
        assert plan is not None
        decodes = read_plan(plan).leading_decodes()
        if len(decodes.req_ids) == num_requests and any(decodes.num_new_blocks):
            return runners, plan
        results = [materialize_result(run_step(r, plan), 0.0, r.num_spec_tokens) for r in runners]
        assert results[0].SerializeToString() == results[1].SerializeToString()
        scheduler.on_step_result(results[0])
    raise AssertionError("no all-decode plan with a new block")


def _outcome(runner, plan) -> tuple[dict[str, str], worker_pb2.StepResult]:
    """Errors and result of one plan."""
    pending = runner.execute(plan)
    result = materialize_result(pending, 0.0, runner.num_spec_tokens)
    result.forward_s = result.idle_s = 0.0  # timings
    return pending.errors, result


def _break_row(plan: worker_pb2.StepPlan, how: str, num_blocks: int) -> str:
    """Make decode row 1 or 2 of the all-decode `plan` unrunnable; returns the request id that errs."""
    dec = plan.rows
    if how == "unknown":
        dec.req_ids[1] = "ghost"
    elif how == "twice":
        dec.req_ids[2] = dec.req_ids[1]
    elif how == "drafts":
        dec.num_draft_slots[1] = 9
    else:  # a block id past the pool, given to row 1
        dec.new_block_ids.insert(dec.num_new_blocks[0], num_blocks)
        dec.num_new_blocks[1] += 1
    return dec.req_ids[1]


@pytest.mark.parametrize("how", ["none", "unknown", "twice", "drafts", "block"])
def test_decode_columns_checked_at_once_run_as_row_by_row(how: str) -> None:
    """A plan's leading decode rows are checked a column at a time. That must
    change nothing: a clean plan gives the same result as row-by-row checking, and a row that
    cannot run still gets its own error while the other rows run."""
    runners, plan = _decoding_runners()
    bad_id = _break_row(plan, how, runners[0].config.num_blocks) if how != "none" else None
    errors, result = _outcome(runners[0], plan)
    twin_errors, twin_result = _outcome(runners[1], plan)
    assert errors == twin_errors
    assert result == twin_result
    # ... and the same state left behind: slots, block tables (host and device), references.
    state, twin = runners
    assert {r: (i.slot, i.block_ids) for r, i in state.slots.items()} == {
        r: (i.slot, i.block_ids) for r, i in twin.slots.items()
    }
    assert state.table.block_refs == twin.table.block_refs
    assert torch.equal(state.state.block_table, twin.state.block_table)
    assert torch.equal(state.state.seq_len, twin.state.seq_len)
    ran = {req_id for req_id, r in result_rows(result).items() if not r.error}
    # Every row that ran holds the blocks the plan gave it, on the host and in the device table.
    dec, start = plan.rows, 0
    for req_id, n in zip(dec.req_ids, dec.num_new_blocks):
        new_blocks, start = list(dec.new_block_ids[start : start + n]), start + n
        if req_id in ran and req_id not in errors:
            info = state.slots[req_id]
            assert info.block_ids[len(info.block_ids) - n :] == new_blocks, req_id
            assert state.state.block_table[info.slot, : len(info.block_ids)].tolist() == info.block_ids
    if bad_id is None:
        assert not errors and ran == set(plan.rows.req_ids)
        return
    expected = {
        "unknown": "unknown to this worker",
        "twice": "scheduled twice",
        "drafts": "draft slots",
        "block": "block id out of range",
    }[how]
    assert list(errors) == [bad_id] and expected in errors[bad_id], errors
    others = set(plan.rows.req_ids) - {bad_id}
    assert others <= ran
    assert not result.error
