"""The worker runtime (`ModelRunner` on the real SmolLM2) against DESIGN.md's field failure modes.

Everything runs in-process, without gRPC. Two drivers feed the runner:

- hand-built `StepPlan`s (`HandPlanner`), where a test decides exactly when a request joins, is
  skipped, finishes, resumes or gets fewer draft slots than its proposer produced;
- the real `Scheduler` (`drive`), with up to `window` plans in flight exactly as
  `zerobubble.scheduler_svc.worker_link` keeps them: results reach the scheduler one or more plans late.

The step device's model is wrapped by `RecordingModel`, which asserts that every id the model is fed is a
real token and records ids and positions per step. That is instrumentation: the real forward
still runs and produces the outputs. Hugging Face greedy `generate` (and its logits, for
logprobs) is the oracle; seeded sampling is checked by identity across configurations.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
import torch

from tests.support.hf_oracle import hf_greedy, load_hf_model
from tests.support.runner_harness import (  # noqa: F401  (fixtures are used by name)
    SHORT_CODE_ROWS,
    Call,
    HandPlanner,
    HandRequest,
    K,
    Outcome,
    Recorders,
    RecordingModel,
    Trace,
    assert_greedy_prefix,
    assert_matches,
    audit,
    drive,
    make_scheduler,
    ngram_reference,
    recording,
)
from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.rows import plan_rows, result_rows
from zerobubble.scheduler_svc.scheduler import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_MAX_TOKENS,
    FINISH_STOP_SEQUENCE,
    RequestEvent,
    Scheduler,
)

pytestmark = pytest.mark.timeout(900)


def test_decode_inputs_are_own_state_after_join_skip_finish_and_resume(spec_runner, grounded):
    """A request that joins, is skipped for a step, finishes or is resumed (is_new again after a
    finish notice, in the same plan or a later one, with or without prefix-cache blocks) feeds
    the model only its own last token and its own current drafts, never a previous occupant's
    drafts or -1 fillers; outputs stay Hugging Face's greedy ones throughout."""
    prompts, reference = grounded
    a, b, c = SHORT_CODE_ROWS[:3]
    runner = spec_runner
    runner.reset()
    with recording(runner) as rec:
        p = HandPlanner(runner, rec, greedy={"A": reference[a], "B": reference[b], "C": reference[c]})
        p.step(p.new("A", prompts[a]))
        p.step(p.decode("A"), p.new("B", prompts[b]))  # B joins A's drafting decode
        p.step(p.decode("A"), p.decode("B"))
        p.step(p.decode("B"))  # A skipped for a step
        p.step(p.decode("A"), p.decode("B", 1))  # A after the gap; B trimmed
        # B leaves; C takes its state slot (which still holds B's drafts) with a chunked prefill.
        gone = p.finish("B")
        p.step(p.decode("A"), p.new("C", prompts[c], chunk=64), finished=(gone,))
        p.step(p.decode("A", 0), p.prefill("C"))
        # A is preempted and resumed in the same plan (finish notice + is_new), keeping its
        # prefix blocks as a prefix-cache hit would.
        gone = p.finish("A", keep_blocks=len(p.reqs["A"].seq) // runner.config.block_size - 1)
        p.step(p.decode("C"), p.new("A"), finished=(gone,))
        for _ in range(3):
            p.step(p.decode("A"), p.decode("C"))
        # B comes back in a later plan, recomputed from scratch, while the others decode.
        p.step(p.decode("A", 2), p.decode("C"), p.new("B"))
        for k in (K, 1, K, 0, K, 2, K):
            p.step(p.decode("A", k), p.decode("B"), p.decode("C", K - k))
    for name, row in zip("ABC", (a, b, c)):
        assert_greedy_prefix(name, p.reqs[name].outputs, reference[row])
    # The scenario is only meaningful if drafts were really in play.
    assert sum(r.num_accepted for res in p.results for r in result_rows(res).values()) > 0
    assert p.trimmed > 0
    if rec.draft is not None:
        assert rec.draft.calls, "the draft model never ran"


def test_trimmed_drafts_report_only_the_verified_drafts(spec_runner, smollm2_dir):
    """When a plan gives fewer draft slots than the proposer produced (max_tokens near, token
    budget), `num_draft_tokens` is the number actually verified and `num_accepted` counts the
    leading fed drafts equal to Hugging Face's greedy tokens, per step and per position."""
    runner = spec_runner
    runner.reset()
    # A counting prompt makes the greedy continuation predictable for both proposers.
    prompt = list(range(1000, 1012)) * 4 + list(range(1000, 1004))
    [reference] = hf_greedy(smollm2_dir, [prompt], 48)
    with recording(runner) as rec:
        p = HandPlanner(runner, rec, greedy={"r": reference})
        p.step(p.new("r", prompt))
        slots = [1, 0, 2, 1, K, 1, 0, 2, 1, 2, 1, 1]
        for k in slots:
            if len(p.reqs["r"].outputs) + k + 1 > len(reference):
                break
            offered = list(p.reqs["r"].drafts)
            fed_before = len(rec.target.calls)
            res = result_rows(p.step(p.decode("r", k)))["r"]
            ids, _ = rec.target.calls[fed_before].row(0)
            fed = ids[1 : 1 + min(k, len(offered))]
            # Ground truth for acceptance: how many fed drafts equal the greedy tokens there.
            start = len(p.reqs["r"].outputs) - len(res.token_ids)
            truth = reference[start : start + len(fed)]
            expected_accepted = next((i for i, (d, t) in enumerate(zip(fed, truth)) if d != t), len(fed))
            assert res.num_draft_tokens == len(fed) == min(k, len(offered))
            assert res.num_accepted == expected_accepted, (k, fed, truth, res)
            assert list(res.token_ids) == reference[start : start + res.num_accepted + 1]
            per_pos = list(p.results[-1].accepted_per_pos)
            assert per_pos == [1 if j < res.num_accepted else 0 for j in range(K)]
    assert p.trimmed >= 3, "the proposer never produced more drafts than the plan allowed"


def test_draft_model_cache_follows_confirmed_tokens(draft_runner, grounded):
    """The draft model keeps its own KV cache over the target's blocks; it must only ever vouch
    for positions holding confirmed tokens. Two field cases: a resume whose prefix-cache blocks
    were filled by a prefill chunk the draft never saw, and a fully accepted step whose blocks
    end exactly at the new last token (no lookahead slots were free). SmolLM2 drafting for
    itself proposes exactly Hugging Face's greedy continuation when its cache is right, which
    `HandPlanner` checks after every step."""
    prompts, reference = grounded
    row = SHORT_CODE_ROWS[0]
    runner = draft_runner
    runner.reset()
    bs = runner.config.block_size
    other = SHORT_CODE_ROWS[1]
    with recording(runner) as rec:
        p = HandPlanner(runner, rec, greedy={"X": reference[row], "W": reference[other]}, exact=True)
        # W fills some blocks (target and draft caches) and leaves; X gets them next.
        p.step(p.new("W", prompts[other]))
        p.step(p.decode("W"))
        gone = p.finish("W")
        # X is preempted after a first chunk that did not sample, then resumed on those 4
        # blocks as a prefix-cache hit: the draft model has never seen them.
        p.step(p.new("X", prompts[row], chunk=4 * bs), finished=(gone,))
        gone = p.finish("X", keep_blocks=4)
        p.step(p.new("X"), finished=(gone,))
        # Decodes on exactly allocated blocks; the slot counts shift the phase against the
        # block boundary so that full acceptance lands on it.
        tight = 0
        for k in (K, K, 2, K, K, 1, K, K, K, 2, K, K):
            if len(p.reqs["X"].outputs) + k + 1 > len(reference[row]):
                break
            p.step(p.decode("X", k))
            tight += p.reqs["X"].written == len(p.reqs["X"].blocks) * bs
    assert tight > 0, "no step ended exactly on the last allocated slot"
    assert_greedy_prefix("X", p.reqs["X"].outputs, reference[row])


@pytest.mark.parametrize("window", [1, 2])
def test_never_a_token_past_max_tokens_with_drafts(ngram_runner, smollm2_dir, window):
    """max_tokens 1..5 with k=3 n-gram drafts that are mostly accepted: exact lengths, finish
    reason max_tokens, Hugging Face's tokens, and no plan ever reserves a slot past the limit
    (checked after every `schedule()` by `drive`)."""
    runner = ngram_runner
    prompt = list(range(2000, 2010)) * 4
    [reference] = hf_greedy(smollm2_dir, [prompt], 8)
    scheduler = make_scheduler(runner)
    prompts = {}
    for n in range(1, 6):
        prompts[f"m{n}"] = prompt
        scheduler.add_request(f"m{n}", prompt, None, StoppingOptions(max_tokens=n, ignore_eos=True))
    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=window)
    audit(trace, prompts, ngram=True)
    for n in range(1, 6):
        out = trace.outputs[f"m{n}"]
        assert out.finish_reason == FINISH_MAX_TOKENS
        assert out.token_ids == reference[:n]
    assert scheduler.stats.spec.num_accepted_tokens > 0, "drafts never accepted: the limit was not tested"


@pytest.mark.parametrize("spec,temperature", [("ngram", 0.0), ("ngram", 0.8), ("draft", 0.0)])
def test_logprobs_belong_to_the_accepted_tokens(request, smollm2_dir, grounded, spec, temperature):
    """Each returned logprob is log_softmax of Hugging Face's logits for that very token at its
    position, including steps that accepted several drafts at once."""
    runner = request.getfixturevalue(f"{spec}_runner")
    prompts_all, _ = grounded
    rows = SHORT_CODE_ROWS[:3]
    scheduler = make_scheduler(runner)
    prompts = {}
    for i, row in enumerate(rows):
        prompts[f"r{row}"] = prompts_all[row]
        scheduler.add_request(
            f"r{row}",
            prompts_all[row],
            SamplingOptions(logprobs=True, temperature=temperature, seed=100 + i),
            StoppingOptions(max_tokens=24),
        )
    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=2)
    audit(trace, prompts, ngram=spec == "ngram")
    assert scheduler.stats.spec.num_accepted_tokens > 0, "no multi-token step: alignment not tested"
    hf = load_hf_model(Path(smollm2_dir))
    for req_id, prompt in prompts.items():
        out = trace.outputs[req_id]
        assert len(out.logprobs) == len(out.token_ids) > 0
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        expected = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        got = torch.tensor(out.logprobs)
        assert torch.allclose(got, expected, atol=2e-3), (req_id, (got - expected).abs().max())


@pytest.mark.parametrize("spec", ["ngram", "eagle"])
def test_results_for_requests_finished_or_cancelled_in_flight_are_dropped(request, grounded, spec):
    """With three plans in flight: one request stops on a stop token, one is cancelled, while
    later steps for them are already queued on the worker. Their in-flight results are dropped
    (never emitted, never twice), the worker forgets them at the next plan, their slots and
    blocks go to a request admitted later (an EAGLE head's carried state included), and everyone
    else keeps Hugging Face's tokens."""
    runner = request.getfixturevalue(f"{spec}_runner")
    prompts_all, reference_all = grounded
    a, b, c, d = SHORT_CODE_ROWS
    ref_a = reference_all[a]
    # A stops on a token that first appears a few tokens in.
    stop_at = next(i for i in range(6, 40) if ref_a[i] not in ref_a[:i])
    stop_token = ref_a[stop_at]
    # D waits for a free sequence slot, and 48 blocks (three requests' worth) leave it only
    # blocks that A or B held while their last steps were still queued.
    scheduler = make_scheduler(runner, max_num_seqs=3, num_blocks=48)
    prompts = {f"r{row}": prompts_all[row] for row in (a, b, c, d)}
    scheduler.add_request(f"r{a}", prompts_all[a], None, StoppingOptions(max_tokens=40, stop_token_ids=[stop_token]))
    for row in (b, c, d):
        scheduler.add_request(f"r{row}", prompts_all[row], None, StoppingOptions(max_tokens=40))
    cancelled: dict[str, int] = {}

    def cancel_b_in_flight(sched: Scheduler, trace: Trace, inflight: deque) -> list[RequestEvent]:
        out = trace.outputs.get(f"r{b}")
        planned = any(e.req_id == f"r{b}" for plan, _, _ in inflight for e in plan_rows(plan))
        if out is not None and len(out.token_ids) >= 5 and planned and not cancelled:
            cancelled["at"] = len(out.token_ids)
            return [sched.abort_request(f"r{b}")]  # the final event the client gets
        return []

    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=3, after_result=cancel_b_in_flight)
    audit(trace, prompts, ngram=spec == "ngram")
    assert trace.max_inflight_seen == 3
    assert cancelled, "B was never cancelled with a step in flight"
    out_a, out_b = trace.outputs[f"r{a}"], trace.outputs[f"r{b}"]
    assert out_a.finish_reason == FINISH_STOP_SEQUENCE
    assert out_b.finish_reason == FINISH_CANCELLED
    assert out_a.token_ids == reference_all[a][: stop_at + 1]
    assert out_b.token_ids == reference_all[b][: cancelled["at"]]
    for row in (c, d):
        assert trace.outputs[f"r{row}"].token_ids == reference_all[row][:40]
    assert scheduler.stats.num_stale_results >= 2
    assert_forgotten_and_reused(trace, gone=(f"r{a}", f"r{b}"), later=f"r{d}")
    assert not runner.slots.keys() & {f"r{a}", f"r{b}"}


def steps_with(trace: Trace, req_id: str) -> list[int]:
    """Indices of the traced steps that ran a row of `req_id`."""
    return [i for i, (plan, _, _) in enumerate(trace.steps) if any(e.req_id == req_id for e in plan_rows(plan))]


def blocks_of(trace: Trace, req_id: str) -> set[int]:
    """Every KV block the traced plans gave `req_id`."""
    return {b for plan, _, _ in trace.steps for e in plan_rows(plan) if e.req_id == req_id for b in e.new_block_ids}


def assert_forgotten_and_reused(trace: Trace, gone: tuple[str, ...], later: str) -> None:
    """Steps that ran after each finish of `gone` were discarded and the worker was told to
    forget each of them exactly once; `later` could only start once a slot was free, and it ran
    on blocks the finished requests had held."""
    for req_id in gone:
        notices = [i for i, (plan, _, _) in enumerate(trace.steps) if req_id in plan.finished_req_ids]
        assert len(notices) == 1, (req_id, notices)
        assert max(steps_with(trace, req_id)) < notices[0]
    first_later = min(steps_with(trace, later))
    assert any(any(req_id in plan.finished_req_ids for req_id in gone) for plan, _, _ in trace.steps[: first_later + 1])
    assert blocks_of(trace, later) & set().union(*(blocks_of(trace, req_id) for req_id in gone))


@pytest.mark.parametrize("spec", ["ngram", "draft", "eagle"])
def test_preemption_with_chunked_prefill_and_steps_in_flight(request, grounded, spec):
    """A KV pool far too small for the batch and a 128-token step budget: requests are preempted
    while their decodes are in flight and resumed by recomputation (chunked), drafts keep being
    proposed and verified, placeholder counters never go negative (`drive` checks them after
    every plan, the scheduler asserts it on every result), and the outputs stay Hugging Face's."""
    runner = request.getfixturevalue(f"{spec}_runner")
    prompts_all, reference_all = grounded
    rows = [7, 4, 0, 3, 25, 29, 41, 44]
    max_tokens = 32
    # 40 blocks of 16 = 640 token slots for 8 requests of 40-190 prompt tokens + 32 outputs.
    scheduler = make_scheduler(runner, num_blocks=40, max_num_batched_tokens=128)
    prompts = {}
    for row in rows:
        prompts[f"r{row}"] = prompts_all[row]
        scheduler.add_request(f"r{row}", prompts_all[row], None, StoppingOptions(max_tokens=max_tokens))
    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=2)
    audit(trace, prompts, ngram=spec == "ngram")
    assert scheduler.stats.num_preemptions > 0
    assert scheduler.stats.num_stale_results > 0, "no preemption hit a step in flight"
    assert any(
        len(plan_rows(plan)) > 1
        and any(e.token_ids for e in plan_rows(plan))
        and any(not e.token_ids for e in plan_rows(plan))
        for plan, _, _ in trace.steps
    ), "prefill chunks never shared a step with decodes"
    stats = scheduler.stats.spec
    assert stats.num_accepted_tokens > 0
    if spec == "draft":
        # SmolLM2 drafting for itself agrees with its own greedy choice unless the draft model's
        # KV cache went out of step with the confirmed tokens (resume, prefix hit, no lookahead).
        assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, (
            stats.num_accepted_tokens,
            stats.num_draft_tokens,
        )
    reference = {f"r{row}": reference_all[row][:max_tokens] for row in rows}
    for _req_id, out in trace.outputs.items():
        assert out.finish_reason in (FINISH_EOS, FINISH_MAX_TOKENS)
    assert_matches(trace.outputs, reference)


# The default suite makes the same claims with more sampling controls on fewer rows
# (`test_sampling_controls.py::test_seeded_sampling_with_penalties_is_identical_across_modes_and_batches`:
# sync without speculation, async with n-gram and draft drafts, batched and alone); this
# factorial over 6 rows runs with `make test-slow`.
@pytest.mark.slow
def test_seeded_sampling_is_identical_across_windows_and_speculation(ngram_runner, grounded):
    """Temperature 0.8 with per-request seeds: the same tokens with 1 or 2 plans in flight, with
    n-gram speculation on (k=3) or off (k=0 draft slots), and alone or batched with others."""
    runner = ngram_runner
    prompts_all, reference_all = grounded
    rows = [7, 4, 25, 41, 44, 29]
    max_tokens = 12
    configs = [(window, k, True) for window in (1, 2) for k in (0, K)]
    configs += [(1, 0, False), (2, K, False)]  # alone: the two extremes
    runs: dict[tuple, dict[str, list[int]]] = {}
    for window, k, batched in configs:
        outs: dict[str, list[int]] = {}
        num_draft_tokens = 0
        for group in [rows] if batched else [[row] for row in rows[:2]]:
            scheduler = make_scheduler(runner, num_spec_tokens=k)
            for row in group:
                scheduler.add_request(
                    f"r{row}",
                    prompts_all[row],
                    SamplingOptions(temperature=0.8, seed=4242 + row),
                    StoppingOptions(max_tokens=max_tokens),
                )
            with recording(runner) as rec:
                trace = drive(runner, scheduler, rec, window=window)
            num_draft_tokens += scheduler.stats.spec.num_draft_tokens
            outs.update({r: o.token_ids for r, o in trace.outputs.items()})
        assert (num_draft_tokens > 0) == (k > 0), (window, k, batched)
        runs[(window, k, batched)] = outs
    baseline = runs[configs[0]]
    # Sampling really happened: the seeded outputs are not just the greedy ones.
    assert any(baseline[f"r{row}"] != reference_all[row][:max_tokens] for row in rows)
    for config, outs in runs.items():
        for req_id, tokens in outs.items():
            assert tokens == baseline[req_id], (config, req_id)
