"""Suffix decoding's host index (`scheduler_svc/suffix.py`) against its brute-force definition,
its bounded memory, and the drafter's decisions on when to send a continuation."""

from __future__ import annotations

import random

import pytest

from tests.support.options import split_options
from tests.support.sim_worker import make_toy_tokenizer_json
from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.rows import ContinuationRow, ResultBuilder, add_continuations, continuation_rows, plan_rows
from zerobubble.scheduler_svc.request import Request
from zerobubble.scheduler_svc.scheduler import Scheduler, SchedulerConfig
from zerobubble.scheduler_svc.suffix import (
    SharedOutputs,
    SuffixDrafter,
    SuffixIndex,
    SuffixParams,
    bigram,
    reference_continuation,
)
from zerobubble.scheduler_svc.tokenizer import Tokenizer


def random_text(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Tokens from a small vocabulary with repeated phrases (so that long matches exist)."""
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 9))] for _ in range(6)]
    out: list[int] = []
    while len(out) < n:
        out.extend(rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(vocab)])
    return out[:n]


@pytest.mark.parametrize("seed", range(40))
def test_index_computes_the_reference_continuation(seed):
    rng = random.Random(seed)
    params = SuffixParams(
        max_match=rng.choice([4, 8, 32]),
        min_prob=rng.choice([0.0, 0.1, 0.4]),
        spec_factor=rng.choice([0.5, 1.0, 4.0]),
        max_candidates=rng.choice([3, 16, 1000]),
    )
    index = SuffixIndex()
    vocab = rng.choice([3, 6, 20])
    for _ in range(rng.randint(1, 5)):
        seq = index.add(random_text(rng, rng.randint(0, 30), vocab))
        index.extend(seq, random_text(rng, rng.randint(0, 40), vocab))  # appended later, as outputs are
    if rng.random() < 0.5 and len(index.seqs) > 1:
        index.remove(next(iter(index.seqs)))
    for _ in range(20):
        pattern = random_text(rng, rng.randint(0, 12), vocab)
        limit = rng.choice([1, 5, 32])
        got = index.continuation(pattern, params, limit)
        want = reference_continuation(index.seqs, pattern, params, limit)
        assert (got.token_ids, got.match_len) == (want.token_ids, want.match_len if want.token_ids else got.match_len)
        assert got.score == pytest.approx(want.score)


def test_a_quote_continues_with_what_followed_it():
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    got = index.continuation([9, 1, 2, 3], SuffixParams(spec_factor=2.0), 32)
    assert got.token_ids == [4, 5, 6, 7, 8, 1]  # a match of 3 earns 6 tokens
    assert got.match_len == 3


def test_the_most_frequent_continuation_wins_and_rare_ones_are_cut():
    index = SuffixIndex()
    for tail in ([7, 8], [7, 8], [7, 9], [5, 5]):
        index.add([1, 2, *tail])
    # 7 in 3 of 4 places (0.75); then 8 in 2 of those 3 (0.75 * 2/3 = 0.5), then nothing.
    got = index.continuation([1, 2], SuffixParams(min_prob=0.3, spec_factor=4.0), 8)
    assert got.token_ids == [7, 8] and got.score == pytest.approx(1.25)
    assert index.continuation([1, 2], SuffixParams(min_prob=0.6, spec_factor=4.0), 8).token_ids == [7]
    assert index.continuation([1, 2], SuffixParams(min_prob=0.3, spec_factor=0.5), 8).token_ids == [7]


def test_removing_a_list_forgets_its_bigrams():
    index = SuffixIndex()
    a = index.add([1, 2, 3, 1, 2, 4])
    index.add([5, 6])
    index.remove(a)  # its 5 places outnumber the 2 live tokens: compacted at once
    assert set(index.ends) == {bigram(5, 6)}
    assert index.num_tokens == 2
    assert index.continuation([1, 2], SuffixParams(), 4).token_ids == []


def test_the_shared_index_evicts_the_oldest_outputs():
    shared = SharedOutputs(SuffixParams(shared_max_tokens=100))
    seqs = [shared.start([0, 1]) for _ in range(3)]
    for seq in seqs:
        shared.extend(seq, [7, 8] * 20)
    assert shared.index.num_tokens == 84
    assert list(shared.index.seqs) == seqs[1:]
    shared.extend(seqs[0], [1, 2])  # an evicted output's later tokens go nowhere
    assert shared.index.num_tokens == 84
    shared.extend(seqs[2], [7, 8] * 200)  # one output longer than the whole index goes too
    assert shared.index.num_tokens == 0


def make_request(prompt: list[int]) -> Request:
    return Request(
        req_id="r",
        prompt_token_ids=prompt,
        sampling=SamplingOptions(),
        stopping=StoppingOptions(),
        max_tokens=1000,
        eos_token_ids=frozenset(),
        detokenizer=None,
        arrival_time=0.0,
        admission_id=1,
    )


def test_the_drafter_sends_a_continuation_only_when_the_old_one_stops_serving():
    drafter = SuffixDrafter(budget=4, params=SuffixParams(spec_factor=8.0))
    text = list(range(10, 30))
    req = make_request([*text, 1, *text[:3]])
    first = drafter.plan(req, 2)
    assert (
        first.send == [*text[3:], 1, *text[:3]][:24] and first.anchor == req.num_tokens and first.num_draft_slots == 4
    )
    drafter.commit(req, first)
    req.output_token_ids.extend(text[3:6])  # the output follows it: nothing new to send
    drafter.new_plan()
    assert drafter.plan(req, 2).send is None
    req.output_token_ids.append(99)  # it leaves it: the continuation is cleared
    drafter.new_plan()
    cleared = drafter.plan(req, 2)
    assert cleared.send == [] and cleared.num_draft_slots == 2
    drafter.commit(req, cleared)
    assert drafter.sent_lengths[len(first.send)] == 1 and drafter.sent_lengths[0] == 1
    drafter.finish(req)
    assert req.suffix is None
    assert drafter.shared.index.num_tokens == drafter.params.shared_context + req.num_output_tokens


def test_continuations_ride_in_the_plan_and_read_back() -> None:
    plan = worker_pb2.StepPlan()
    add_continuations(plan, ["a", "b"], [7, 3], [[1, 2, 3], []])
    assert continuation_rows(plan) == [ContinuationRow("a", 7, [1, 2, 3]), ContinuationRow("b", 3, [])]
    plan.continuations.num_tokens.append(1)  # a column that does not line up
    with pytest.raises(ValueError, match="line up"):
        continuation_rows(plan)


def suffix_scheduler(num_blocks: int = 64) -> Scheduler:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=200,
        num_spec_tokens=2,
        num_prediction_tokens=8,
        vocab_size=64,
        spec_method="suffix",
    )
    return Scheduler(config, Tokenizer(make_toy_tokenizer_json()))


def run_plan(scheduler: Scheduler, tokens: dict[str, list[int]]) -> worker_pb2.StepPlan:
    """Plan a step and answer it (sync): each row gets ``tokens[req_id]`` (its drafts all
    accepted but the last token's)."""
    plan = scheduler.schedule()
    assert plan is not None
    result = worker_pb2.StepResult(step_id=plan.step_id)
    rows = ResultBuilder()
    for row in plan_rows(plan):
        emitted = tokens.get(row.req_id, [5])[: row.num_draft_slots + 1] if row.sample else []
        rows.add(row.req_id, emitted, row.num_draft_slots)
    rows.write(result)
    scheduler.on_step_result(result)
    return plan


def test_the_scheduler_sends_a_request_its_continuation_and_plans_slots_for_it() -> None:
    """A prompt quoting itself: the first decode carries the continuation of its last tokens
    (anchored after the known tokens) and as many draft slots as the budget allows; a request
    with a client's prediction gets none; a finished request's index is freed."""
    scheduler = suffix_scheduler()
    text = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    scheduler.add_request("s", [*text, 3, *text[:4]], *split_options({"max_tokens": 30, "ignore_eos": True}))
    options = {"max_tokens": 30, "ignore_eos": True, "prediction_token_ids": text}
    scheduler.add_request("p", [*text, 3, *text[:4]], *split_options(options))
    run_plan(scheduler, {"s": [14], "p": [14]})  # prefills
    plan = run_plan(scheduler, {"s": text[5:10], "p": text[5:7]})
    rows = continuation_rows(plan)
    assert [r.req_id for r in rows] == ["s"]
    assert rows[0].anchor == 16 and list(rows[0].token_ids[:5]) == text[5:10]
    assert {row.req_id: row.num_draft_slots for row in plan_rows(plan)}["s"] == 5
    request = scheduler.get_request("s")
    assert request is not None and request.suffix is not None
    scheduler.abort_request("s")
    assert request.suffix is None and scheduler.get_request("s") is None


def test_a_preempted_request_gets_its_continuation_again() -> None:
    scheduler = suffix_scheduler()
    text = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    scheduler.add_request("s", [*text, 3, *text[:4]], *split_options({"max_tokens": 30, "ignore_eos": True}))
    run_plan(scheduler, {"s": [14]})
    assert continuation_rows(run_plan(scheduler, {"s": [15]}))  # sent
    moved = scheduler.take_unfinished()  # as when its worker is lost
    other = suffix_scheduler()
    other.adopt(moved[0])
    run_plan(other, {"s": [16]})  # the resumed prefill
    rows = continuation_rows(run_plan(other, {"s": [17]}))
    assert [(r.req_id, r.anchor) for r in rows] == [("s", 18)]


def test_a_request_refused_a_query_goes_first_in_the_next_plan() -> None:
    """One query a plan, three requests wanting one every plan: each is served in turn, not
    the first in running order every time."""
    drafter = SuffixDrafter(budget=4, params=SuffixParams(max_queries_per_plan=1))
    requests = [make_request([1, 2, 3, 1, 2]) for _ in range(3)]
    served = []
    for step in range(6):
        drafter.new_plan()
        before = drafter.num_queries
        for i, req in enumerate(requests):
            drafter.plan(req, 2)
            if drafter.num_queries > before:
                served.append(i)
                before = drafter.num_queries
            req.output_token_ids.append(7 + step)  # the text grows: every request wants a query
    assert sorted(served[:3]) == [0, 1, 2] and len(served) == 6
