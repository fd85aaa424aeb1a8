"""Steps made moot by a later plan are cut short, on the real SmolLM2 runner and the real scheduler.

In async mode the scheduler plans step N+1 before it knows that step N ended a request (EOS, a
stop string). When that request was the only one running (concurrency 1), N+1 computes nothing
anyone will use, and the next request's prefill waits behind it. The worker sees the next plan,
whose finish notices name that request, while N+1 is queued or running, and cuts N+1 short
(`ModelRunner.note_finished`). These tests drive requests one after another, with plans "sent"
(noted) as the worker's receiver would see them, and check that

- such steps are cut, and only steps whose every row is finished;
- outputs are token for token those of the synchronous run (where nothing is ever cut);
- a forward interrupted between layers leaves nothing behind that changes later outputs.
"""

from __future__ import annotations

from collections import deque

import pytest

from tests.support.drive import make_scheduler
from zerobubble.api import worker_pb2
from zerobubble.request_options import StoppingOptions
from zerobubble.rows import plan_rows, result_rows
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.worker_svc.server import tokenizer_fields
from zerobubble.worker_svc.step_loop import run_step

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea.",
    "def add(a, b):",
    "Once upon a time",
]
# A stop string the scheduler cannot see coming: the step planned after it is moot.
STOP = ["."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def runner(ngram_runner):
    """The shared SmolLM2 n-gram runner (tests/conftest.py)."""
    return ngram_runner


def one_after_another(
    runner, window: int, during_forward=None, *, arrive_late: bool = False, notices: bool = False
) -> tuple[dict[str, list[int]], list[int]]:
    """Each prompt alone, the next one added as soon as the previous one finishes.

    Plans are noted when planned (the worker's receiver sees them at once) and executed in
    order, `window - 1` ahead of their results. `during_forward(plan_id, plans_noted)` may note
    further plans from inside a forward. `arrive_late`: the next request comes only once every
    step in flight has answered (a client slower than the worker). `notices`: when nothing is
    to run, send what `Scheduler.notice_plan` offers, as the worker link does. Returns
    req_id -> tokens and the ids of cut steps.
    """
    scheduler = make_scheduler(runner, max_num_batched_tokens=64)
    fields = tokenizer_fields(runner.loaded.path)
    tok = Tokenizer(fields["tokenizer_json"], fields["chat_template"], fields["bos_token"], fields["eos_token"])
    runner.reset()
    out: dict[str, list[int]] = {}
    cut: list[int] = []
    pending: deque[worker_pb2.StepPlan] = deque()
    next_prompt = 0

    def add_next() -> None:
        nonlocal next_prompt
        req_id = f"r{next_prompt}"
        scheduler.add_request(
            req_id, tok.encode(PROMPTS[next_prompt]), None, StoppingOptions(max_tokens=MAX_TOKENS, stop=STOP)
        )
        out[req_id] = []
        next_prompt += 1

    add_next()
    next_due = False
    while True:
        if next_due and not (arrive_late and pending):
            add_next()
            next_due = False
        plan = scheduler.schedule() if len(pending) < window else None
        if plan is None and notices and len(pending) < window:
            plan = scheduler.notice_plan()
            if plan is not None:
                assert not plan_rows(plan) and plan.finished_req_ids
        if plan is not None:
            runner.note_finished(plan)
            pending.append(plan)
            continue
        if not pending:
            break
        plan = pending.popleft()
        result, was_cut = execute_plan(runner, plan, pending, during_forward)
        if was_cut:
            cut.append(plan.step_id)
        for event in scheduler.on_step_result(result):
            assert not event.error, event.error
            out[event.req_id].extend(event.token_ids)
            if event.finish_reason is not None and next_prompt < len(PROMPTS):
                next_due = True
    return out, cut


def execute_plan(
    runner, plan: worker_pb2.StepPlan, pending: deque[worker_pb2.StepPlan], during_forward=None
) -> tuple[worker_pb2.StepResult, bool]:
    """Run one plan as the worker's step loop does; the result, and whether the step was cut
    short (a cut step answers with no rows and no error)."""
    before = runner.notices.num_cut_steps
    if during_forward is not None:
        during_forward(plan, pending)
    result = run_step(runner, plan)
    if not isinstance(result, worker_pb2.StepResult):
        result = result.materialize(0.0, runner.num_proposed)
    was_cut = runner.notices.num_cut_steps > before
    if was_cut:
        assert not result_rows(result) and not result.error, result
    return result, was_cut


def test_moot_steps_are_cut_and_outputs_are_unchanged(runner) -> None:
    sync, sync_cut = one_after_another(runner, window=1)
    assert not sync_cut  # nothing is planned ahead, so nothing can become moot
    assert all(sync[f"r{i}"] for i in range(len(PROMPTS)))
    async_, cut = one_after_another(runner, window=2)
    assert async_ == sync
    # Each request but the last ended with a stop string while the step after it was in flight
    # alone (a request ending at max_tokens is never planned past its limit).
    assert len(cut) >= 1, "no step was cut: the test no longer exercises the moot path"


def test_a_forward_interrupted_between_layers_changes_nothing_later(runner) -> None:
    """The next plan arrives while the moot step's forward is under way: the forward stops at
    the next layer (K/V of the first layers were written for a finished request), and the
    following requests are still exact."""
    sync, _ = one_after_another(runner, window=1)
    model = runner.model
    check = model.interrupt
    num_layers = len(model.layers)
    interrupted: list[int] = []

    def during_forward(plan: worker_pb2.StepPlan, queued: deque) -> None:
        # Hold back the finish notices of the queued plans until layer 3 of this forward.
        held = [p for p in queued if p.finished_req_ids]
        saved = runner.notices.finished_in.copy()
        for p in held:
            for req_id in p.finished_req_ids:
                if runner.notices.finished_in.get(req_id) == p.step_id:
                    del runner.notices.finished_in[req_id]
        calls = [0]

        def interrupt() -> bool:
            calls[0] += 1
            if calls[0] == 3 and held:
                runner.notices.finished_in.update(saved)
                if check():
                    interrupted.append(plan.step_id)
            return check()

        model.interrupt = interrupt

    try:
        async_, cut = one_after_another(runner, window=2, during_forward=during_forward)
    finally:
        model.interrupt = check
    assert async_ == sync
    assert interrupted and set(interrupted) <= set(cut), (interrupted, cut)
    assert num_layers > 3


def test_a_finish_notice_alone_cuts_the_step_in_flight(runner) -> None:
    """With nothing else to run after a stop, no plan would carry the finish notice until the
    next request arrives, and the step planned past the stop runs to its end meanwhile. The
    notice-only plan (`Scheduler.notice_plan`, sent by the worker link) cuts it at once."""
    sync, _ = one_after_another(runner, window=1)
    late, late_cut = one_after_another(runner, window=2, arrive_late=True)
    assert late == sync
    assert not late_cut  # no later plan reached the worker while the moot step was queued
    noticed, cut = one_after_another(runner, window=2, arrive_late=True, notices=True)
    assert noticed == sync
    assert len(cut) >= 1, "the notice-only plans cut nothing"


def test_finished_requests_leave_the_worker_when_nothing_else_runs(runner) -> None:
    """Once the last request has finished and no step is in flight, the notice-only plan still
    goes out: the worker drops the request's slot instead of holding it until the next request
    (a worker holding requests counts its wait for a plan as a bubble)."""
    _, _ = one_after_another(runner, window=2, notices=False)
    assert runner.slots, "without notices the last request's slot stays: the test exercises nothing"
    out, _ = one_after_another(runner, window=2, notices=True)
    assert all(out.values())
    assert not runner.slots, f"slots of finished requests kept: {sorted(runner.slots)}"
