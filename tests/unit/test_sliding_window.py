"""Sliding-window block release in the scheduler (`scheduler_svc/window.py`).

Each test drives the real `Scheduler` against `SimWorker` told the window: the worker checks
that every key a query may attend (the last ``window`` positions) is the request's own, and
that no block is handed to or written by a request while another one may still read it.
"""

from __future__ import annotations

import random

import pytest

from tests.support.sim_worker import Case, assert_matches_reference, drive, make_case
from zerobubble.api import worker_pb2
from zerobubble.config import SchedulerConfig
from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.rows import plan_rows
from zerobubble.scheduler_svc.scheduler import Scheduler
from zerobubble.scheduler_svc.window import num_blocks_behind

WINDOW = 8
BLOCK_SIZE = 4


def _long_case(**overrides: object) -> Case:
    """Requests that generate well past the window."""
    fields: dict = dict(
        num_requests=6,
        prompt_len=(5, 30),
        stopping=StoppingOptions(max_tokens=120),
        block_size=BLOCK_SIZE,
        max_model_len=256,
        num_blocks=200,
        eos_per_mille=0,
        sliding_window=WINDOW,
    )
    fields.update(overrides)
    return make_case(**fields)  # type: ignore[arg-type]


def _held(req_block_ids: list[int], num_freed: int) -> int:
    return len(req_block_ids) - num_freed


def test_num_blocks_behind() -> None:
    assert num_blocks_behind(100, 0, 4) == 0  # full attention frees nothing
    assert num_blocks_behind(7, 8, 4) == 0  # the query at 7 sees 0..7
    assert num_blocks_behind(11, 8, 4) == 1  # sees 4..11: block 0 (0..3) is behind
    assert num_blocks_behind(12, 8, 4) == 1  # sees 5..12: block 1 holds 5
    assert num_blocks_behind(15, 8, 4) == 2  # sees 8..15


@pytest.mark.parametrize("in_flight", [1, 2, 3])
@pytest.mark.parametrize("num_spec_tokens", [0, 3])
def test_a_request_past_its_window_holds_a_bounded_number_of_blocks(in_flight: int, num_spec_tokens: int) -> None:
    """Outputs are unchanged; a decoding request holds the blocks of its window, its drafts
    in flight and this step's slots, whatever its length; the pool's used blocks are the
    running requests' held ones."""
    case = _long_case(num_spec_tokens=num_spec_tokens)
    most_held = 0

    def after_plan(scheduler: Scheduler, plan: worker_pb2.StepPlan) -> None:
        nonlocal most_held
        decoding = {row.req_id for row in plan_rows(plan) if not row.token_ids}
        held_total = 0
        for req in scheduler.running_requests():
            held = _held(req.block_ids, req.num_freed_blocks)
            held_total += held
            if req.req_id in decoding and req.num_output_tokens > 0:  # no prefill chunk in flight
                # The window, the slots of the steps in flight (their blocks are freed once
                # their results are back, for the prefix cache) and the block being written.
                bound = -(-(in_flight * (1 + num_spec_tokens) + WINDOW) // BLOCK_SIZE) + 1
                assert held <= bound, (req.req_id, held, bound, req.num_computed)
                most_held = max(most_held, held)
        assert scheduler.block_pool.num_used == held_total
        scheduler.block_pool.check_invariants()

    got = drive(case.scheduler, case.worker, in_flight, after_plan=after_plan)
    assert_matches_reference(case, got)
    assert all(len(out.token_ids) == 120 for out in got.values())
    assert 0 < most_held <= -(-WINDOW // BLOCK_SIZE) + 1 + -(-(in_flight * (num_spec_tokens + 1)) // BLOCK_SIZE)
    # Everything was given back (finished requests free what they still held).
    assert case.scheduler.block_pool.num_used == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_optimistic_counts_never_free_a_block_still_in_the_window(prefix_caching: bool) -> None:
    """With drafts in flight the scheduler counts them as accepted; the blocks it frees are
    behind the window of the position the worker really is at (some drafts are rejected).
    Without prefix caching blocks are freed without waiting for their step's result."""
    # Few blocks: freed ones are soon reused, and the worker checks every key a query reads.
    case = _long_case(num_spec_tokens=4, num_blocks=60, enable_prefix_caching=prefix_caching)
    checked = 0

    def after_plan(scheduler: Scheduler, _plan: worker_pb2.StepPlan) -> None:
        nonlocal checked
        for req in scheduler.running_requests():
            written = case.worker.written_length(req.req_id)
            if written is None or req.num_freed_blocks == 0:
                continue
            # Before this plan runs the worker is at `written`; its first query attends from
            # written - window + 1 on, which must lie past every freed block.
            assert req.num_freed_blocks * BLOCK_SIZE <= written - WINDOW + 1, (req.req_id, written)
            checked += 1

    got = drive(case.scheduler, case.worker, 3, after_plan=after_plan)
    assert_matches_reference(case, got)
    assert checked > 0
    assert case.scheduler.stats.num_rolled_back_tokens > 0  # rejections really moved positions back


def test_long_requests_no_longer_preempt_each_other() -> None:
    """A cache far smaller than the requests' lengths serves them all at once: each needs its
    window only. Without the window the same cache preempts."""
    fields: dict = dict(num_blocks=40, num_spec_tokens=2, max_num_batched_tokens=32)
    windowed = _long_case(**fields)
    got = drive(windowed.scheduler, windowed.worker, 2)
    assert_matches_reference(windowed, got)
    assert windowed.scheduler.stats.num_preemptions == 0
    full = _long_case(sliding_window=0, stopping=StoppingOptions(max_tokens=120), **fields)
    drive(full.scheduler, full.worker, 2)
    assert full.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("in_flight", [1, 3])
def test_preemption_and_resumption_past_the_window(in_flight: int) -> None:
    """A cache too small for the batch's windows preempts; resumed requests recompute prompt +
    outputs chunk by chunk, freeing behind the window as they go; outputs are unchanged."""
    case = _long_case(num_requests=8, num_blocks=14, num_spec_tokens=3, max_num_batched_tokens=16)
    got = drive(case.scheduler, case.worker, in_flight)
    assert_matches_reference(case, got)
    assert case.scheduler.stats.num_preemptions > 0
    assert case.worker.stats.num_resumed > 0


def test_freed_blocks_stay_in_the_prefix_cache_and_hits_read_intact_blocks() -> None:
    """Blocks freed behind the window keep their prefix-cache entry; a later request with the
    same prompt hits them (the worker checks that what it reads is that prompt's K/V)."""
    prompt = [ord(c) for c in "the quick brown fox jumps over the lazy dog " * 2]
    case = _long_case(prompts={"first": prompt}, num_blocks=80)
    drive(case.scheduler, case.worker, 2)
    pool = case.scheduler.block_pool
    assert pool.num_used == 0 and pool.num_cached > len(prompt) // BLOCK_SIZE
    scheduler = case.scheduler
    scheduler.add_request("second", prompt, SamplingOptions(seed=case.seeds["first"]), StoppingOptions(max_tokens=5))
    plan = scheduler.schedule()
    assert plan is not None
    (row,) = plan_rows(plan)
    assert row.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    case.worker.execute(plan)  # the worker rebuilds the cached prefix from the K/V and checks it
    second = scheduler.get_request("second")
    assert second is not None
    # The hit's blocks behind the window were given back at once (they stay cached).
    assert second.num_freed_blocks == num_blocks_behind(row.num_cached_tokens, WINDOW, BLOCK_SIZE) > 0
    pool.check_invariants()


def test_requests_reading_their_whole_context_keep_their_blocks() -> None:
    """Penalties count every token of the context from the token pages that follow the KV
    blocks; such a request keeps its blocks (a request without them beside it does not)."""
    case = _long_case(num_requests=1, num_spec_tokens=0)
    scheduler = case.scheduler
    scheduler.add_request(
        "penalised", [1, 2, 3], SamplingOptions(repetition_penalty=1.3), StoppingOptions(max_tokens=60)
    )
    for _ in range(30):
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.on_step_result(case.worker.execute(plan))
    penalised, plain = scheduler.get_request("penalised"), scheduler.get_request("r0")
    assert penalised is not None and plain is not None
    assert penalised.num_freed_blocks == 0 and plain.num_freed_blocks > 0


def test_the_worker_given_window_reaches_the_config() -> None:
    info = worker_pb2.WorkerInfo(num_blocks=8, block_size=4, max_model_len=32, sliding_window=16)
    assert SchedulerConfig().with_worker(info).sliding_window == 16
    assert SchedulerConfig().with_worker(worker_pb2.WorkerInfo(num_blocks=8)).sliding_window == 0


@pytest.mark.parametrize(
    ("window", "block_size", "num_blocks", "num_spec_tokens", "in_flight", "prefix_caching"),
    [
        (4, 4, 12, 0, 1, True),  # a window of one block
        (5, 4, 12, 4, 3, False),  # a window across block boundaries, blocks freed before results
        (13, 5, 16, 2, 2, True),
        (13, 5, 16, 3, 3, False),
        (30, 4, 40, 4, 2, True),  # a window wider than most prompts
        (7, 1, 30, 3, 3, False),  # blocks of one token
    ],
)
def test_windows_block_sizes_and_tight_caches_keep_outputs_and_every_read_intact(
    window: int, block_size: int, num_blocks: int, num_spec_tokens: int, in_flight: int, prefix_caching: bool
) -> None:
    """Across geometries, with caches tight enough to preempt and prompts sharing a prefix: the
    worker (which checks every key a query reads, every block handover and every prefix hit's
    content) and the outputs agree with the toy model."""
    rng = random.Random(window)
    shared = [rng.choice(b"abc xyz") for _ in range(24)]
    prompts = {f"r{i}": shared[: rng.randint(8, 24)] + [rng.choice(b"abc") for _ in range(i)] for i in range(8)}
    case = make_case(
        prompts=prompts,
        stopping=StoppingOptions(max_tokens=70),
        block_size=block_size,
        max_model_len=160,
        num_blocks=num_blocks,
        num_spec_tokens=num_spec_tokens,
        max_num_batched_tokens=24,
        enable_prefix_caching=prefix_caching,
        eos_per_mille=5,
        sliding_window=window,
    )
    got = drive(case.scheduler, case.worker, in_flight)
    assert_matches_reference(case, got)
    assert case.scheduler.block_pool.num_used == 0
    case.scheduler.block_pool.check_invariants()
    assert case.scheduler.stats.num_preemptions > 0
    assert (case.worker.stats.num_cached_tokens > 0) == prefix_caching
