"""The in-process runner harness of the worker-runtime tests (tests/inprocess/test_spec_runner.py and
tests/inprocess/test_sampling_controls.py): the real `ModelRunner` on SmolLM2 fed by hand-built plans
(`HandPlanner`) or by the real `Scheduler` with plans in flight (`drive`), with
`RecordingModel` checking every id the model is fed. Fixtures are imported by name.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from tests.support.drive import make_scheduler  # noqa: F401  (re-exported for the harness users)
from tests.support.hand_plans import make_plan
from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions
from zerobubble.rows import PlanRow, plan_rows, result_rows
from zerobubble.scheduler_svc.scheduler import (
    RequestEvent,
    Scheduler,
)

K = 3  # draft tokens per decode (--num-spec-tokens 3, as the benchmarks run)


SHORT_CODE_ROWS = (7, 4, 0, 3)


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
    # The step's device runs the target model (an eager one, or the one behind decode graphs).
    device = getattr(runner.parts.device, "eager", runner.parts.device)
    target = RecordingModel(device.model, vocab)
    draft_loaded = getattr(runner.proposer, "draft", None)
    draft = RecordingModel(draft_loaded.model, vocab) if draft_loaded is not None else None
    device.model = target
    if draft is not None:
        draft_loaded.model = draft
    try:
        yield Recorders(target, draft)
    finally:
        device.model = target._model
        if draft is not None:
            draft_loaded.model = draft._model


@dataclass(slots=True)
class HandRequest:
    """What the test knows about one request it plans by hand."""

    prompt: list[int]
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    written: int = 0  # tokens whose K/V the worker holds (its true length)
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
        suffix = seq[length - n :]
        for end in range(length - 2, n - 2, -1):  # windows that end before the last token
            if seq[end - n + 1 : end + 1] == suffix:
                return seq[end + 1 : end + 1 + k]
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

    def __init__(
        self,
        runner,
        recorders: Recorders,
        max_outputs: int = 64,
        greedy: dict[str, list[int]] | None = None,
        exact: bool = False,
    ) -> None:
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

    def new(self, req_id: str, prompt: list[int] | None = None, *, chunk: int | None = None) -> PlanRow:
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
        tokens = known[cached:] if chunk is None else known[cached : cached + chunk]
        return PlanRow(
            req_id,
            tokens,
            new_block_ids=req.blocks,
            is_new=True,
            num_cached_tokens=cached,
            sample=cached + len(tokens) == len(known),
            sampling=SamplingOptions(seed=7),
        )

    def prefill(self, req_id: str, num_tokens: int | None = None) -> PlanRow:
        req = self.reqs[req_id]
        known = req.seq
        end = len(known) if num_tokens is None else req.written + num_tokens
        return PlanRow(req_id, known[req.written : end], sample=end == len(known))

    def decode(self, req_id: str, k: int = K) -> PlanRow:
        req = self.reqs[req_id]
        bs = self.runner.config.block_size
        need = -(-(req.written + 1 + k) // bs) - len(req.blocks)
        new = self._blocks(need * bs) if need > 0 else []
        req.blocks += new
        return PlanRow(req_id, num_draft_slots=k, new_block_ids=new)

    def finish(self, req_id: str, keep_blocks: int = 0) -> str:
        """Free the request's blocks except `keep_blocks` leading full ones (kept for a resume
        with a prefix-cache hit); the caller puts the returned id in `finished`."""
        req = self.reqs[req_id]
        assert keep_blocks * self.runner.config.block_size <= req.written
        self.free.extend(req.blocks[keep_blocks:])
        req.blocks = req.blocks[:keep_blocks]
        return req_id

    def step(self, *entries: PlanRow, finished: tuple[str, ...] = ()) -> worker_pb2.StepResult:
        """Execute one plan, check what the model saw and apply the result to the bookkeeping."""
        self.step_id += 1
        plan = make_plan(self.step_id, entries, finished)
        num_calls = len(self.rec.target.calls)
        result = self.runner.execute(plan).materialize(0.0, self.runner.num_proposed)
        self.runner.propose_next()  # as the worker's step loop does once the result is handed on
        self.results.append(result)
        assert len(self.rec.target.calls) == num_calls + 1, "one target forward per plan"
        call = self.rec.target.calls[-1]
        by_id = result_rows(result)
        # The runner skips the draft chain after a plan whose decode rows have no draft slot.
        decode_slots = [entry.num_draft_slots for entry in entries if not entry.token_ids]
        chain_ran = not decode_slots or any(decode_slots)
        for i, entry in enumerate(entries):
            req = self.reqs[entry.req_id]
            ids, positions = call.row(i)
            assert positions == list(range(req.written, req.written + len(ids))), (
                f"{entry.req_id}: positions {positions[:3]}.. but the worker holds {req.written}"
            )
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
                fillers = 0 if self.runner.builder.trim_empty_drafts else k - len(used)
                expected = [last] + used + [last] * fillers
                assert ids == expected, (
                    f"{entry.req_id}: decode inputs {ids}, expected last token + its own drafts "
                    f"{expected} (stale or foreign drafts reached the model)"
                )
                # Acceptance accounting: only drafts actually fed are verified.
                assert res.num_draft_tokens == len(used), (entry.req_id, res.num_draft_tokens, used)
                assert 0 <= res.num_accepted <= res.num_draft_tokens
                assert list(res.token_ids[:-1]) == used[: res.num_accepted]
                req.written += 1 + res.num_accepted
            if entry.sample:
                assert len(res.token_ids) >= 1
                req.outputs.extend(res.token_ids)
                req.sampled = True
                slot = self.runner.slots[entry.req_id].slot
                num = int(self.runner.state.num_drafts[slot])
                req.drafts = self.runner.state.drafts[slot, :num].tolist()
                if chain_ran:
                    self._check_proposal(entry.req_id, req)
                else:
                    assert not req.drafts, f"{entry.req_id}: drafts {req.drafts} after a plan without draft slots"
            else:
                req.drafts = []
        assert sum(result.accepted_per_pos) == sum(r.num_accepted for r in by_id.values())
        return result

    def _check_proposal(self, req_id: str, req: HandRequest) -> None:
        proposer = self.runner.proposer
        if proposer.method == "eagle":
            return  # an EAGLE head's drafts: tests/inprocess/test_eagle_proposer.py's offline chain
        if getattr(proposer, "draft", None) is None:
            expected = ngram_reference(req.seq, proposer.ngram_min, proposer.ngram_max, K)
            assert req.drafts == expected, f"{req_id}: n-gram drafts {req.drafts}, not {expected}"
        elif req_id in self.greedy:
            # Draft j comes from the draft model's logits at position written + j, so it needs
            # that slot allocated: fewer drafts only when the blocks end sooner.
            room = len(req.blocks) * self.runner.config.block_size - req.written
            done = len(req.outputs)
            expected = self.greedy[req_id][done : done + K]
            assert len(req.drafts) == max(0, min(K, room)), (req_id, req.drafts, room)
            assert req.drafts[: len(expected)] == expected[: len(req.drafts)], (
                f"{req_id}: self-drafts {req.drafts}, greedy continuation {expected}"
            )
            self._check_draft_cache(req_id, req)

    def _check_draft_cache(self, req_id: str, req: HandRequest) -> None:
        """SmolLM2 drafting for itself: wherever the draft model's cache claims valid K/V
        (the draft observes every target step, so every position the target wrote) and the
        target's holds confirmed tokens, the two must agree, layer by
        layer. Stale K/V of another request, or a token written at the wrong position, differ."""
        proposer = self.runner.proposer
        bs = self.runner.config.block_size
        valid = req.written
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


def drive(
    runner,
    scheduler: Scheduler,
    rec: Recorders,
    *,
    window: int,
    after_result: Callable[[Scheduler, Trace, deque], list[RequestEvent]] | None = None,
    max_plans: int = 5000,
) -> Trace:
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
            for entry in plan_rows(plan):
                req = scheduler.get_request(entry.req_id)
                # Never a slot that could not be verified before max_tokens.
                assert req.num_pending_outputs <= req.max_tokens, (entry.req_id, req.max_tokens)
                assert req.num_placeholders >= 0
            num_calls = len(rec.target.calls)
            pending = runner.execute(plan)
            runner.propose_next()  # as the worker's step loop does once the result is handed on
            assert len(rec.target.calls) == num_calls + 1
            inflight.append((plan, rec.target.calls[-1], pending))
            trace.max_inflight_seen = max(trace.max_inflight_seen, len(inflight))
        assert inflight, "scheduler stalled with unfinished requests and nothing in flight"
        plan, call, pending = inflight.popleft()
        result = pending.materialize(0.0, runner.num_proposed)
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
        by_id = result_rows(result)
        for i, entry in enumerate(plan_rows(plan)):
            seq = prompts[entry.req_id] + trace.outputs[entry.req_id].token_ids
            ids, positions = call.row(i)
            start = positions[0]
            assert positions == list(range(start, start + len(ids)))
            if entry.token_ids:
                assert ids == list(entry.token_ids) == seq[start : start + len(ids)], entry.req_id
                continue
            if start >= len(seq):
                continue  # a step in flight past a stop: its result was dropped
            assert ids[0] == seq[start], (entry.req_id, start, ids, seq[start])
            returned = list(by_id[entry.req_id].token_ids)
            tail = seq[start + 1 : start + 1 + len(returned)]
            assert returned[: len(tail)] == tail, (entry.req_id, start, returned, tail)
            if ngram:
                own = set(seq[: start + 1])
                assert all(t in own for t in ids[1:]), (entry.req_id, ids)


def assert_matches(
    outputs: dict[str, Outcome], reference: dict[str, list[int]], min_identical: int | None = None
) -> None:
    differ = [r for r in reference if outputs[r].token_ids != reference[r]]
    allowed = 0 if min_identical is None else len(reference) - min_identical
    assert len(differ) <= allowed, "\n".join(f"{r}: ours {outputs[r].token_ids} vs HF {reference[r]}" for r in differ)
