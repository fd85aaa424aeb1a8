"""Scheduler invariants under async (in-flight window) + speculative execution.

Every test drives the real `Scheduler` against `SimWorker` (tests/support/sim_worker.py), which asserts
the worker-side rules itself (no placeholder inputs, writes only into the request's own,
unshared blocks, KV context always equal to the request's own sequence, no slots past
max_tokens / max_model_len) and compares the final outputs with the toy model run directly.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.options import split_options
from tests.support.sim_worker import (
    EOS_ID,
    Collected,
    assert_matches_reference,
    collect,
    drive,
    make_case,
    make_toy_tokenizer,
    make_toy_tokenizer_json,
    reference_generate,
    toy_logprob,
)
from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.rows import ResultBuilder, plan_rows, result_rows
from zerobubble.scheduler_svc.request import Request
from zerobubble.scheduler_svc.scheduler import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_ERROR,
    FINISH_MAX_TOKENS,
    FINISH_STOP_SEQUENCE,
    QueueFullError,
    RequestEvent,
    Scheduler,
    SchedulerConfig,
)
from zerobubble.scheduler_svc.tokenizer import Tokenizer

TOY = make_toy_tokenizer()


def check_request_counters(scheduler: Scheduler, _events: Sequence[RequestEvent] = ()) -> None:
    """Hook: placeholders never negative, blocks always cover the optimistic count."""
    block_size = scheduler.config.block_size
    for req in scheduler.running_requests():
        assert req.num_placeholders >= 0
        assert req.num_computed <= len(req.block_ids) * block_size
        assert all(t >= 0 for t in req.output_token_ids)
    scheduler.block_pool.check_invariants()


# ------------------------------------------------------------------------------- basics


def test_importing_the_scheduler_does_not_import_torch() -> None:
    code = (
        "import sys, zerobubble.scheduler_svc, zerobubble.scheduler_svc.scheduler, zerobubble.scheduler_svc.tokenizer, "
        "zerobubble.scheduler_svc.detokenizer, zerobubble.scheduler_svc.block_pool, zerobubble.scheduler_svc.request\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("num_spec_tokens", [0, 3])
def test_outputs_equal_the_model_run_directly(window: int, num_spec_tokens: int) -> None:
    """Sync vs async and with vs without speculation: same tokens, text and stop reasons."""
    case = make_case(num_spec_tokens=num_spec_tokens)
    got = drive(case.scheduler, case.worker, window)
    assert_matches_reference(case, got)
    if num_spec_tokens:
        assert case.scheduler.stats.spec.num_accepted_tokens > 0
        assert case.scheduler.stats.num_rolled_back_tokens > 0


@pytest.mark.parametrize("window", [1, 2])
def test_decodes_never_wait_behind_more_prompt_tokens_than_the_cap(window: int) -> None:
    """With --max-prefill-tokens-with-decodes, a step that carries decodes carries at most that
    many prompt tokens; a step without decodes still takes the whole budget; outputs are the
    same as without the cap."""
    cap = 5
    case = make_case(
        num_requests=12, prompt_len=(10, 40), max_num_batched_tokens=32, max_prefill_tokens_with_decodes=cap
    )
    seen = {"capped": 0, "full": 0}

    def check(_scheduler: Scheduler, plan: worker_pb2.StepPlan) -> None:
        rows = plan_rows(plan)
        num_prompt_tokens = sum(len(row.token_ids) for row in rows)
        if any(not row.token_ids for row in rows):
            assert num_prompt_tokens <= cap
            seen["capped"] += num_prompt_tokens > 0
        else:
            seen["full"] += num_prompt_tokens > cap

    got = drive(case.scheduler, case.worker, window, after_plan=check)
    assert_matches_reference(case, got)
    assert seen["capped"] > 0 and seen["full"] > 0  # both kinds of step happened


def test_placeholders_and_counters_consistent_once_results_are_back() -> None:
    case = make_case(num_spec_tokens=4, max_num_batched_tokens=24)
    scheduler, worker = case.scheduler, case.worker
    pending: list[worker_pb2.StepResult] = []
    got: dict[str, Collected] = {}
    num_checks = 0
    while scheduler.has_unfinished() or pending:
        for _ in range(3):
            plan = scheduler.schedule()
            if plan is None:
                break
            pending.append(worker.execute(plan))
            check_request_counters(scheduler)
        for result in pending:
            collect(got, scheduler.on_step_result(result))
            check_request_counters(scheduler)
        pending.clear()
        assert scheduler.num_inflight_steps() == 0
        for req in scheduler.running_requests():
            assert req.num_placeholders == 0
            if not req.is_prefilling:
                # Every token but the newest has its K/V written, nothing more is counted.
                assert req.num_computed == req.num_tokens - 1
            num_checks += 1
    assert num_checks > 20
    assert scheduler.block_pool.num_used == 0
    c = scheduler.stats
    assert c.num_steps_planned == c.num_steps_completed
    assert c.num_generation_tokens == sum(len(out.token_ids) for out in got.values())
    assert_matches_reference(case, got)


def test_spec_counters_match_what_the_worker_verified() -> None:
    """Acceptance figures are the worker's, even when the scheduler trims draft slots."""
    case = make_case(num_spec_tokens=5, stopping=StoppingOptions(max_tokens=7))
    drive(case.scheduler, case.worker, 3)
    c, s = case.scheduler.stats.spec, case.worker.stats
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (
        s.num_drafts,
        s.num_draft_tokens,
        s.num_accepted_tokens,
    )
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens
    assert len(c.accepted_per_pos) <= 5


def test_spec_counters_count_only_applied_results_under_preemption_and_aborts() -> None:
    """Preempted, aborted and finished requests' in-flight rows are not counted as speculation.

    The oracle sums, over every result handed to the scheduler, the drafts of the rows that
    produced streamed tokens (the applied ones); the scheduler's figures must equal it and be
    strictly below what the worker verified in total (stale rows existed).
    """
    case = make_case(
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=10,
        num_spec_tokens=4,
        prompt_len=(15, 40),
        stopping=StoppingOptions(max_tokens=30),
        max_model_len=96,
        num_requests=10,
    )
    sched = case.scheduler
    applied = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    applied_per_pos: list[int] = []
    real_on_step_result = sched.on_step_result

    def on_step_result(result: worker_pb2.StepResult) -> list[RequestEvent]:
        events = real_on_step_result(result)
        used = {ev.req_id for ev in events if ev.token_ids}
        for req_id, res in result_rows(result).items():
            if req_id in used and res.num_draft_tokens > 0:
                applied["drafts"] += 1
                applied["draft_tokens"] += res.num_draft_tokens
                applied["accepted"] += res.num_accepted
                applied_per_pos.extend([0] * (res.num_accepted - len(applied_per_pos)))
                for pos in range(res.num_accepted):
                    applied_per_pos[pos] += 1
        return events

    sched.on_step_result = on_step_result  # type: ignore[method-assign]
    num_results = [0]

    def abort_some(s: Scheduler, events: Sequence[RequestEvent]) -> None:
        # Abort a running request mid-speculation every few results (its rows are in flight).
        num_results[0] += 1
        running = [r for r in s.running_requests() if r.num_output_tokens > 2]
        if num_results[0] % 7 == 0 and running:
            s.abort_request(running[0].req_id)

    drive(sched, case.worker, 3, after_result=abort_some)
    c, w = sched.stats, case.worker.stats
    assert c.num_preemptions > 0 and c.num_stale_results > 0
    assert applied["drafts"] > 0
    c = sched.stats.spec
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (
        applied["drafts"],
        applied["draft_tokens"],
        applied["accepted"],
    )
    assert c.accepted_per_pos == applied_per_pos
    assert c.num_draft_tokens >= c.num_accepted_tokens
    assert w.num_draft_tokens > c.num_draft_tokens  # the stale rows were really excluded
    assert sched.block_pool.num_used == 0


# ---------------------------------------------------------------------------- limits


@pytest.mark.parametrize("window", [1, 3])
def test_no_token_past_max_tokens_or_model_length(window: int) -> None:
    rng = random.Random(3)
    stopping = {f"r{i}": StoppingOptions(max_tokens=rng.choice([1, 2, 3, 5, 9, None])) for i in range(12)}
    case = make_case(
        num_requests=12, stopping=stopping, max_model_len=40, num_spec_tokens=4, eos_per_mille=0, prompt_len=(5, 36)
    )
    got = drive(case.scheduler, case.worker, window)
    for req_id, out in got.items():
        limit = case.stopping[req_id].max_tokens
        room = 40 - len(case.prompts[req_id])
        assert len(out.token_ids) == min(limit or room, room)
        assert out.finish_reason == FINISH_MAX_TOKENS
    assert_matches_reference(case, got)


def test_no_draft_slots_that_could_not_be_verified() -> None:
    """The worker never gets a slot that could only produce a token past a limit."""
    seen: list[int] = []

    def after_plan(scheduler: Scheduler, plan: worker_pb2.StepPlan) -> None:
        for entry in plan_rows(plan):
            req = scheduler.get_request(entry.req_id)
            assert req is not None
            # After planning, confirmed + in-flight outputs never exceed the limit.
            assert req.num_pending_outputs <= req.max_tokens
            assert req.num_prompt_tokens + req.num_pending_outputs <= 24
            if not entry.token_ids:
                seen.append(entry.num_draft_slots)

    case = make_case(
        num_spec_tokens=6,
        stopping=StoppingOptions(max_tokens=5),
        max_model_len=24,
        prompt_len=(10, 20),
        eos_per_mille=0,
    )
    drive(case.scheduler, case.worker, 3, after_plan=after_plan)
    # The worker's own check (SimWorker.limits) held; trimmed slots were really scheduled.
    assert seen and min(seen) < 6


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("limit", [0, 2])
def test_drafts_stop_while_the_batch_is_large_and_come_back(window: int, limit: int) -> None:
    """`spec_disable_batch_size`: with as many running requests as the limit or more, every
    decode is planned without draft slots; below it (requests finished) drafts come back. The
    limit 0 never disables. Outputs are the model's either way."""
    max_tokens = {"r0": 6, "r1": 14, "r2": 40}
    stopping = {rid: StoppingOptions(max_tokens=n, ignore_eos=True) for rid, n in max_tokens.items()}
    case = make_case(
        num_requests=3, stopping=stopping, num_spec_tokens=3, spec_disable_batch_size=limit, eos_per_mille=0
    )
    scheduler = case.scheduler
    plans: list[tuple[int, list[int]]] = []  # (running requests before the plan, its decodes' draft slots)
    schedule = scheduler.schedule

    def logged_schedule() -> worker_pb2.StepPlan | None:
        running = scheduler.num_running()
        plan = schedule()
        if plan is not None:
            plans.append((running, [e.num_draft_slots for e in plan_rows(plan) if not e.token_ids]))
        return plan

    scheduler.schedule = logged_schedule  # type: ignore[method-assign]
    assert_matches_reference(case, drive(scheduler, case.worker, window))
    large = [slots for running, slots in plans if running >= 2 and slots]
    small = [slots for running, slots in plans if running < 2 and slots]
    assert large and small
    assert any(any(slots) for slots in small)  # drafts are back once one request is left
    assert any(any(slots) for slots in large) == (limit == 0)
    assert scheduler.stats.spec.num_accepted_tokens > 0


# ------------------------------------------------------------------------------ stops


def test_stop_strings_and_stop_token_ids_drop_later_tokens() -> None:
    stopping = {
        **{f"r{i}": StoppingOptions(max_tokens=40, stop=["cd", "x"]) for i in range(0, 4)},
        **{f"r{i}": StoppingOptions(max_tokens=40, stop_token_ids=[ord(".")]) for i in range(4, 8)},
        **{f"r{i}": StoppingOptions(max_tokens=40, stop=["é"]) for i in range(8, 10)},
    }
    case = make_case(stopping=stopping, num_spec_tokens=4, eos_per_mille=0)
    got = drive(case.scheduler, case.worker, 3)
    assert_matches_reference(case, got)
    reasons = [got[r].finish_reason for r in case.prompts]
    assert reasons.count(FINISH_STOP_SEQUENCE) >= 6
    for req_id in ("r0", "r1", "r2", "r3"):
        assert "cd" not in got[req_id].text and "x" not in got[req_id].text
    for req_id in ("r4", "r5", "r6", "r7"):
        out = got[req_id]
        if out.finish_reason == FINISH_STOP_SEQUENCE:
            assert out.token_ids[-1] == ord(".") and ord(".") not in out.token_ids[:-1]
            assert not out.text.endswith(".")


def test_min_tokens_ignores_eos_until_reached() -> None:
    stopping = StoppingOptions(max_tokens=30, min_tokens=12)
    case = make_case(stopping=stopping, eos_per_mille=150, num_spec_tokens=3)
    got = drive(case.scheduler, case.worker, 2)
    assert_matches_reference(case, got)
    early_eos = 0
    for out in got.values():
        assert len(out.token_ids) >= 12
        early_eos += EOS_ID in out.token_ids[:11]
        if out.finish_reason == FINISH_EOS:
            assert out.token_ids[-1] == EOS_ID
    assert early_eos > 0, "the scenario should produce EOS before min_tokens"


def test_ignore_eos() -> None:
    case = make_case(stopping=StoppingOptions(max_tokens=25, ignore_eos=True), eos_per_mille=150)
    got = drive(case.scheduler, case.worker, 2)
    assert_matches_reference(case, got)
    assert all(out.finish_reason == FINISH_MAX_TOKENS for out in got.values())
    assert any(EOS_ID in out.token_ids for out in got.values())


class _SpyTokenizer(Tokenizer):
    """Fails the test if the detokenizer/stop checks ever see a placeholder id."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        assert all(t >= 0 for t in token_ids), f"placeholder id in {list(token_ids)}"
        return super().decode(token_ids, skip_special_tokens)

    def stream_decoder(self, context_ids: Sequence[int], skip_special_tokens: bool = True):
        step = super().stream_decoder(context_ids, skip_special_tokens)

        def checked(token_id: int) -> str | None:
            assert token_id >= 0, f"placeholder id {token_id}"
            return step(token_id)

        return checked


def test_stop_checks_never_see_placeholder_ids() -> None:
    spy = _SpyTokenizer(make_toy_tokenizer_json())
    case = make_case(
        tokenizer=spy,
        num_spec_tokens=4,
        num_blocks=40,
        stopping=StoppingOptions(max_tokens=30, stop=["ab"], stop_token_ids=[ord(",")]),
    )
    got = drive(case.scheduler, case.worker, 3, after_result=check_request_counters)
    assert all(t >= 0 for out in got.values() for t in out.token_ids)
    assert case.scheduler.stats.num_preemptions > 0


def test_a_request_detokenized_by_its_front_gets_ids_only_and_no_stop_string_check() -> None:
    """`detokenize=False` (a front makes the text and finds the stop strings): events carry no
    text and a stop string ends nothing here; the tokens are those of the same requests with
    text, up to where their stop string ended them."""
    stopping = StoppingOptions(max_tokens=30, stop=["a"])
    with_text = make_case(stopping=stopping, eos_per_mille=0)
    ids_only = make_case(stopping=stopping, eos_per_mille=0, detokenize=False)
    got_text = drive(with_text.scheduler, with_text.worker, 2)
    got_ids = drive(ids_only.scheduler, ids_only.worker, 2)
    stopped = [
        r for r, out in got_text.items() if out.last_event and out.last_event.finish_reason == FINISH_STOP_SEQUENCE
    ]
    assert stopped, "no request met its stop string: the test proves nothing"
    for req_id, out in got_ids.items():
        assert out.text == "" and len(out.token_ids) == 30, req_id
        assert out.last_event is not None and out.last_event.finish_reason == FINISH_MAX_TOKENS
        assert out.token_ids[: len(got_text[req_id].token_ids)] == got_text[req_id].token_ids


def test_logprobs_are_aligned_with_accepted_tokens() -> None:
    case = make_case(logprobs=True, num_spec_tokens=4, num_blocks=50)
    got = drive(case.scheduler, case.worker, 3)
    for req_id, out in got.items():
        prompt_len = len(case.prompts[req_id])
        assert out.logprobs == [toy_logprob(prompt_len + i) for i in range(len(out.token_ids))]
    assert case.scheduler.stats.num_preemptions > 0


# -------------------------------------------------------------- finish / abort in flight


def test_finish_with_steps_in_flight_loses_and_duplicates_nothing() -> None:
    case = make_case(num_spec_tokens=3, eos_per_mille=60, stopping=StoppingOptions(max_tokens=60))
    got = drive(case.scheduler, case.worker, 3)  # `collect` asserts no event after finish
    assert_matches_reference(case, got)
    assert case.scheduler.stats.num_stale_results > 0
    for _req_id, out in got.items():
        assert out.last_event is not None
        assert out.last_event.num_output_tokens == len(out.token_ids)
    assert case.scheduler.block_pool.num_used == 0


def test_notice_plans_when_a_step_in_flight_is_all_finished_or_none_is_in_flight() -> None:
    """`notice_plan` (what the worker link sends when nothing is to run): it carries the finish
    notices alone, only while some step in flight has nothing but finished rows or no step is in
    flight, and changes no output."""
    # One request at a time (max_num_seqs=1): each EOS leaves steps in flight with only its row.
    case = make_case(num_spec_tokens=3, eos_per_mille=60, stopping=StoppingOptions(max_tokens=60), max_num_seqs=1)
    notice_plans: list[worker_pb2.StepPlan] = []

    def after_plan(scheduler: Scheduler, plan: worker_pb2.StepPlan) -> None:
        if not plan_rows(plan):
            notice_plans.append(plan)
            assert plan.finished_req_ids

    got = drive(case.scheduler, case.worker, 3, after_plan=after_plan, notices=True)
    assert_matches_reference(case, got)
    assert notice_plans, "no request ended alone with a step in flight: the test exercises nothing"
    assert case.scheduler.block_pool.num_used == 0

    # A step in flight that still has a live row gets no notice plan: its result is needed.
    scheduler = make_case(num_requests=0, num_spec_tokens=0, eos_per_mille=0).scheduler
    scheduler.add_request("a", [5, 6, 7], SamplingOptions(seed=1), StoppingOptions(max_tokens=50))
    scheduler.add_request("b", [8, 9, 10], SamplingOptions(seed=2), StoppingOptions(max_tokens=50))
    first = scheduler.schedule()
    assert first is not None and len(plan_rows(first)) == 2
    assert scheduler.notice_plan() is None  # nothing has finished
    assert scheduler.abort_request("a") is not None
    assert scheduler.notice_plan() is None  # the step in flight still runs b
    assert scheduler.abort_request("b") is not None
    notice = scheduler.notice_plan()
    assert notice is not None and not plan_rows(notice)
    assert notice.step_id > first.step_id and set(notice.finished_req_ids) == {"a", "b"}
    assert scheduler.notice_plan() is None  # the notices went out once
    assert scheduler.on_step_result(worker_pb2.StepResult(step_id=first.step_id)) == []
    assert scheduler.on_step_result(worker_pb2.StepResult(step_id=notice.step_id)) == []
    assert not scheduler.has_unfinished() and scheduler.num_inflight_steps() == 0

    # Nothing in flight: a finish notice goes out at once, not with the next request's plan.
    scheduler.add_request("c", [5, 6, 7], SamplingOptions(seed=3), StoppingOptions(max_tokens=50))
    third = scheduler.schedule()
    assert third is not None and scheduler.notice_plan() is None  # c runs in the step in flight
    # An answer without c's row ends c (with an error); then nothing is in flight.
    events = scheduler.on_step_result(worker_pb2.StepResult(step_id=third.step_id))
    assert [e.req_id for e in events if e.finish_reason is not None] == ["c"]
    assert scheduler.num_inflight_steps() == 0
    alone = scheduler.notice_plan()
    assert alone is not None and not plan_rows(alone) and list(alone.finished_req_ids) == ["c"]
    assert scheduler.notice_plan() is None


def test_abort_with_steps_in_flight() -> None:
    case = make_case(num_spec_tokens=3, stopping=StoppingOptions(max_tokens=60), eos_per_mille=0)
    aborted: dict[str, RequestEvent] = {}
    streamed: dict[str, list[int]] = {}

    def after_result(scheduler: Scheduler, events: list[RequestEvent]) -> None:
        for ev in events:
            assert ev.req_id not in aborted, "event after abort"
            streamed.setdefault(ev.req_id, []).extend(ev.token_ids)
            if ev.req_id in ("r1", "r4", "r7") and ev.finish_reason is None and (len(streamed[ev.req_id]) >= 5):
                final = scheduler.abort_request(ev.req_id)
                assert final is not None and final.finish_reason == FINISH_CANCELLED
                aborted[ev.req_id] = final
                assert scheduler.abort_request(ev.req_id) is None
        check_request_counters(scheduler)

    # Abort one request while it is still waiting too.
    case.scheduler.add_request("waiting", [1, 2, 3], SamplingOptions(seed=1))
    assert case.scheduler.abort_request("waiting") is not None
    got = drive(case.scheduler, case.worker, 3, after_result=after_result)
    assert set(aborted) == {"r1", "r4", "r7"}
    for req_id, out in got.items():
        expected = reference_generate(
            TOY,
            case.prompts[req_id],
            case.seeds[req_id],
            case.stopping[req_id],
            max_model_len=case.max_len,
            eos_per_mille=0,
        )
        if req_id in aborted:
            # What was streamed before the abort is a prefix of the true output, and the
            # abort's own final event (returned by abort_request) ended the stream.
            assert out.finish_reason is None
            assert aborted[req_id].num_output_tokens == len(out.token_ids)
            assert out.token_ids == expected.token_ids[: len(out.token_ids)]
        else:
            assert out.token_ids == expected.token_ids
    assert case.scheduler.stats.num_stale_results > 0
    assert case.scheduler.block_pool.num_used == 0
    # The worker was told to forget every aborted request.
    dropped = {r for plan in case.worker.plans for r in plan.finished_req_ids}
    assert set(aborted) <= dropped


# ------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("window", [1, 2, 3])
def test_preemption_with_chunked_prefill_and_steps_in_flight(window: int) -> None:
    """Tiny KV budget, long prompts split over steps, results late: outputs unchanged."""
    case = make_case(
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=10,
        num_spec_tokens=3,
        prompt_len=(15, 40),
        stopping=StoppingOptions(max_tokens=30),
        max_model_len=96,
        num_requests=8,
    )
    got = drive(
        case.scheduler,
        case.worker,
        window,
        after_result=check_request_counters,
        after_plan=lambda s, p: check_request_counters(s),
    )
    assert_matches_reference(case, got)
    c = case.scheduler.stats
    assert c.num_preemptions > 0
    assert case.worker.stats.num_resumed > 0
    if window > 1:
        assert c.num_stale_results > 0
    assert case.scheduler.block_pool.num_used == 0


def test_new_resumed_and_skipped_requests_never_get_stale_drafts() -> None:
    """Every decode input is [true last token, drafts proposed after it, fillers]; never -1.

    SimWorker asserts it on each decode row; here we make sure the risky situations (decode
    right after admission, after resumption, after sitting out a plan) really happened.
    """
    case = make_case(
        num_blocks=24,
        max_num_batched_tokens=9,
        num_spec_tokens=4,
        prompt_len=(8, 30),
        stopping=StoppingOptions(max_tokens=30),
        max_model_len=96,
        num_requests=10,
    )
    got = drive(case.scheduler, case.worker, 3, after_result=check_request_counters)
    assert_matches_reference(case, got)
    s = case.worker.stats
    assert s.num_decode_rows_after_new > 0
    assert s.num_decode_rows_after_resume > 0
    assert s.num_decode_rows_after_skip > 0
    assert s.num_filled_draft_slots > 0


def test_block_reused_by_a_plan_is_only_written_by_its_new_owner_from_then_on() -> None:
    """A block freed in plan N (finish/abort/preempt) may be reused from plan N+1 on.

    From the worker's write log: every write to a block comes from the request incarnation
    the block was most recently handed to, at or before that step — so an in-flight step of
    the previous owner never writes a block after it changed hands.
    """
    case = make_case(
        num_blocks=24,
        max_num_batched_tokens=10,
        num_spec_tokens=3,
        prompt_len=(15, 40),
        stopping=StoppingOptions(max_tokens=30),
        max_model_len=96,
        num_requests=8,
        eos_per_mille=40,
    )
    drive(case.scheduler, case.worker, 3)
    # Hand-overs of fresh (non-shared) blocks, in step order.
    handovers: dict[int, list[tuple[int, tuple[str, int]]]] = {}
    incarnation: dict[str, int] = {}
    block_size = case.scheduler.config.block_size
    for plan in case.worker.plans:
        for entry in plan_rows(plan):
            if entry.is_new:
                incarnation[entry.req_id] = plan.step_id
            fresh = entry.new_block_ids[entry.num_cached_tokens // block_size :]
            for block_id in fresh:
                handovers.setdefault(block_id, []).append((plan.step_id, (entry.req_id, incarnation[entry.req_id])))
    num_reused = sum(1 for h in handovers.values() if len(h) > 1)
    assert num_reused > 0
    for write in case.worker.writes:
        owner = None
        for step_id, who in handovers[write.block_id]:
            if step_id <= write.step_id:
                owner = who
        assert owner == (write.req_id, write.incarnation), (
            f"step {write.step_id}: {write.req_id} wrote block {write.block_id} owned by {owner}"
        )


def test_preempted_request_resumes_with_prompt_plus_confirmed_outputs() -> None:
    case = make_case(
        num_blocks=20,
        max_num_batched_tokens=64,
        num_spec_tokens=2,
        prompt_len=(20, 30),
        stopping=StoppingOptions(max_tokens=30),
        max_model_len=80,
        num_requests=4,
        eos_per_mille=0,
        enable_prefix_caching=False,
    )
    resumed_prefills: list[tuple[str, int]] = []

    def after_plan(scheduler: Scheduler, plan: worker_pb2.StepPlan) -> None:
        for entry in plan_rows(plan):
            req = scheduler.get_request(entry.req_id)
            if entry.is_new and req is not None and req.num_preemptions:
                assert req.num_prefill_tokens == req.num_tokens
                assert list(entry.token_ids) == req.all_token_ids()[: len(entry.token_ids)]
                resumed_prefills.append((entry.req_id, req.num_output_tokens))

    got = drive(case.scheduler, case.worker, 2, after_plan=after_plan)
    assert_matches_reference(case, got)
    assert any(num_outputs > 0 for _, num_outputs in resumed_prefills)


@settings(max_examples=200, deadline=None)
@given(
    num_prompt=st.integers(1, 12),
    num_output=st.integers(0, 12),
    bounds=st.tuples(st.integers(0, 24), st.integers(0, 24)),
)
def test_token_ids_between_is_the_slice_of_the_whole_sequence(
    num_prompt: int, num_output: int, bounds: tuple[int, int]
) -> None:
    req = Request(
        req_id="r",
        prompt_token_ids=list(range(100, 100 + num_prompt)),
        sampling=SamplingOptions(),
        stopping=StoppingOptions(max_tokens=32),
        max_tokens=32,
        eos_token_ids=frozenset(),
        detokenizer=None,  # type: ignore[arg-type]  # not read here
        arrival_time=0.0,
        output_token_ids=list(range(500, 500 + num_output)),
    )
    start, stop = min(bounds), max(bounds)
    assert req.token_ids_between(start, stop) == req.all_token_ids()[start:stop]


# ------------------------------------------------------------------------ prefix cache


def test_prefix_cache_same_outputs_with_and_without() -> None:
    rng = random.Random(11)
    system = [rng.choice(b"abcxyz ") for _ in range(37)]
    prompts = {f"r{i}": system + [rng.choice(b"abc") for _ in range(rng.randint(1, 9))] for i in range(8)}
    outs = {}
    for enable in (False, True):
        case = make_case(prompts=dict(prompts), enable_prefix_caching=enable, num_blocks=60)
        outs[enable] = drive(case.scheduler, case.worker, 3)
        assert_matches_reference(case, outs[enable])
        counters = case.scheduler.prefix_cache_counters
        if enable:
            assert counters.num_hit_tokens > 0 and case.worker.stats.num_cached_tokens > 0
            assert counters.num_query_tokens >= counters.num_hit_tokens
            events = [o.last_event for o in outs[enable].values()]
            assert any(ev is not None and ev.num_cached_tokens > 0 for ev in events)
        else:
            assert counters.num_hit_tokens == 0 and case.worker.stats.num_cached_tokens == 0
    assert {r: o.token_ids for r, o in outs[False].items()} == {r: o.token_ids for r, o in outs[True].items()}


def test_prefix_cache_registers_only_confirmed_written_blocks() -> None:
    """A follow-up turn that contains another request's output hits only confirmed blocks.

    The first request runs with speculation and results late, so optimistic slots exist past
    its confirmed tokens. After every result, each registered block of a running request
    lies entirely before its newest token (whose K/V the next step writes).
    """
    case = make_case(
        num_requests=1, prompt_len=(9, 9), stopping=StoppingOptions(max_tokens=40), eos_per_mille=0, num_spec_tokens=4
    )
    scheduler = case.scheduler
    [(first_id, first_prompt)] = case.prompts.items()
    expected = reference_generate(
        TOY, first_prompt, case.seeds[first_id], case.stopping[first_id], max_model_len=case.max_len, eos_per_mille=0
    )
    follow_up = first_prompt + expected.token_ids[:30] + list(b" more")
    added = False

    def after_result(s: Scheduler, events: list[RequestEvent]) -> None:
        nonlocal added
        block_size = s.config.block_size
        for req in s.running_requests():
            # Confirmed tokens with K/V written: all but the newest, or the scheduled prefill.
            limit = req.num_computed if req.is_prefilling else req.num_tokens - 1
            for i, block_id in enumerate(req.block_ids):
                if s.block_pool.hash_of(block_id) is not None:
                    assert (i + 1) * block_size <= limit, f"{req.req_id}: block {i} cached early"
        first = s.get_request(first_id)
        if not added and first is not None and first.num_output_tokens >= 20:
            s.add_request("follow", follow_up, SamplingOptions(seed=77), StoppingOptions(max_tokens=10))
            case.worker.limits["follow"] = (len(follow_up), 10)
            added = True

    got = drive(scheduler, case.worker, 3, after_result=after_result)
    assert added
    assert got[first_id].token_ids == expected.token_ids
    follow_expected = reference_generate(
        TOY, follow_up, 77, StoppingOptions(max_tokens=10), max_model_len=case.max_len, eos_per_mille=0
    )
    assert got["follow"].token_ids == follow_expected.token_ids
    num_cached = got["follow"].last_event.num_cached_tokens  # type: ignore[union-attr]
    # Its prompt shared the first request's blocks, but only ones confirmed at the time.
    assert 0 < num_cached < len(follow_up)


def test_identical_prompt_recomputes_its_last_block() -> None:
    """A fully cached prompt still computes the block holding its last token (never shared)."""
    prompt = list(b"abcdefgh")  # exactly two blocks
    case = make_case(prompts={"a": prompt}, stopping=StoppingOptions(max_tokens=12), eos_per_mille=0)
    added: list[bool] = []

    def after_result(s: Scheduler, events: list[RequestEvent]) -> None:
        if not added and any(ev.token_ids for ev in events):
            s.add_request("b", prompt, SamplingOptions(seed=case.seeds["a"]), StoppingOptions(max_tokens=12))
            added.append(True)

    got = drive(case.scheduler, case.worker, 2, after_result=after_result)
    assert got["b"].token_ids == got["a"].token_ids
    assert got["b"].last_event is not None and got["b"].last_event.num_cached_tokens == 4
    new_b = [e for p in case.worker.plans for e in plan_rows(p) if e.req_id == "b" and e.is_new]
    assert [list(e.token_ids) for e in new_b] == [list(b"efgh")]


def test_blocks_of_a_failed_prefill_chunk_are_never_cached() -> None:
    """Only chunks whose results came back are registered; a failed step writes nothing."""
    prompt = list(b"abcdefghijklmnopqrstuvwx")  # 24 tokens: three chunks of 8
    case = make_case(prompts={"a": prompt}, max_num_batched_tokens=8, eos_per_mille=0)
    case.worker.fail_step_ids.add(3)  # the sampling chunk
    got = drive(case.scheduler, case.worker, 3)
    assert got["a"].finish_reason == FINISH_ERROR
    case.scheduler.add_request("b", prompt + [ord("!")], SamplingOptions(seed=5))
    got = drive(case.scheduler, case.worker, 3)  # SimWorker asserts hits are written content
    assert got["b"].last_event is not None and got["b"].last_event.num_cached_tokens == 16


def test_the_most_recently_admitted_request_is_preempted_first() -> None:
    case = make_case(
        prompts={"old": [97] * 10, "new": [98] * 10},
        num_blocks=12,
        stopping=StoppingOptions(max_tokens=30),
        eos_per_mille=0,
    )
    old, new = case.scheduler.get_request("old"), case.scheduler.get_request("new")
    assert old is not None and new is not None
    got = drive(case.scheduler, case.worker, 2)
    assert_matches_reference(case, got)
    assert old.num_preemptions == 0 and new.num_preemptions > 0


# -------------------------------------------------------------------- admission / errors


def test_add_request_validation_and_queue_limit() -> None:
    config = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32, max_waiting=2)
    scheduler = Scheduler(config, TOY)
    bad: list[tuple[list[int], dict[str, Any]]] = [
        ([], {}),
        ([999], {}),
        ([1] * 32, {}),
        ([1], {"temperature": -1.0}),
        ([1], {"temperature": float("nan")}),
        ([1], {"top_p": 0.0}),
        ([1], {"top_k": -1}),
        ([1], {"seed": 2**64}),
        ([1], {"max_tokens": 0}),
        ([1], {"max_tokens": 2, "min_tokens": 3}),
        ([1], {"stop": [""]}),
        ([1], {"stop_token_ids": [-1]}),
    ]
    for prompt, kwargs in bad:
        with pytest.raises(ValueError):
            scheduler.add_request("x", prompt, *split_options(kwargs))
    with pytest.raises(ValueError, match="stopping.max_tokens: 1000 exceeds the model length 32"):
        scheduler.add_request("x", [1, 2], None, StoppingOptions(max_tokens=1000))
    first = scheduler.add_request("a", [1, 2], None, StoppingOptions(max_tokens=32))
    assert first.max_tokens == 30  # capped by what fits after the prompt
    assert first.sampling.seed is not None  # every request is keyed
    with pytest.raises(ValueError):
        scheduler.add_request("a", [1])
    scheduler.add_request("b", [1])
    with pytest.raises(QueueFullError):
        scheduler.add_request("c", [1])
    assert scheduler.num_waiting() == 2 and scheduler.num_unfinished() == 2


def test_first_entry_after_admission_is_new_with_sampling_and_full_table() -> None:
    config = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=6, num_spec_tokens=2)
    scheduler = Scheduler(config, TOY)
    scheduler.add_request("a", list(b"hello world"), SamplingOptions(seed=3, temperature=0.5))
    plan = scheduler.schedule()
    assert plan is not None and plan.step_id == 1
    [entry] = plan_rows(plan)
    assert entry.is_new and entry.sampling.seed == 3 and entry.sampling.temperature == 0.5
    assert list(entry.token_ids) == list(b"hello ") and not entry.sample
    assert len(entry.new_block_ids) == 2
    plan = scheduler.schedule()  # next chunk while the first is in flight
    assert plan is not None
    [entry] = plan_rows(plan)
    assert not entry.is_new and entry.sampling is None
    assert list(entry.token_ids) == list(b"world") and entry.sample
    assert len(entry.new_block_ids) == 1
    plan = scheduler.schedule()  # a decode, still without any result back
    assert plan is not None
    [entry] = plan_rows(plan)
    assert not entry.token_ids and entry.num_draft_slots == 2
    req = scheduler.get_request("a")
    assert req is not None
    assert (req.num_computed, req.num_placeholders) == (11 + 3, 1 + 3)


def test_worker_step_error_finishes_its_requests_with_error() -> None:
    config = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64)
    scheduler = Scheduler(config, TOY)
    scheduler.add_request("a", [1, 2, 3])
    plan = scheduler.schedule()
    assert plan is not None
    events = scheduler.on_step_result(worker_pb2.StepResult(step_id=plan.step_id, error="boom"))
    assert [e.finish_reason for e in events] == [FINISH_ERROR]
    assert "boom" in events[0].error
    assert not scheduler.has_unfinished() and scheduler.block_pool.num_used == 0
    scheduler.add_request("b", [1, 2, 3])
    next_plan = scheduler.schedule()
    assert next_plan is not None and list(next_plan.finished_req_ids) == ["a"]


def test_malformed_result_is_an_error_not_a_crash() -> None:
    config = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64)
    scheduler = Scheduler(config, TOY)
    scheduler.add_request("a", [1, 2, 3])
    plan = scheduler.schedule()
    assert plan is not None
    result = worker_pb2.StepResult(step_id=plan.step_id)
    rows = ResultBuilder()
    rows.add("a", [5, 6])  # two tokens for a prefill sample
    rows.write(result)
    [event] = scheduler.on_step_result(result)
    assert event.finish_reason == FINISH_ERROR
    assert scheduler.on_step_result(result) == []  # unknown (already answered) step
    assert scheduler.get_request("a") is None


def test_missing_worker_fields_are_rejected_and_filled_by_with_worker() -> None:
    policy = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(policy, TOY)
    info = worker_pb2.WorkerInfo(
        num_blocks=10,
        block_size=16,
        max_model_len=2048,
        num_spec_tokens=3,
        eos_token_ids=[EOS_ID],
        vocab_size=300,
        max_num_seqs=32,
    )
    config = policy.with_worker(info)
    assert (config.num_blocks, config.block_size, config.max_model_len) == (10, 16, 2048)
    assert (config.num_spec_tokens, config.eos_token_ids, config.max_num_seqs) == (3, (EOS_ID,), 32)
    scheduler = Scheduler(config, TOY)
    # The model's vocabulary (not the tokenizer's) bounds prompt ids; the cache bounds length.
    assert scheduler.add_request("a", [299, 1]).max_tokens == 10 * 16 - 2


def test_lost_worker_requests_move_to_another_scheduler_unchanged() -> None:
    """`take_unfinished` + `adopt`: resumption elsewhere from the confirmed tokens only."""
    case = make_case(num_spec_tokens=3, stopping=StoppingOptions(max_tokens=40))
    first = case.scheduler
    got: dict[str, Collected] = {}
    inflight: list[worker_pb2.StepResult] = []
    for _ in range(12):
        plan = first.schedule()
        assert plan is not None
        inflight.append(case.worker.execute(plan))
        if len(inflight) == 3:
            collect(got, first.on_step_result(inflight.pop(0)))
    # The worker dies with two steps in flight; their results never arrive.
    moved = first.take_unfinished()
    assert not first.has_unfinished() and first.block_pool.num_used == 0
    assert first.num_inflight_steps() == 0
    done = {r for r, out in got.items() if out.finish_reason is not None}
    assert {r.req_id for r in moved} == set(case.prompts) - done
    assert any(r.num_output_tokens > 0 for r in moved)
    second = make_case(prompts={})
    for req in moved:
        second.scheduler.adopt(req)
        second.worker.limits[req.req_id] = case.worker.limits[req.req_id]
    for req_id, out in drive(second.scheduler, second.worker, 2).items():
        streamed = got.setdefault(req_id, Collected())
        assert streamed.finish_reason is None
        streamed.token_ids += out.token_ids
        streamed.text += out.text
        streamed.finish_reason = out.finish_reason
    assert_matches_reference(case, got)


def test_cached_prefix_blocks_counts_without_taking_references() -> None:
    case = make_case(prompts={"a": list(b"abcdefghijkl")}, stopping=StoppingOptions(max_tokens=5), eos_per_mille=0)
    drive(case.scheduler, case.worker, 2)
    assert case.scheduler.cached_prefix_blocks(list(b"abcdefghXXXX")) == 2
    assert case.scheduler.cached_prefix_blocks(list(b"abcdefghijklmnop")) == 3
    assert case.scheduler.block_pool.num_used == 0


# ------------------------------------------------------------------- predicted outputs


def test_a_predicted_output_gets_its_own_draft_budget() -> None:
    """A request with a prediction gets up to the worker's `num_prediction_tokens` draft slots
    even with no proposer; the budget stays at the limit while its prediction drafts are all
    accepted, falls to one more than were accepted, halves when the prediction gave no draft,
    never below a quarter of the limit;
    its accepted and rejected drafts are counted apart from the proposer's and reach its
    events. A request without a prediction gets no draft slot."""
    config = SchedulerConfig(
        num_blocks=64, block_size=4, max_model_len=200, num_spec_tokens=0, num_prediction_tokens=8, vocab_size=64
    )
    scheduler = Scheduler(config, Tokenizer(make_toy_tokenizer_json()))
    options = {"max_tokens": 100, "ignore_eos": True}
    scheduler.add_request("p", [1, 2, 3], *split_options({**options, "prediction_token_ids": [5] * 40}))
    scheduler.add_request("q", [1, 2, 3], *split_options(options))

    def answer(tokens: list[int], drafts: int = 0, predicted: bool = False) -> tuple[dict[str, int], dict]:
        """Run the next plan (sync): ``p`` gets ``tokens`` after ``drafts`` verified drafts,
        ``q`` one token; the plan's draft slots per decode row and the events."""
        plan = scheduler.schedule()
        assert plan is not None
        slots = {row.req_id: row.num_draft_slots for row in plan_rows(plan) if not row.token_ids}
        result = worker_pb2.StepResult(step_id=plan.step_id)
        rows = ResultBuilder()
        rows.add("p", tokens, drafts, prediction_drafts=predicted)
        rows.add("q", [5])
        rows.write(result)
        return slots, {ev.req_id: ev for ev in scheduler.on_step_result(result)}

    answer([5])  # the prefills
    slots, _ = answer([5] * 9, 8, True)  # all 8 accepted: the budget stays at the limit
    assert slots == {"p": 8, "q": 0}
    slots, _ = answer([5] * 4, 8, True)  # 3 of 8 accepted
    assert slots == {"p": 8, "q": 0}
    slots, events = answer([5], 3, False)  # the proposer's drafts
    assert slots == {"p": 4, "q": 0}
    assert events["p"].prediction == (11, 5) and events["q"].prediction is None
    slots, _ = answer([5])
    assert slots == {"p": 2, "q": 0}
    slots, _ = answer([5])
    assert slots == {"p": 2, "q": 0}  # a quarter of the limit
    stats = scheduler.stats
    assert (stats.prediction.num_draft_tokens, stats.prediction.num_accepted_tokens) == (16, 11)
    assert (stats.spec.num_draft_tokens, stats.spec.num_accepted_tokens) == (3, 0)
