"""`--spec-disable-batch-size`: drafting stops while the batch is large and resumes below it.

The real scheduler drives an in-process runner with a model-backed proposer (an EAGLE head
copying its target, a draft model drafting for itself: nearly every draft is accepted where
drafts are made). One request runs alone with drafts, two more arrive and drafting stops, and
it comes back once one request is left. Greedy output must equal Hugging Face's, sync and with
two plans in flight, and the draft chain must not run after a step whose plan gave no decode
row a draft slot (the worker's half of the rule: the plan made those drafts useless).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.support.drafting import (
    K,
    copying_target_and_head,
    eagle_head,
    hf_greedy,
    loaded_model,
    runner_and_scheduler,
    tiny_hf,
)
from zerobubble.request_options import StoppingOptions
from zerobubble.rows import plan_rows, result_rows
from zerobubble.worker_svc.proposers import Proposer
from zerobubble.worker_svc.proposers.draft import DraftModelProposer
from zerobubble.worker_svc.proposers.eagle import EagleProposer

LIMIT = 2  # speculation is off with two requests running or more
# The first runs alone for a few steps, the other two arrive at the third plan; lengths differ
# so that the batch shrinks one request at a time.
PROMPTS = {"r0": list(range(1, 12)), "r1": list(range(30, 47)), "r2": list(range(60, 69))}
MAX_TOKENS = {"r0": 24, "r1": 12, "r2": 40}
ARRIVALS = {0: ["r0"], 2: ["r1", "r2"]}  # plan number -> requests added before it


def _eagle() -> tuple[LlamaForCausalLM, Proposer]:
    hf, state = copying_target_and_head()
    return hf, EagleProposer(eagle_head(loaded_model(hf), state), K)


def _draft_model() -> tuple[LlamaForCausalLM, Proposer]:
    hf = tiny_hf(0)
    return hf, DraftModelProposer(loaded_model(hf), K)


def _run(
    hf: LlamaForCausalLM, proposer: Proposer, window: int
) -> tuple[dict[str, list[int]], dict[int, list[int]], list[int], int]:
    """Drive the arrivals with ``window`` plans in flight; (outputs, decode draft slots per step
    id, step ids after which the proposer ran, drafts verified)."""
    runner, scheduler = runner_and_scheduler(hf, proposer, spec_disable_batch_size=LIMIT)
    proposed: list[int] = []
    propose: Callable[[torch.Tensor, Any], None] = proposer.propose

    def counted_propose(slots: torch.Tensor, batch: Any) -> None:
        proposed.append(batch.step_id)
        propose(slots, batch)

    proposer.propose = counted_propose  # type: ignore[method-assign]
    outputs: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    draft_slots: dict[int, list[int]] = {}
    drafted = 0
    inflight: deque = deque()
    arrivals = dict(ARRIVALS)
    while scheduler.has_unfinished() or inflight or arrivals:
        for rid in arrivals.pop(len(draft_slots), []):
            stopping = StoppingOptions(max_tokens=MAX_TOKENS[rid], ignore_eos=True)
            scheduler.add_request(rid, PROMPTS[rid], None, stopping)
        if len(inflight) < window and (plan := scheduler.schedule()) is not None:
            draft_slots[plan.step_id] = [row.num_draft_slots for row in plan_rows(plan) if not row.token_ids]
            inflight.append(runner.execute(plan))
            continue
        assert inflight, "nothing to run before every request arrived"
        result = inflight.popleft().materialize(0.0, K)
        runner.propose_next()  # as the worker's step loop does once the result is handed on
        drafted += sum(row.num_draft_tokens for row in result_rows(result).values())
        for event in scheduler.on_step_result(result):
            outputs[event.req_id].extend(event.token_ids)
    return outputs, draft_slots, proposed, drafted


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("make_proposer", [_eagle, _draft_model], ids=["eagle", "draft"])
def test_drafting_stops_in_a_large_batch_and_resumes_with_the_same_greedy_output(
    make_proposer: Callable[[], tuple[LlamaForCausalLM, Proposer]], window: int
) -> None:
    hf, proposer = make_proposer()
    outputs, draft_slots, proposed, drafted = _run(hf, proposer, window)
    for rid, prompt in PROMPTS.items():
        assert outputs[rid] == hf_greedy(hf, prompt, MAX_TOKENS[rid]), rid
    # The batch crossed the limit both ways: decodes with drafts, then none, then again.
    phases = [any(slots) for _, slots in sorted(draft_slots.items()) if slots]
    changes = [b for a, b in zip(phases, phases[1:]) if a != b]
    assert changes[:2] == [False, True], phases
    # The chain ran after every step whose decodes had draft slots (bar the last) and never
    # after one whose decodes had none.
    without = {step for step, slots in draft_slots.items() if slots and not any(slots)}
    assert without and not without & set(proposed), (sorted(without), proposed)
    with_drafts = {step for step, slots in draft_slots.items() if any(slots)}
    assert len(with_drafts - set(proposed)) <= 1, (sorted(with_drafts), proposed)
    assert drafted > 0


def test_a_step_of_prefill_chunks_only_still_drafts_for_its_sampled_rows() -> None:
    """A plan without decode rows says nothing about drafting: the first decode after a
    prefill carries drafts (the worker skips the chain only after decodes without slots)."""
    hf, proposer = _draft_model()
    runner, scheduler = runner_and_scheduler(hf, proposer, spec_disable_batch_size=LIMIT)
    scheduler.add_request("r", PROMPTS["r0"], None, StoppingOptions(max_tokens=8, ignore_eos=True))
    runner.execute(scheduler.schedule()).materialize(0.0, K)
    runner.propose_next()
    assert int(runner.state.num_drafts[runner.slots["r"].slot]) == K
