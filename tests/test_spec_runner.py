"""The worker runtime (`ModelRunner` on the real SmolLM2) against DESIGN.md's field failure modes.

Everything runs in-process, without gRPC. Two drivers feed the runner:

- hand-built `StepPlan`s (`HandPlanner`), where a test decides exactly when a request joins, is
  skipped, finishes, resumes or gets fewer draft slots than its proposer produced;
- the real `Scheduler` (`drive`), with up to `window` plans in flight exactly as
  `scheduler_svc.worker_link` keeps them: results reach the scheduler one or more plans late.

`runner.model` is wrapped by `RecordingModel`, which asserts that every id the model is fed is a
real token and records ids and positions per step. That is instrumentation: the real forward
still runs and produces the outputs. Hugging Face greedy `generate` (and its logits, for
logprobs) is the oracle; seeded sampling is checked by identity across configurations.
"""

from __future__ import annotations

import contextlib
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from scheduler_svc.scheduler import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_MAX_TOKENS,
    FINISH_STOP_SEQUENCE,
    RequestEvent,
    Scheduler,
    SchedulerConfig,
)
from scheduler_svc.tokenizer import Tokenizer
from tests.e2e import hf_reference, prompt_ids
from tests.hf_oracle import hf_greedy, load_hf_model
from worker_svc.server import WorkerConfig, build_runner, tokenizer_fields
from zerobubble.api import worker_pb2

pytestmark = pytest.mark.timeout(900)

K = 3  # draft tokens per decode (the issue's --num-spec-tokens 3)
# Grounded rows whose Hugging Face greedy run reaches 64 tokens without EOS and whose prompts are
# short (157-188 tokens): code edits, where prompt lookup finds plenty of drafts.
SHORT_CODE_ROWS = (7, 4, 0, 3)


# ------------------------------------------------------------------------------ instrumentation


@dataclass(slots=True)
class Call:
    """One forward of the wrapped model: flat ids, positions and row boundaries."""

    ids: list[int]
    positions: list[int]
    qsl: list[int]

    def row(self, i: int) -> tuple[list[int], list[int]]:
        lo, hi = self.qsl[i], self.qsl[i + 1]
        return self.ids[lo:hi], self.positions[lo:hi]


class RecordingModel:
    """Wraps a `CausalLM`: every input id must be a real token; inputs are recorded per call.

    The runner builds decode inputs on the device from its own state; this is the one place
    where a stale or placeholder (-1) id would become visible before it corrupts the KV cache.
    """

    def __init__(self, model, vocab_size: int) -> None:
        self._model = model
        self.vocab_size = vocab_size
        self.calls: list[Call] = []

    def __call__(self, input_ids, positions, meta, kv_caches):
        ids = input_ids.tolist()
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size]
        assert not bad, f"model fed ids outside [0, {self.vocab_size}): (index, id) {bad[:8]}"
        self.calls.append(Call(ids, positions.tolist(), meta.query_start_loc.tolist()))
        return self._model(input_ids, positions, meta, kv_caches)

    def __getattr__(self, name):
        return getattr(self._model, name)


@dataclass(slots=True)
class Recorders:
    target: RecordingModel
    draft: RecordingModel | None


@contextlib.contextmanager
def recording(runner) -> Iterator[Recorders]:
    """Install `RecordingModel` on the runner's model (and the draft model's), then restore."""
    vocab = runner.loaded.hf_config.vocab_size
    target = RecordingModel(runner.model, vocab)
    draft_loaded = getattr(runner.proposer, "draft", None)
    draft = RecordingModel(draft_loaded.model, vocab) if draft_loaded is not None else None
    runner.model = target
    if draft is not None:
        draft_loaded.model = draft
    try:
        yield Recorders(target, draft)
    finally:
        runner.model = target._model
        if draft is not None:
            draft_loaded.model = draft._model


# -------------------------------------------------------------------------------------- fixtures


def _runner(spec: str):
    cfg = WorkerConfig(spec_method=spec, num_spec_tokens=K, kv_cache_memory_gb=0.25,
                       max_num_seqs=16, draft_model="smollm2-135m" if spec == "draft" else "")
    runner, _ = build_runner(cfg)
    return runner


@pytest.fixture(scope="module")
def ngram_runner(smollm2_dir):
    return _runner("ngram")


@pytest.fixture(scope="module")
def draft_runner(smollm2_dir):
    # SmolLM2 drafting for itself, as in the matrix: greedy drafts are then always right,
    # so a rejected draft can only mean that the runner fed or verified the wrong thing.
    return _runner("draft")


@pytest.fixture(params=["ngram", "draft"])
def spec_runner(request):
    return request.getfixturevalue(f"{request.param}_runner")


@pytest.fixture(scope="module")
def grounded(smollm2_dir, grounded_rows) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, Hugging Face greedy outputs capped at 64 tokens) for every grounded row."""
    return prompt_ids(smollm2_dir, grounded_rows), hf_reference(smollm2_dir, grounded_rows)


# -------------------------------------------------------------------------- hand-built plans


@dataclass(slots=True)
class HandRequest:
    """What the test knows about one request it plans by hand."""

    prompt: list[int]
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    written: int = 0              # tokens whose K/V the worker holds (its true length)
    drafts: list[int] = field(default_factory=list)  # proposed after its latest sample
    sampled: bool = False

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.outputs


def ngram_reference(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup as DESIGN.md describes it, written naively: the longest suffix (max_n down
    to min_n) that occurred earlier, its most recent occurrence, and up to k tokens after it."""
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        for end in range(length - 2, n - 2, -1):  # windows that end before the last token
            if seq[end - n + 1:end + 1] == suffix:
                return seq[end + 1:end + 1 + k]
    return []


class HandPlanner:
    """Builds plans without a scheduler and checks every step's model inputs as it goes.

    Each admission gets all the blocks it will need up front; decode inputs are predicted from
    the test's own bookkeeping: the request's last token followed by the drafts its proposer
    wrote after that token was sampled, with any slot beyond them repeating the last token.
    Those drafts are read from the runner's state right after the step, and checked against an
    independent oracle: a naive n-gram lookup over the request's own tokens, or, for SmolLM2
    drafting for itself, Hugging Face's greedy continuation (`greedy`, per request id).
    """

    def __init__(self, runner, recorders: Recorders, max_outputs: int = 64,
                 greedy: dict[str, list[int]] | None = None, exact: bool = False) -> None:
        self.runner = runner
        self.rec = recorders
        self.greedy = greedy or {}
        # exact: blocks only for the slots a step feeds, none spare (the scheduler's allocation
        # when no block is free for lookahead slots); otherwise everything up front.
        self.exact = exact
        self.max_outputs = max_outputs
        self.free = list(range(runner.config.num_blocks - 1, -1, -1))
        self.reqs: dict[str, HandRequest] = {}
        self.step_id = 0
        self.results: list[worker_pb2.StepResult] = []
        self.trimmed = 0  # decode rows that got fewer slots than their proposer produced

    def _blocks(self, num_tokens: int) -> list[int]:
        bs = self.runner.config.block_size
        return [self.free.pop() for _ in range(-(-num_tokens // bs))]

    def new(self, req_id: str, prompt: list[int] | None = None, *,
            chunk: int | None = None) -> worker_pb2.ScheduledRequest:
        """Admit (or re-admit after `finish`) with the known tokens as prefill.

        Blocks kept by `finish` are re-used as a prefix-cache hit. `chunk` limits the first
        prefill chunk (which then does not sample).
        """
        req = self.reqs.get(req_id)
        if req is None:
            req = self.reqs[req_id] = HandRequest(list(prompt))
        known = req.seq
        bs = self.runner.config.block_size
        kept = req.blocks
        cached = len(kept) * bs
        spare = 0 if self.exact else self.max_outputs + K + 1
        req.blocks = kept + self._blocks(len(known) + spare - cached)
        req.written = cached
        req.drafts = []
        req.sampled = False
        tokens = known[cached:] if chunk is None else known[cached:cached + chunk]
        entry = worker_pb2.ScheduledRequest(
            req_id=req_id, token_ids=tokens, new_block_ids=req.blocks, is_new=True,
            num_cached_tokens=cached, sample=cached + len(tokens) == len(known))
        entry.sampling.seed = 7
        return entry

    def prefill(self, req_id: str, num_tokens: int | None = None) -> worker_pb2.ScheduledRequest:
        req = self.reqs[req_id]
        known = req.seq
        end = len(known) if num_tokens is None else req.written + num_tokens
        return worker_pb2.ScheduledRequest(req_id=req_id, token_ids=known[req.written:end],
                                           sample=end == len(known))

    def decode(self, req_id: str, k: int = K) -> worker_pb2.ScheduledRequest:
        req = self.reqs[req_id]
        bs = self.runner.config.block_size
        need = -(-(req.written + 1 + k) // bs) - len(req.blocks)
        new = self._blocks(need * bs) if need > 0 else []
        req.blocks += new
        return worker_pb2.ScheduledRequest(req_id=req_id, num_draft_slots=k, sample=True,
                                           new_block_ids=new)

    def finish(self, req_id: str, keep_blocks: int = 0) -> str:
        """Free the request's blocks except `keep_blocks` leading full ones (kept for a resume
        with a prefix-cache hit); the caller puts the returned id in `finished`."""
        req = self.reqs[req_id]
        assert keep_blocks * self.runner.config.block_size <= req.written
        self.free.extend(req.blocks[keep_blocks:])
        req.blocks = req.blocks[:keep_blocks]
        return req_id

    def step(self, *entries: worker_pb2.ScheduledRequest,
             finished: tuple[str, ...] = ()) -> worker_pb2.StepResult:
        """Execute one plan, check what the model saw and apply the result to the bookkeeping."""
        self.step_id += 1
        plan = worker_pb2.StepPlan(step_id=self.step_id, requests=entries,
                                   finished_req_ids=finished)
        num_calls = len(self.rec.target.calls)
        result = self.runner.execute(plan).materialize(0.0, self.runner.num_spec_tokens)
        self.results.append(result)
        assert len(self.rec.target.calls) == num_calls + 1, "one target forward per plan"
        call = self.rec.target.calls[-1]
        by_id = {r.req_id: r for r in result.results}
        for i, entry in enumerate(entries):
            req = self.reqs[entry.req_id]
            ids, positions = call.row(i)
            assert positions == list(range(req.written, req.written + len(ids))), \
                f"{entry.req_id}: positions {positions[:3]}.. but the worker holds {req.written}"
            res = by_id[entry.req_id]
            if entry.token_ids:
                assert ids == list(entry.token_ids), f"{entry.req_id}: prefill ids changed"
                req.written += len(ids)
                if not entry.sample:
                    assert not res.token_ids, f"{entry.req_id}: a non-sampling chunk emitted"
            else:
                assert req.sampled, f"{entry.req_id}: test error, decode before a sample"
                k = entry.num_draft_slots
                used = req.drafts[:k]
                self.trimmed += len(req.drafts) > k
                last = req.seq[-1]
                # Filler slots (no real draft) are fed only where the worker keeps the plan's
                # shape (CUDA); on the CPU they are skipped, never replaced by stale ids.
                fillers = 0 if self.runner.trim_empty_drafts else k - len(used)
                expected = [last] + used + [last] * fillers
                assert ids == expected, (
                    f"{entry.req_id}: decode inputs {ids}, expected last token + its own drafts "
                    f"{expected} (stale or foreign drafts reached the model)")
                # Acceptance accounting: only drafts actually fed are verified.
                assert res.num_draft_tokens == len(used), (entry.req_id, res.num_draft_tokens, used)
                assert 0 <= res.num_accepted <= res.num_draft_tokens
                assert list(res.token_ids[:-1]) == used[:res.num_accepted]
                req.written += 1 + res.num_accepted
            if entry.sample:
                assert len(res.token_ids) >= 1
                req.outputs.extend(res.token_ids)
                req.sampled = True
                slot = self.runner.slots[entry.req_id].slot
                num = int(self.runner.state.num_drafts[slot])
                req.drafts = self.runner.state.drafts[slot, :num].tolist()
                self._check_proposal(entry.req_id, req)
            else:
                req.drafts = []
        assert sum(result.accepted_per_pos) == sum(r.num_accepted for r in result.results)
        return result

    def _check_proposal(self, req_id: str, req: HandRequest) -> None:
        proposer = self.runner.proposer
        if not proposer.has_draft_probs:
            expected = ngram_reference(req.seq, proposer.ngram_min, proposer.ngram_max, K)
            assert req.drafts == expected, f"{req_id}: n-gram drafts {req.drafts}, not {expected}"
        elif req_id in self.greedy:
            # Draft j comes from the draft model's logits at position written + j, so it needs
            # that slot allocated: fewer drafts only when the blocks end sooner.
            room = len(req.blocks) * self.runner.config.block_size - req.written
            done = len(req.outputs)
            expected = self.greedy[req_id][done:done + K]
            assert len(req.drafts) == max(0, min(K, room)), (req_id, req.drafts, room)
            assert req.drafts[:len(expected)] == expected[:len(req.drafts)], \
                f"{req_id}: self-drafts {req.drafts}, greedy continuation {expected}"
            self._check_draft_cache(req_id, req)

    def _check_draft_cache(self, req_id: str, req: HandRequest) -> None:
        """SmolLM2 drafting for itself: wherever the draft model's cache claims valid K/V
        (`draft_len`) and the target's holds confirmed tokens, the two must agree, layer by
        layer. Stale K/V of another request, or a token written at the wrong position, differ."""
        proposer = self.runner.proposer
        bs = self.runner.config.block_size
        valid = min(int(proposer.draft_len[self.runner.slots[req_id].slot]), req.written)
        pos = torch.arange(valid)
        blocks, offsets = torch.tensor(req.blocks)[pos // bs], pos % bs
        for layer, (target, draft) in enumerate(zip(self.runner.kv_caches, proposer.kv_caches)):
            for name, t, d in zip("KV", target, draft):
                diff = (t[blocks, offsets] - d[blocks, offsets]).abs().amax(dim=(1, 2))
                bad = (diff > 1e-3).nonzero()[:, 0].tolist()
                assert not bad, f"{req_id}: draft {name} cache differs at positions {bad[:8]} (layer {layer})"


def assert_greedy_prefix(name: str, ours: list[int], reference: list[int]) -> None:
    n = min(len(ours), len(reference))
    assert n > 0 and ours[:n] == reference[:n], f"{name}: {ours[:n]} vs Hugging Face {reference[:n]}"


# -------------------------------------------------------------- stale / placeholder draft ids


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
        p.step(p.decode("A"), p.new("B", prompts[b]))            # B joins A's drafting decode
        p.step(p.decode("A"), p.decode("B"))
        p.step(p.decode("B"))                                    # A skipped for a step
        p.step(p.decode("A"), p.decode("B", 1))                  # A after the gap; B trimmed
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
    assert sum(r.num_accepted for res in p.results for r in res.results) > 0
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
            res = p.step(p.decode("r", k)).results[0]
            ids, _ = rec.target.calls[fed_before].row(0)
            fed = ids[1:1 + min(k, len(offered))]
            # Ground truth for acceptance: how many fed drafts equal the greedy tokens there.
            start = len(p.reqs["r"].outputs) - len(res.token_ids)
            truth = reference[start:start + len(fed)]
            expected_accepted = next((i for i, (d, t) in enumerate(zip(fed, truth)) if d != t),
                                     len(fed))
            assert res.num_draft_tokens == len(fed) == min(k, len(offered))
            assert res.num_accepted == expected_accepted, (k, fed, truth, res)
            assert list(res.token_ids) == reference[start:start + res.num_accepted + 1]
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
        p = HandPlanner(runner, rec, greedy={"X": reference[row], "W": reference[other]},
                        exact=True)
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


# ---------------------------------------------------------------------- scheduler-driven harness


def make_scheduler(runner, *, num_blocks: int = 0, num_spec_tokens: int | None = None,
                   **policy) -> Scheduler:
    """The real Scheduler configured from the runner, as the worker link does from `Describe`."""
    cfg = runner.config
    info = worker_pb2.WorkerInfo(
        num_blocks=num_blocks or cfg.num_blocks, block_size=cfg.block_size,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        num_spec_tokens=runner.num_spec_tokens if num_spec_tokens is None else num_spec_tokens,
        spec_method="draft" if getattr(runner.proposer, "has_draft_probs", False) else "ngram",
        eos_token_ids=runner.loaded.eos_token_ids, vocab_size=runner.loaded.hf_config.vocab_size)
    fields = tokenizer_fields(runner.loaded.path)
    tokenizer = Tokenizer(fields["tokenizer_json"], fields["chat_template"], fields["bos_token"],
                          fields["eos_token"])
    return Scheduler(SchedulerConfig(**policy).with_worker(info), tokenizer,
                     rng=random.Random(0))


@dataclass(slots=True)
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: int | None = None


@dataclass(slots=True)
class Trace:
    """Everything one `drive` saw: plans with their model inputs and results, and the outputs."""

    steps: list[tuple[worker_pb2.StepPlan, Call, worker_pb2.StepResult]] = field(default_factory=list)
    outputs: dict[str, Outcome] = field(default_factory=dict)
    max_inflight_seen: int = 0


def drive(runner, scheduler: Scheduler, rec: Recorders, *, window: int,
          after_result: Callable[[Scheduler, Trace, deque], list[RequestEvent]] | None = None,
          max_plans: int = 5000) -> Trace:
    """Run until every request is done, keeping up to `window` plans ahead of their results.

    Like the worker link, it plans until the window is full, then hands the oldest result to the
    scheduler. The runner executes each plan as soon as it is planned (in order), so its state
    runs ahead of what the scheduler knows, exactly as on a real worker.
    """
    runner.reset()
    trace = Trace()
    inflight: deque = deque()

    def collect(events: list[RequestEvent]) -> None:
        for ev in events:
            out = trace.outputs.setdefault(ev.req_id, Outcome())
            assert out.finish_reason is None, f"{ev.req_id}: tokens after its final event"
            out.token_ids.extend(ev.token_ids)
            out.logprobs.extend(ev.logprobs)
            out.finish_reason = ev.finish_reason

    num_plans = 0
    while scheduler.has_unfinished() or inflight:
        while len(inflight) < window:
            plan = scheduler.schedule()
            if plan is None:
                break
            num_plans += 1
            assert num_plans <= max_plans, "livelock?"
            for entry in plan.requests:
                req = scheduler.get_request(entry.req_id)
                # Never a slot that could not be verified before max_tokens.
                assert req.num_pending_outputs <= req.max_tokens, (entry.req_id, req.max_tokens)
                assert req.num_placeholders >= 0
            num_calls = len(rec.target.calls)
            pending = runner.execute(plan)
            assert len(rec.target.calls) == num_calls + 1
            inflight.append((plan, rec.target.calls[-1], pending))
            trace.max_inflight_seen = max(trace.max_inflight_seen, len(inflight))
        assert inflight, "scheduler stalled with unfinished requests and nothing in flight"
        plan, call, pending = inflight.popleft()
        result = pending.materialize(0.0, runner.num_spec_tokens)
        assert not result.error, result.error
        trace.steps.append((plan, call, result))
        collect(scheduler.on_step_result(result))
        if after_result is not None:
            collect(after_result(scheduler, trace, inflight))
    return trace


def audit(trace: Trace, prompts: dict[str, list[int]], *, ngram: bool) -> None:
    """Check every row the model was fed against the request's final token sequence.

    Prefill ids are the request's known tokens at their positions; a decode row starts with the
    request's own token at the worker's true length, and the tokens a step returns land right
    after it. With n-gram drafts, every fed draft is a token the request's own sequence already
    held (a draft from another request, or -1, would not be).
    """
    for plan, call, result in trace.steps:
        by_id = {r.req_id: r for r in result.results}
        for i, entry in enumerate(plan.requests):
            seq = prompts[entry.req_id] + trace.outputs[entry.req_id].token_ids
            ids, positions = call.row(i)
            start = positions[0]
            assert positions == list(range(start, start + len(ids)))
            if entry.token_ids:
                assert ids == list(entry.token_ids) == seq[start:start + len(ids)], entry.req_id
                continue
            if start >= len(seq):
                continue  # a step in flight past a stop: its result was dropped
            assert ids[0] == seq[start], (entry.req_id, start, ids, seq[start])
            returned = list(by_id[entry.req_id].token_ids)
            tail = seq[start + 1:start + 1 + len(returned)]
            assert returned[:len(tail)] == tail, (entry.req_id, start, returned, tail)
            if ngram:
                own = set(seq[:start + 1])
                assert all(t in own for t in ids[1:]), (entry.req_id, ids)


def assert_matches(outputs: dict[str, Outcome], reference: dict[str, list[int]],
                   min_identical: int | None = None) -> None:
    differ = [r for r in reference if outputs[r].token_ids != reference[r]]
    allowed = 0 if min_identical is None else len(reference) - min_identical
    assert len(differ) <= allowed, "\n".join(
        f"{r}: ours {outputs[r].token_ids} vs HF {reference[r]}" for r in differ)


# ---------------------------------------------------------------------------- max_tokens limit


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
        scheduler.add_request(f"m{n}", prompt, max_tokens=n, ignore_eos=True)
    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=window)
    audit(trace, prompts, ngram=True)
    for n in range(1, 6):
        out = trace.outputs[f"m{n}"]
        assert out.finish_reason == FINISH_MAX_TOKENS
        assert out.token_ids == reference[:n]
    assert scheduler.stats.num_accepted_tokens > 0, "drafts never accepted: the limit was not tested"


# ------------------------------------------------------------------------------------ logprobs


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
        scheduler.add_request(f"r{row}", prompts_all[row], max_tokens=24, logprobs=True,
                              temperature=temperature, seed=100 + i)
    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=2)
    audit(trace, prompts, ngram=spec == "ngram")
    assert scheduler.stats.num_accepted_tokens > 0, "no multi-token step: alignment not tested"
    hf = load_hf_model(Path(smollm2_dir))
    for req_id, prompt in prompts.items():
        out = trace.outputs[req_id]
        assert len(out.logprobs) == len(out.token_ids) > 0
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        expected = logits.log_softmax(-1)[len(prompt) - 1:-1].gather(
            -1, torch.tensor(out.token_ids)[:, None])[:, 0]
        got = torch.tensor(out.logprobs)
        assert torch.allclose(got, expected, atol=2e-3), (req_id, (got - expected).abs().max())


# ------------------------------------------------------- finish / cancel with a step in flight


def test_results_for_requests_finished_or_cancelled_in_flight_are_dropped(ngram_runner, grounded):
    """With three plans in flight: one request stops on a stop token, one is cancelled, while
    later steps for them are already queued on the worker. Their in-flight results are dropped
    (never emitted, never twice), the worker forgets them at the next plan, their slots and
    blocks go to a request admitted later, and everyone else keeps Hugging Face's tokens."""
    runner = ngram_runner
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
    scheduler.add_request(f"r{a}", prompts_all[a], max_tokens=40, stop_token_ids=[stop_token])
    for row in (b, c, d):
        scheduler.add_request(f"r{row}", prompts_all[row], max_tokens=40)
    cancelled: dict[str, int] = {}

    def cancel_b_in_flight(sched: Scheduler, trace: Trace, inflight: deque) -> list[RequestEvent]:
        out = trace.outputs.get(f"r{b}")
        planned = any(e.req_id == f"r{b}" for plan, _, _ in inflight for e in plan.requests)
        if out is not None and len(out.token_ids) >= 5 and planned and not cancelled:
            cancelled["at"] = len(out.token_ids)
            return [sched.abort_request(f"r{b}")]  # the final event the client gets
        return []

    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=3, after_result=cancel_b_in_flight)
    audit(trace, prompts, ngram=True)
    assert trace.max_inflight_seen == 3
    assert cancelled, "B was never cancelled with a step in flight"
    out_a, out_b = trace.outputs[f"r{a}"], trace.outputs[f"r{b}"]
    assert out_a.finish_reason == FINISH_STOP_SEQUENCE
    assert out_b.finish_reason == FINISH_CANCELLED
    assert out_a.token_ids == reference_all[a][:stop_at + 1]
    assert out_b.token_ids == reference_all[b][:cancelled["at"]]
    for row in (c, d):
        assert trace.outputs[f"r{row}"].token_ids == reference_all[row][:40]
    assert scheduler.stats.num_stale_results >= 2

    # Steps that ran after each finish were discarded and the worker was told to forget them.
    def steps_with(req_id: str) -> list[int]:
        return [i for i, (plan, _, _) in enumerate(trace.steps)
                if any(e.req_id == req_id for e in plan.requests)]

    for req_id in (f"r{a}", f"r{b}"):
        notices = [i for i, (plan, _, _) in enumerate(trace.steps) if req_id in plan.finished_req_ids]
        assert len(notices) == 1, (req_id, notices)
        assert max(steps_with(req_id)) < notices[0]
    # D could only start once a slot was free, and it ran on blocks A or B had held.
    first_d = min(steps_with(f"r{d}"))
    assert any(f"r{a}" in plan.finished_req_ids or f"r{b}" in plan.finished_req_ids
               for plan, _, _ in trace.steps[:first_d + 1])

    def blocks_of(req_id: str) -> set[int]:
        return {b for plan, _, _ in trace.steps for e in plan.requests if e.req_id == req_id
                for b in e.new_block_ids}

    assert blocks_of(f"r{d}") & (blocks_of(f"r{a}") | blocks_of(f"r{b}"))
    assert not runner.slots.keys() & {f"r{a}", f"r{b}"}


# ------------------------------------------- preemption + chunked prefill with steps in flight


@pytest.mark.parametrize("spec", ["ngram", "draft"])
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
        scheduler.add_request(f"r{row}", prompts_all[row], max_tokens=max_tokens)
    with recording(runner) as rec:
        trace = drive(runner, scheduler, rec, window=2)
    audit(trace, prompts, ngram=spec == "ngram")
    assert scheduler.stats.num_preemptions > 0
    assert scheduler.stats.num_stale_results > 0, "no preemption hit a step in flight"
    assert any(len(plan.requests) > 1 and any(e.token_ids for e in plan.requests)
               and any(not e.token_ids for e in plan.requests) for plan, _, _ in trace.steps), \
        "prefill chunks never shared a step with decodes"
    stats = scheduler.stats
    assert stats.num_accepted_tokens > 0
    if spec == "draft":
        # SmolLM2 drafting for itself agrees with its own greedy choice unless the draft model's
        # KV cache went out of step with the confirmed tokens (resume, prefix hit, no lookahead).
        assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, \
            (stats.num_accepted_tokens, stats.num_draft_tokens)
    reference = {f"r{row}": reference_all[row][:max_tokens] for row in rows}
    for req_id, out in trace.outputs.items():
        assert out.finish_reason in (FINISH_EOS, FINISH_MAX_TOKENS)
    assert_matches(trace.outputs, reference)


# ------------------------------------------------------------------ seeded sampling identity


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
                scheduler.add_request(f"r{row}", prompts_all[row], max_tokens=max_tokens,
                                      temperature=0.8, seed=4242 + row)
            with recording(runner) as rec:
                trace = drive(runner, scheduler, rec, window=window)
            num_draft_tokens += scheduler.stats.num_draft_tokens
            outs.update({r: o.token_ids for r, o in trace.outputs.items()})
        assert (num_draft_tokens > 0) == (k > 0), (window, k, batched)
        runs[(window, k, batched)] = outs
    baseline = runs[configs[0]]
    # Sampling really happened: the seeded outputs are not just the greedy ones.
    assert any(baseline[f"r{row}"] != reference_all[row][:max_tokens] for row in rows)
    for config, outs in runs.items():
        for req_id, tokens in outs.items():
            assert tokens == baseline[req_id], (config, req_id)
