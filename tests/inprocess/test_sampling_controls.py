"""Sampling controls: penalties, min_p, logit_bias, top-N logprobs, n > 1.

Unit tests check the sampler against Hugging Face's logits processors and plain formulas on
random logits; runner tests drive the real SmolLM2 in-process with the real `Scheduler` (helpers
from `tests.inprocess.test_spec_runner`), with 1 or 2 plans in flight ("sync" / "async") and no, n-gram or
draft-model speculation, against Hugging Face `generate` as the oracle.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.support.e2e import prompt_ids
from tests.support.hf_oracle import load_hf_model
from tests.support.options import split_options
from tests.support.runner_harness import (
    K,
    drive,
    make_scheduler,
    recording,
)
from zerobubble.api import generate_pb2
from zerobubble.request_options import (
    InvalidRequest,
    SamplingOptions,
    StoppingOptions,
    from_generate_request,
    from_worker_sampling,
    to_worker_sampling,
    write_generate_request,
)
from zerobubble.rows import plan_rows
from zerobubble.scheduler_svc.server import sequence_seed
from zerobubble.worker_svc.sampler import (
    LogitBias,
    Penalties,
    SamplingTensors,
    SlotSampling,
    context_token_counts,
    sample,
    target_probs,
    top_logprobs,
)

pytestmark = pytest.mark.timeout(900)

# ------------------------------------------------------------------------------------ validation

BAD_CONTROLS = [
    (dict(presence_penalty=2.5), "sampling.presence_penalty"),
    (dict(presence_penalty=float("nan")), "sampling.presence_penalty"),
    (dict(frequency_penalty=-2.01), "sampling.frequency_penalty"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(repetition_penalty=-1.0), "sampling.repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "sampling.repetition_penalty"),
    (dict(min_p=1.5), "sampling.min_p"),
    (dict(min_p=-0.1), "sampling.min_p"),
    (dict(logit_bias={10**6: 1.0}), "sampling.logit_bias"),
    (dict(logit_bias={-1: 1.0}), "sampling.logit_bias"),
    (dict(logit_bias={5: 101.0}), "sampling.logit_bias[5]"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "sampling.logit_bias"),
    (dict(top_logprobs=21), "response.top_logprobs"),
    (dict(top_logprobs=-1), "response.top_logprobs"),
    (dict(typical_p=0.0), "sampling.typical_p"),
    (dict(typical_p=1.5), "sampling.typical_p"),
    (dict(typical_p=float("nan")), "sampling.typical_p"),
]


@pytest.mark.parametrize("kwargs,field", BAD_CONTROLS)
def test_bad_sampling_controls_name_the_field(kwargs, field) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingOptions(**kwargs).validate(vocab_size=1000)
    assert str(info.value).startswith(field), str(info.value)


def test_good_sampling_controls_pass() -> None:
    SamplingOptions(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1.3,
        min_p=1.0,
        logit_bias={0: -100, 999: 100},
        top_logprobs=20,
    ).validate(vocab_size=1000)
    SamplingOptions().validate(vocab_size=1000)


def test_sequence_seeds_are_distinct_and_the_first_is_the_request_seed() -> None:
    seeds = [sequence_seed(12345, i) for i in range(16)]
    assert seeds[0] == 12345 and len(set(seeds)) == 16
    assert all(0 <= s < 2**64 for s in seeds)


# ------------------------------------------------------------------------------- sampler (unit)


def _paged(contexts: list[list[int]], block_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Token history pages and block tables holding `contexts` in shuffled blocks."""
    num_blocks = sum(-(-len(c) // block_size) for c in contexts) + 3
    history = torch.randint(0, 50, (num_blocks, block_size), dtype=torch.int32)  # garbage
    order = torch.randperm(num_blocks).tolist()
    width = max(-(-len(c) // block_size) for c in contexts) + 1
    tables = torch.tensor([[order[-1]] * width for _ in contexts], dtype=torch.int32)  # padding
    for r, ctx in enumerate(contexts):
        for b in range(-(-len(ctx) // block_size)):
            block = order.pop()
            tables[r, b] = block
            chunk = ctx[b * block_size : (b + 1) * block_size]
            history[block, : len(chunk)] = torch.tensor(chunk, dtype=torch.int32)
    return history, tables


def test_context_counts_read_the_paged_history() -> None:
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, 30, (n,), generator=gen).tolist() for n in (1, 7, 13, 4)]
    num_prompt = [1, 3, 20, 0]
    history, tables = _paged(contexts)
    counts, seen = context_token_counts(
        history, tables, torch.tensor([len(c) for c in contexts]), torch.tensor(num_prompt), 30
    )
    for r, ctx in enumerate(contexts):
        expect = torch.zeros(30, dtype=torch.int32)
        for t in ctx[num_prompt[r] :]:
            expect[t] += 1
        assert torch.equal(counts[r], expect), r
        assert seen[r].nonzero().flatten().tolist() == sorted(set(ctx)), r


def _hf_repetition(logits: torch.Tensor, contexts: list[list[int]], penalty: float) -> torch.Tensor:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    proc = RepetitionPenaltyLogitsProcessor(penalty)
    return torch.cat([proc(torch.tensor([c]), logits[i : i + 1].clone()) for i, c in enumerate(contexts)])


def _openai_penalties(
    logits: torch.Tensor, outputs: list[list[int]], frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI's documented formula, one token at a time."""
    out = logits.clone()
    for i, toks in enumerate(outputs):
        for t in set(toks):
            out[i, t] -= frequency * toks.count(t) + presence
    return out


def _tensors(num_rows: int, temperature: float = 0.0, **kw) -> SamplingTensors:
    return SamplingTensors.from_params(
        [temperature] * num_rows, [0] * num_rows, [1.0] * num_rows, list(range(num_rows)), [9] * num_rows, **kw
    )


def test_penalties_match_hf_and_openai_formulas() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 40
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 0, 11)]
    contexts = [p + o for p, o in zip(prompts, outputs)]
    logits = torch.randn(3, vocab, generator=gen) * 3
    history, tables = _paged(contexts)
    counts, seen = context_token_counts(
        history, tables, torch.tensor([len(c) for c in contexts]), torch.tensor([len(p) for p in prompts]), vocab
    )
    rows = torch.arange(3)

    def penalties(rep: float, freq: float, pres: float) -> Penalties:
        return Penalties(
            rows=rows,
            repetition=torch.full((3,), rep),
            frequency=torch.full((3,), freq),
            presence=torch.full((3,), pres),
            output_counts=counts,
            seen=seen,
        )

    # Greedy is the argmax of the penalized logits, and target_probs is one-hot there.
    rep = _hf_repetition(logits, contexts, 1.7)
    t = _tensors(3, penalties=penalties(1.7, 0.0, 0.0))
    assert sample(logits, t).tolist() == rep.argmax(-1).tolist()
    oa = _openai_penalties(logits, outputs, 0.9, 1.3)
    t = _tensors(3, penalties=penalties(1.0, 0.9, 1.3))
    assert sample(logits, t).tolist() == oa.argmax(-1).tolist()
    # With temperature, the distribution is the softmax of the penalized logits (both kinds).
    both = _openai_penalties(_hf_repetition(logits, contexts, 1.2), outputs, -0.5, 0.4)
    t = _tensors(3, temperature=0.7, penalties=penalties(1.2, -0.5, 0.4))
    assert torch.allclose(target_probs(logits, t), (both / 0.7).softmax(-1), atol=1e-6)


def test_min_p_matches_hf_warper_after_top_k() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 50, generator=gen) * 2
    t = SamplingTensors.from_params(
        [0.8] * 6, [10] * 6, [1.0] * 6, list(range(6)), [3] * 6, min_ps=[0.0, 0.05, 0.1, 0.3, 0.6, 1.0]
    )
    ours = target_probs(logits, t)
    for i, m in enumerate([0.0, 0.05, 0.1, 0.3, 0.6, 1.0]):
        scores = TopKLogitsWarper(10)(None, logits[i : i + 1] / 0.8)
        if m > 0:
            scores = MinPLogitsWarper(m)(None, scores)
        assert torch.allclose(ours[i], scores.softmax(-1)[0], atol=1e-6), i


def test_typical_p_matches_hf_warper_after_top_k_and_min_p() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TypicalLogitsWarper

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 2
    masses = [1.0, 0.2, 0.5, 0.8, 0.95, 0.99]
    t = SamplingTensors.from_params(
        [0.8] * 6, [20] * 6, [1.0] * 6, list(range(6)), [3] * 6, min_ps=[0.02] * 6, typical_ps=masses
    )
    ours = target_probs(logits, t)
    for i, mass in enumerate(masses):
        scores = MinPLogitsWarper(0.02)(None, TopKLogitsWarper(20)(None, logits[i : i + 1] / 0.8))
        if mass < 1:
            scores = TypicalLogitsWarper(mass)(None, scores)
        assert torch.allclose(ours[i], scores.softmax(-1)[0], atol=1e-6), i


def test_typical_p_alone_matches_hf_warper_and_draws_only_kept_tokens() -> None:
    from transformers.generation.logits_process import TypicalLogitsWarper

    gen = torch.Generator().manual_seed(4)
    rows, vocab = 64, 300
    logits = torch.randn(rows, vocab, generator=gen) * 3
    masses = (torch.rand(rows, generator=gen) * 0.9 + 0.05).tolist()
    t = SamplingTensors.from_params(
        [1.0] * rows, [0] * rows, [1.0] * rows, list(range(rows)), [0] * rows, typical_ps=masses
    )
    ours = target_probs(logits, t)
    for i, mass in enumerate(masses):
        expected = TypicalLogitsWarper(mass)(None, logits[i : i + 1]).softmax(-1)[0]
        assert torch.allclose(ours[i], expected, atol=1e-6), i
    tokens = sample(logits, t)
    assert bool((ours.gather(-1, tokens[:, None]) > 0).all())


def test_typical_p_travels_from_the_client_request_to_the_workers_tensors() -> None:
    request = generate_pb2.GenerateRequest(prompt="hi")
    write_generate_request(SamplingOptions(temperature=0.7, typical_p=0.4), StoppingOptions(), request)
    sampling, _ = from_generate_request(generate_pb2.GenerateRequest.FromString(request.SerializeToString()))
    assert sampling.typical_p == pytest.approx(0.4)
    assert from_generate_request(generate_pb2.GenerateRequest(prompt="hi"))[0].typical_p == 1.0  # unset: off
    row = from_worker_sampling(to_worker_sampling(sampling, num_prompt_tokens=3))
    slots = SlotSampling(2)
    slots.set(1, row)
    t = slots.tensors(torch.tensor([1, 0]).numpy(), torch.tensor([5, 5]), "cpu")
    assert t.typical_p is not None and t.typical_p.tolist() == pytest.approx([0.4, 1.0])
    assert slots.tensors(torch.tensor([0]).numpy(), torch.tensor([5]), "cpu").typical_p is None  # off: no work


def test_logit_bias_steers_greedy_and_sampling() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=gen)
    bias = LogitBias(
        rows=torch.tensor([0, 1, 1, 3]),
        token_ids=torch.tensor([7, 2, 9, 0]),
        values=torch.tensor([100.0, -100.0, 100.0, -100.0]),
    )
    expect = logits.clone()
    expect[0, 7] += 100
    expect[1, 2] -= 100
    expect[1, 9] += 100
    expect[3, 0] -= 100
    assert sample(logits, _tensors(4, logit_bias=bias)).tolist() == expect.argmax(-1).tolist()
    t = _tensors(4, temperature=1.0, logit_bias=bias)
    assert torch.allclose(target_probs(logits, t), expect.softmax(-1), atol=1e-6)
    assert sample(logits, t)[0] == 7 and sample(logits, t)[1] == 9


def test_top_logprobs_are_the_raw_log_softmax_top_n() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 100, generator=gen)
    ids, lps = top_logprobs(logits, 20)
    ref = logits.log_softmax(-1)
    assert ids.shape == lps.shape == (5, 20)
    assert torch.equal(ids, ref.argsort(-1, descending=True)[:, :20])
    assert torch.allclose(lps, ref.gather(-1, ids))


# ------------------------------------------------------------------ runner + scheduler, real model

# Grounded code-edit and QA rows with short prompts; n-gram drafts are plentiful in the code
# edits, so draft rows that a penalty changes really are verified. The default suite runs FAST
# (2 rows, 12 tokens); the slow suite FULL.
FAST_ROWS, FAST_TOKENS = (7, 41), 12
FULL_ROWS, FULL_TOKENS = (7, 4, 0, 3, 41, 25, 44, 29), 32
ROWS = tuple(dict.fromkeys(FAST_ROWS + FULL_ROWS))
MAX_TOKENS = FAST_TOKENS
MODES = [(spec, window) for spec in ("none", "ngram", "draft", "eagle") for window in (1, 2)]


def _mode_id(spec: str, window: int) -> str:
    return f"{spec}-{'async' if window == 2 else 'sync'}"


@pytest.fixture(scope="module")
def prompts(smollm2_dir, grounded_rows) -> dict[int, list[int]]:
    """Prompt ids of ROWS (the shared workload's chat rows through the chat template)."""
    return dict(zip(ROWS, prompt_ids(smollm2_dir, [grounded_rows[r] for r in ROWS])))


def _runner_for(request, spec: str, draft: str = "draft_runner"):
    return request.getfixturevalue({"draft": draft, "eagle": "eagle_runner"}.get(spec, "ngram_runner"))


def _run(runner, spec: str, window: int, requests: dict[str, tuple[list[int], dict]]):
    """Drive `requests` (id -> (prompt, add_request kwargs)) through the runner; the trace and
    the scheduler (for its stats)."""
    scheduler = make_scheduler(runner, num_spec_tokens=0 if spec == "none" else K)
    for req_id, (prompt, kwargs) in requests.items():
        scheduler.add_request(req_id, prompt, *split_options(kwargs))
    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=window)
    return trace, scheduler


class _OpenAIPenalty:
    """A Hugging Face logits processor applying OpenAI's penalties over generated tokens only."""

    def __init__(self, num_prompt: int, frequency: float, presence: float) -> None:
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.num_prompt :].tolist()
        return _openai_penalties(scores, [out], self.frequency, self.presence)


REPETITION = 1.3
FREQUENCY, PRESENCE = 0.6, 0.4


def _hf_penalized(smollm2_dir, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Hugging Face greedy continuations of `prompt` with repetition_penalty=REPETITION, and
    with OpenAI's frequency/presence penalties applied to its logits by a logits processor."""
    return _hf_penalized_cached(str(smollm2_dir), tuple(prompt), max_tokens)


@functools.cache  # every mode compares against the same references
def _hf_penalized_cached(smollm2_dir: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[list[int], list[int]]:
    from transformers import LogitsProcessorList

    model = load_hf_model(Path(smollm2_dir))
    ids = torch.tensor([prompt])
    common = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        rep = model.generate(ids, repetition_penalty=REPETITION, **common)[0, len(prompt) :]
        procs = LogitsProcessorList([_OpenAIPenalty(len(prompt), FREQUENCY, PRESENCE)])
        oa = model.generate(ids, logits_processor=procs, **common)[0, len(prompt) :]
    return rep.tolist(), oa.tolist()


def check_penalized_greedy(
    request, smollm2_dir, prompts, spec: str, window: int, rows: tuple[int, ...], max_tokens: int
) -> None:
    runner = _runner_for(request, spec)
    requests = {}
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    for row in rows:
        requests[f"rep{row}"] = (prompts[row], dict(repetition_penalty=REPETITION, **common))
        requests[f"oa{row}"] = (prompts[row], dict(frequency_penalty=FREQUENCY, presence_penalty=PRESENCE, **common))
    trace, scheduler = _run(runner, spec, window, requests)
    for row in rows:
        rep_ref, oa_ref = _hf_penalized(smollm2_dir, prompts[row], max_tokens)
        assert trace.outputs[f"rep{row}"].token_ids == rep_ref, ("repetition", row)
        assert trace.outputs[f"oa{row}"].token_ids == oa_ref, ("frequency/presence", row)
    if spec != "none":
        assert scheduler.stats.spec.num_accepted_tokens > 0, "no draft accepted under penalties"


@pytest.mark.parametrize("spec,window", [pytest.param(*m, id=_mode_id(*m)) for m in MODES])
def test_penalized_greedy_matches_hf_in_every_mode(request, smollm2_dir, prompts, spec, window):
    """Greedy with repetition_penalty equals HF `generate(repetition_penalty=1.3)`; greedy with
    frequency/presence penalties equals HF with those penalties applied to its logits; both in
    one batch, for sync/async x none/n-gram/draft. Under speculation the row of draft j counts
    drafts 0..j-1, so accepted drafts prove the counts are per position."""
    check_penalized_greedy(request, smollm2_dir, prompts, spec, window, FAST_ROWS, FAST_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("spec,window", [pytest.param(*m, id=_mode_id(*m)) for m in MODES])
def test_penalized_greedy_matches_hf_in_every_mode_full(request, smollm2_dir, prompts, spec, window):
    """The same on 8 rows (16 requests in one batch) at 32 new tokens."""
    check_penalized_greedy(request, smollm2_dir, prompts, spec, window, FULL_ROWS, FULL_TOKENS)


SEEDED = dict(
    ignore_eos=True,
    temperature=0.9,
    top_p=0.95,
    min_p=0.02,
    repetition_penalty=1.1,
    frequency_penalty=0.3,
    presence_penalty=0.2,
    logit_bias={13: -5.0, 198: 2.0},
)


def check_seeded(
    request,
    prompts,
    rows: tuple[int, ...],
    max_tokens: int,
    batched: list[tuple[str, int]],
    alone: list[tuple[str, int]],
) -> None:
    """Seeded outputs are identical across the given modes and batch compositions.

    Every mode emits the target's own keyed sample at each position: without speculation it is
    the only draw; n-gram drafts and draft-model drafts under `--draft-acceptance keyed` are
    accepted iff they equal it. So the tokens cannot depend on where verification rows start.
    """
    requests = {f"s{row}": (prompts[row], dict(SEEDED, max_tokens=max_tokens, seed=777 + row)) for row in rows}
    runs = {}
    for spec, window in batched:
        trace, _ = _run(_runner_for(request, spec, "keyed_draft_runner"), spec, window, requests)
        runs[(spec, window, "batched")] = {r: o.token_ids for r, o in trace.outputs.items()}
    for spec, window in alone:
        outs = {}
        for req_id, req in requests.items():
            trace, _ = _run(_runner_for(request, spec, "keyed_draft_runner"), spec, window, {req_id: req})
            outs[req_id] = trace.outputs[req_id].token_ids
        runs[(spec, window, "alone")] = outs
    baseline = runs[(*batched[0], "batched")]
    assert all(len(t) == max_tokens for t in baseline.values())
    for config, outs in runs.items():
        assert outs == baseline, config


def test_seeded_sampling_with_penalties_is_identical_across_modes_and_batches(request, prompts):
    """Temperature 0.9, top-p, min_p, logit_bias and all three penalties with a seed per
    request: the same tokens without speculation (sync), with n-gram speculation (async), with
    draft-model speculation (async) and with the EAGLE head (sync), batched and alone."""
    check_seeded(
        request,
        prompts,
        FAST_ROWS,
        FAST_TOKENS,
        batched=[("none", 1), ("ngram", 2), ("draft", 2), ("eagle", 1)],
        alone=[("ngram", 2), ("eagle", 2)],
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 6 batched runs and 16 lone ones at 32 tokens: over 15 min loaded
def test_seeded_sampling_with_penalties_is_identical_across_modes_and_batches_full(request, prompts):
    """The same for sync/async x none/n-gram/draft, batched, and alone for both proposers, on
    8 rows."""
    check_seeded(
        request,
        prompts,
        FULL_ROWS,
        FULL_TOKENS,
        batched=MODES,
        alone=[("ngram", 2), ("draft", 1)],
    )


def test_top_logprobs_belong_to_the_accepted_tokens(ngram_runner, smollm2_dir, prompts):  # noqa: F811
    """top_logprobs=5 with n-gram drafts accepted several at a time, two plans in flight: the
    N entries at each returned token are Hugging Face's top 5 at that position, and the token's
    own logprob matches."""
    prompt = prompts[ROWS[0]]
    scheduler = make_scheduler(ngram_runner)
    scheduler.add_request(
        "t", prompt, SamplingOptions(logprobs=True, top_logprobs=5), StoppingOptions(max_tokens=24, ignore_eos=True)
    )
    tops: list[tuple[list[int], list[float]]] = []
    with recording(ngram_runner) as rec:
        original = scheduler.on_step_result

        def keep(result):
            events = original(result)
            for ev in events:
                tops.extend(ev.top_logprobs)
            return events

        scheduler.on_step_result = keep
        trace = drive(ngram_runner, scheduler, rec, window=2)
    out = trace.outputs["t"]
    assert scheduler.stats.spec.num_accepted_tokens > 0
    assert len(tops) == len(out.token_ids) == len(out.logprobs) == 24
    hf = load_hf_model(Path(smollm2_dir))
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    ref = logits.log_softmax(-1)
    for j, (ids, lps) in enumerate(tops):
        ref_vals, ref_ids = ref[j].topk(5)
        assert torch.allclose(torch.tensor(lps), ref_vals, atol=2e-3), j
        # Same set of tokens (order may differ only between near-equal logprobs).
        assert set(ids) == set(ref_ids.tolist()) or torch.allclose(ref[j][ids], ref_vals, atol=2e-3), j
    assert torch.allclose(
        torch.tensor(out.logprobs), ref.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=2e-3
    )


def test_n_sequences_share_the_prompt_blocks(ngram_runner, prompts):  # noqa: F811
    """n = 3 (sequences 2 and 3 deferred behind the first, `share_prompt_with`): they reuse the
    first one's prompt blocks from the prefix cache, and each sequence's tokens equal what the
    same seed gives as a lone request."""
    prompt = prompts[ROWS[1]]
    kw = dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0)
    seeds = [sequence_seed(99, i) for i in range(3)]
    scheduler = make_scheduler(ngram_runner)
    for i, seed in enumerate(seeds):
        scheduler.add_request(
            f"n#{i}", prompt, *split_options(dict(kw, seed=seed)), share_prompt_with="n#0" if i else None
        )
    assert scheduler.num_waiting() == 3
    with recording(ngram_runner) as rec:
        trace = drive(ngram_runner, scheduler, rec, window=2)
    block_size = ngram_runner.config.block_size
    first_plan = trace.steps[0][0]
    assert [e.req_id for e in plan_rows(first_plan)] == ["n#0"]
    shared = (len(prompt) - 1) // block_size * block_size
    later = [e for plan, _, _ in trace.steps for e in plan_rows(plan) if e.is_new and e.req_id != "n#0"]
    assert sorted(e.req_id for e in later) == ["n#1", "n#2"]
    assert all(e.num_cached_tokens == shared > 0 for e in later)
    outs = [trace.outputs[f"n#{i}"].token_ids for i in range(3)]
    assert len({tuple(o) for o in outs}) == 3, "sequences with distinct seeds came out equal"
    for i, seed in enumerate(seeds):
        trace, _ = _run(ngram_runner, "ngram", 1, {"alone": (prompt, dict(kw, seed=seed))})
        assert trace.outputs["alone"].token_ids == outs[i], i
