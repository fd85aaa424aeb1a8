"""Suffix decoding (`--spec-method suffix`) through the real Scheduler and runner: the
scheduler's continuations, a step late, drafted from on the device.

Oracles: Hugging Face's greedy output (float32) for greedy requests, sync and async; the same
requests without speculation for seeded sampling. That the continuations were drafted from and
accepted is read from the scheduler's counts.
"""

from __future__ import annotations

import pytest

from tests.support.drive import run_job
from zerobubble.scheduler_svc.scheduler import SchedulerStats

pytestmark = pytest.mark.timeout(600)

# A code edit (the reply rewrites the prompt's code) and an open chat row, short prompts; the
# slow tests add a second code edit and a grounded answer, and run longer.
ROWS = (4, 43)
SLOW_ROWS = (0, 4, 40, 43)
MAX_TOKENS = 24
SLOW_MAX_TOKENS = 64


def check_greedy(runner, grounded, window: int, rows: tuple[int, ...], max_tokens: int) -> None:
    prompts, reference = grounded
    requests = [(f"r{i}", prompts[i], {"max_tokens": max_tokens}) for i in rows]
    stats = SchedulerStats()
    outputs = run_job(runner, requests, window=window, stats=stats)
    assert outputs == {f"r{i}": reference[i][:max_tokens] for i in rows}
    assert sum(stats.spec.suffix_continuations[1:]) > 0  # continuations were sent
    assert 0 < stats.spec.num_accepted_tokens <= stats.spec.num_draft_tokens
    assert stats.prediction.num_draft_tokens == 0  # a continuation's drafts are the proposer's


# Sync in the slow suite: async (window 2) is the default run's, here and through the services
# (tests/services/test_async_spec_e2e.py, suffix-inflight2).
@pytest.mark.parametrize("window", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_greedy_output_is_hugging_face_s(suffix_runner, grounded, window):
    check_greedy(suffix_runner, grounded, window, ROWS, MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("window", [1, 2])
def test_greedy_output_is_hugging_face_s_on_more_rows(suffix_runner, grounded, window):
    check_greedy(suffix_runner, grounded, window, SLOW_ROWS, SLOW_MAX_TOKENS)


@pytest.mark.parametrize("rows", [pytest.param(ROWS[:1], id="one"), pytest.param(SLOW_ROWS, marks=pytest.mark.slow)])
def test_seeded_output_is_the_unspeculated_one(plain_runner, suffix_runner, grounded, rows):
    prompts, _ = grounded
    requests = [(f"r{i}", prompts[i], {"max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 5}) for i in rows]
    assert run_job(suffix_runner, requests, window=2) == run_job(plain_runner, requests, window=1)


@pytest.mark.slow
def test_an_earlier_output_is_drafted_from(plain_runner, suffix_runner, grounded):
    """The same prompt twice, one after the other: the second request's output repeats the
    first's, which the shared index holds, so most of its tokens come from accepted drafts."""
    prompts, reference = grounded
    requests = [(f"r{n}", prompts[43], {"max_tokens": MAX_TOKENS}) for n in range(2)]
    first, both = SchedulerStats(), SchedulerStats()
    run_job(suffix_runner, requests[:1], window=2, max_num_seqs=1, stats=first)
    outputs = run_job(suffix_runner, requests, window=2, max_num_seqs=1, stats=both)
    assert outputs == {"r0": reference[43][:MAX_TOKENS], "r1": reference[43][:MAX_TOKENS]}
    assert both.spec.num_accepted_tokens - first.spec.num_accepted_tokens >= MAX_TOKENS // 2
