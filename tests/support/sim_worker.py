"""Test utility: a pure-Python worker that executes StepPlans with the real worker's semantics.

`SimWorker` keeps its own true sequence per request and ignores the scheduler's optimistic
counts, exactly like `worker_svc/runner.py` must (DESIGN.md, "Worker-side correction"):

- a decode feeds `[last_token, drafts...]` from its own state, filling missing drafts with the
  last token, and advances by 1 + accepted;
- a toy "model" (`toy_next_token`, a deterministic function of seed and sequence) verifies
  drafts greedily, so output is identical with and without speculation;
- a toy drafter (`toy_propose`) is right most of the time, sometimes wrong, and sometimes
  proposes fewer than k drafts.

It models the KV cache content: each slot stores (position, hash of the prefix up to it), and
before every step it checks that the context a request attends to is exactly its own sequence.
So a shared prefix block with the wrong content, a block reused while someone else still
writes it, or a wrong block table breaks the check. It also asserts the contract's input rules
(no -1/placeholder ids, no writes outside the request's blocks or into shared blocks, no slots
past the limits it was told about) and logs every KV block write and every plan.

`drive` runs a scheduler against it with results returned `window - 1` plans late.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.rows import PlanRow, ResultBuilder, RowResult, plan_rows
from zerobubble.scheduler_svc.scheduler import (
    FINISH_EOS,
    FINISH_MAX_TOKENS,
    FINISH_STOP_SEQUENCE,
    RequestEvent,
    Scheduler,
    SchedulerConfig,
    max_request_len,
)
from zerobubble.scheduler_svc.tokenizer import Tokenizer

# Toy vocabulary: ids 0..255 are bytes (byte-level BPE without merges), then specials.
EOS_ID = 256
BOS_ID = 257
TOY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
_ALPHABET = [ord(c) for c in "abcde abcd. xyz,\n"]
_E_ACUTE = (0xC3, 0xA9)  # é: a 2-byte character split over two tokens
_EURO = (0xE2, 0x82, 0xAC)  # €: 3 bytes


def _byte_chars() -> dict[int, str]:
    """Byte -> printable char mapping of byte-level BPE vocabularies."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars: dict[int, str] = {}
    num_extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + num_extra)
            num_extra += 1
    return chars


def make_toy_tokenizer_json() -> str:
    """A real `tokenizers` JSON: ids 0..255 are raw bytes, then <|eos|> (256), <|bos|> (257)."""
    vocab = {ch: b for b, ch in _byte_chars().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|eos|>", special=True), AddedToken("<|bos|>", special=True)])
    return tok.to_str()


def make_toy_tokenizer() -> Tokenizer:
    """Our scheduler tokenizer over the toy byte vocabulary."""
    return Tokenizer(make_toy_tokenizer_json(), TOY_CHAT_TEMPLATE, "<|bos|>", "<|eos|>")


def _mix(*values: int) -> int:
    """Deterministic hash of ints (int and tuple hashes are not salted per process)."""
    return (hash(values) * 0x9E3779B97F4A7C15 >> 17) & 0xFFFFFFFF


def toy_next_token(seed: int, tokens: Sequence[int], eos_per_mille: int = 15) -> int:
    """The toy model: next token as a function of the seed and the whole sequence.

    Multi-byte characters are always completed, so the text is valid UTF-8 but characters are
    split across tokens (what incremental detokenization must handle).
    """
    last = tokens[-1]
    if last == _E_ACUTE[0]:
        return _E_ACUTE[1]
    if last == _EURO[0]:
        return _EURO[1]
    if last == _EURO[1] and len(tokens) >= 2 and tokens[-2] == _EURO[0]:
        return _EURO[2]
    h = _mix(seed, len(tokens), *tokens[-4:])
    r = h % 1000
    if r < eos_per_mille:
        return EOS_ID
    if r < eos_per_mille + 40:
        return _E_ACUTE[0]
    if r < eos_per_mille + 60:
        return _EURO[0]
    return _ALPHABET[(h >> 10) % len(_ALPHABET)]


def toy_propose(seed: int, tokens: Sequence[int], k: int, eos_per_mille: int) -> list[int]:
    """The toy drafter: up to k guesses, mostly right, sometimes wrong, sometimes fewer."""
    h = _mix(seed, len(tokens), 99991)
    num_drafts = k if h % 5 else h % (k + 1)
    seq = list(tokens)
    drafts: list[int] = []
    for i in range(num_drafts):
        guess = toy_next_token(seed, seq, eos_per_mille)
        if _mix(seed, len(seq), i, 7) % 4 == 0:
            guess = _ALPHABET[(guess + 1) % len(_ALPHABET)]  # a wrong guess
        drafts.append(guess)
        seq.append(guess)
    return drafts


def toy_logprob(position: int) -> float:
    """Fake log-probability that encodes the absolute position of the token it belongs to."""
    return -float(position + 1)


def _chain(prev: int, token: int) -> int:
    return hash((prev, token))


@dataclass(slots=True)
class _SimRequest:
    seed: int
    logprobs: bool
    tokens: list[int]  # the true sequence, including the last sampled token
    prefix_hashes: list[int]  # prefix_hashes[p] identifies tokens[:p+1]
    seq_len: int  # tokens whose K/V are written
    table: list[int]
    num_shared_blocks: int  # leading blocks from a prefix-cache hit: read-only
    incarnation: int  # step id of its is_new entry
    last_step_id: int = 0  # the latest step that included it
    num_steps: int = 0
    resumed: bool = False
    drafts: list[int] = field(default_factory=list)
    drafts_for_len: int = -1  # len(tokens) when `drafts` were proposed
    sampled: bool = False  # tokens[-1] is a sample whose K/V is not written yet


@dataclass(slots=True)
class BlockWrite:
    """One KV block written by one step for one request incarnation."""

    step_id: int
    req_id: str
    incarnation: int
    block_id: int


@dataclass(slots=True)
class SimStats:
    """What the simulated worker saw (for coverage assertions in tests)."""

    num_steps: int = 0
    num_new: int = 0
    num_resumed: int = 0
    num_skipped: int = 0  # a live request absent from a plan
    num_decode_rows: int = 0
    num_decode_rows_after_new: int = 0  # the previous step of the request was its is_new one
    num_decode_rows_after_resume: int = 0
    num_decode_rows_after_skip: int = 0  # the request sat out the previous plan
    num_filled_draft_slots: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0


class SimWorker:
    """Executes StepPlans like the worker: own device state, strictly in order."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        vocab_size: int = 258,
        eos_per_mille: int = 15,
        check_kv: bool = True,
        window: int = 0,
    ) -> None:
        """`check_kv` verifies each request's whole context before every step (O(len)).
        `window`: a sliding-window model's (0: full attention); a query at ``p`` reads keys
        ``p - window + 1 .. p`` only, so blocks wholly before its request's next window are
        dead: another request may take them, and they are neither checked nor guarded."""
        self.window = window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_per_mille = eos_per_mille
        self.check_kv = check_kv
        self.stats = SimStats()
        self.writes: list[BlockWrite] = []
        self.plans: list[worker_pb2.StepPlan] = []
        # (prompt length, max_tokens) per request id: limits the worker asserts.
        self.limits: dict[str, tuple[int, int]] = {}
        # Steps to fail: nothing of them is executed and the result carries an error. Their
        # requests are broken from then on (later entries are ignored until they are dropped).
        self.fail_step_ids: set[int] = set()
        # (step id, request id) rows to fail alone, as the real worker does for a bad row: the
        # row is left out with a per-request error and the request is broken from then on.
        self.fail_rows: set[tuple[int, str]] = set()
        self._broken: set[str] = set()
        self._kv: list[list[tuple[int, int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self._reqs: dict[str, _SimRequest] = {}
        self._seen: set[str] = set()
        self._last_step_id = 0
        self._previous_step_id = 0

    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        """Run one plan and return its result."""
        assert plan.step_id > self._last_step_id, "plans must run in order"
        self._previous_step_id = self._last_step_id
        self._last_step_id = plan.step_id
        self.plans.append(plan)
        self.stats.num_steps += 1
        for req_id in plan.finished_req_ids:
            self._reqs.pop(req_id, None)
            self._broken.discard(req_id)
        rows = plan_rows(plan)
        scheduled = {e.req_id for e in rows}
        assert len(scheduled) == len(rows), "a request twice in one plan"
        if plan.step_id in self.fail_step_ids:
            self._broken |= scheduled
            return worker_pb2.StepResult(step_id=plan.step_id, error="injected failure")
        self.stats.num_skipped += sum(1 for r in self._reqs if r not in scheduled)
        result = worker_pb2.StepResult(step_id=plan.step_id)
        built = ResultBuilder()
        accepted_per_pos: list[int] = []
        for entry in rows:
            if entry.is_new:
                self._broken.discard(entry.req_id)
            if (plan.step_id, entry.req_id) in self.fail_rows:
                self._broken.add(entry.req_id)
                self._reqs.pop(entry.req_id, None)
                built.add_error(entry.req_id, "injected row failure")
                continue
            if entry.req_id in self._broken:
                built.add_error(entry.req_id, "an earlier step failed for it")
                continue
            req = self._prepare(plan.step_id, entry)
            if entry.token_ids:
                res = self._prefill(plan.step_id, entry, req)
            else:
                res = self._decode(plan.step_id, entry, req, accepted_per_pos)
            built.add(
                entry.req_id, res.token_ids, res.num_draft_tokens, logprobs=res.logprobs if req.logprobs else None
            )
            req.last_step_id = plan.step_id
            req.num_steps += 1
            result.num_tokens += len(entry.token_ids) or 1 + entry.num_draft_slots
        built.write(result)
        result.accepted_per_pos.extend(accepted_per_pos)
        return result

    # ------------------------------------------------------------------------- internals

    def _prepare(self, step_id: int, entry: PlanRow) -> _SimRequest:
        bs = self.block_size
        if entry.is_new:
            assert entry.req_id not in self._reqs, f"{entry.req_id}: is_new for a live request"
            assert entry.sampling is not None, "is_new without sampling params"
            assert entry.num_cached_tokens % bs == 0
            assert entry.token_ids, "a new request must start with a prefill chunk"
            num_shared = entry.num_cached_tokens // bs
            table = list(entry.new_block_ids)
            assert len(table) >= num_shared
            self.stats.num_new += 1
            resumed = entry.req_id in self._seen
            self.stats.num_resumed += resumed
            self._seen.add(entry.req_id)
            self.stats.num_cached_tokens += entry.num_cached_tokens
            req = _SimRequest(
                seed=entry.sampling.seed or 0,
                logprobs=entry.sampling.logprobs,
                tokens=[],
                prefix_hashes=[],
                seq_len=entry.num_cached_tokens,
                table=table,
                num_shared_blocks=num_shared,
                incarnation=step_id,
                resumed=resumed,
            )
            self._read_cached_prefix(req)
            fresh = table[num_shared:]
            self._reqs[entry.req_id] = req
        else:
            assert entry.req_id in self._reqs, f"{entry.req_id}: not new but unknown to the worker"
            assert entry.sampling is None and entry.num_cached_tokens == 0
            req = self._reqs[entry.req_id]
            req.table.extend(entry.new_block_ids)
            fresh = list(entry.new_block_ids)
        live = self.live_blocks(req)
        assert len(set(live)) == len(live), "a block twice in one table"
        assert all(0 <= b < self.num_blocks for b in req.table)
        for block_id in fresh:
            for other_id, other in self._reqs.items():
                if other_id != entry.req_id:
                    assert block_id not in self.live_blocks(other), (
                        f"step {step_id}: block {block_id} handed to {entry.req_id} while {other_id} still holds it"
                    )
        if self.check_kv:
            self._check_context(entry.req_id, req)
        return req

    def written_length(self, req_id: str) -> int | None:
        """Positions whose K/V the worker has written for a live request (its true length
        before the next plan runs); None when it holds no such request."""
        req = self._reqs.get(req_id)
        return req.seq_len if req is not None else None

    def first_visible(self, req: _SimRequest) -> int:
        """The first position the request's next query (at its true length) may attend."""
        return max(0, req.seq_len - self.window + 1) if self.window else 0

    def live_blocks(self, req: _SimRequest) -> list[int]:
        """The blocks of ``req``'s table that a query of its next step may still read."""
        return req.table[self.first_visible(req) // self.block_size :]

    def _read_cached_prefix(self, req: _SimRequest) -> None:
        """Rebuild the cached prefix from the KV content (the worker gets no token values)."""
        prev = 0
        for p in range(req.seq_len):
            slot = self._kv[req.table[p // self.block_size]][p % self.block_size]
            assert slot is not None, f"prefix hit on a never-written slot (position {p})"
            position, prefix_hash, token = slot
            assert position == p
            expected = _chain(prev, token)
            assert prefix_hash == expected, f"prefix hit on unconfirmed content at position {p}"
            req.tokens.append(token)
            req.prefix_hashes.append(prefix_hash)
            prev = prefix_hash

    def _check_context(self, req_id: str, req: _SimRequest) -> None:
        for p in range(self.first_visible(req), req.seq_len):
            slot = self._kv[req.table[p // self.block_size]][p % self.block_size]
            assert slot == (p, req.prefix_hashes[p], req.tokens[p]), (
                f"{req_id}: KV at position {p} is not its own (got {slot})"
            )

    def _write(self, step_id: int, req_id: str, req: _SimRequest, fed: Sequence[int]) -> None:
        """Write K/V of `fed` tokens at positions seq_len.. (hashes of the hypothetical prefix)."""
        bs = self.block_size
        prev = req.prefix_hashes[req.seq_len - 1] if req.seq_len else 0
        for i, token in enumerate(fed):
            p = req.seq_len + i
            assert 0 <= token < self.vocab_size, f"{req_id}: invalid input id {token}"
            assert p < self.max_model_len, f"{req_id}: position {p} past max_model_len"
            index = p // bs
            assert index < len(req.table), f"{req_id}: slot {p} outside its blocks"
            assert index >= req.num_shared_blocks, f"{req_id}: write into a shared block"
            block_id = req.table[index]
            for other_id, other in self._reqs.items():
                if other_id != req_id:
                    assert block_id not in self.live_blocks(other), (
                        f"step {step_id}: {req_id} writes block {block_id} held by {other_id}"
                    )
            prev = _chain(prev, token)
            self._kv[block_id][p % bs] = (p, prev, token)
            if not self.writes or self.writes[-1].block_id != block_id or (self.writes[-1].step_id != step_id):
                self.writes.append(BlockWrite(step_id, req_id, req.incarnation, block_id))

    def _append_true(self, req: _SimRequest, token: int) -> None:
        prev = req.prefix_hashes[-1] if req.prefix_hashes else 0
        req.tokens.append(token)
        req.prefix_hashes.append(_chain(prev, token))

    def _check_limits(self, req_id: str, req: _SimRequest, num_new_outputs: int) -> None:
        if req_id not in self.limits:
            return
        prompt_len, max_tokens = self.limits[req_id]
        num_outputs = len(req.tokens) - prompt_len
        assert num_outputs + num_new_outputs <= max_tokens, (
            f"{req_id}: slots scheduled past max_tokens ({num_outputs} + {num_new_outputs} > {max_tokens})"
        )
        assert len(req.tokens) + num_new_outputs <= self.max_model_len

    def _sample(self, req: _SimRequest) -> tuple[int, list[float]]:
        token = toy_next_token(req.seed, req.tokens, self.eos_per_mille)
        self._append_true(req, token)
        req.sampled = True
        logprobs = [toy_logprob(len(req.tokens) - 1)] if req.logprobs else []
        return token, logprobs

    def _propose(self, req: _SimRequest, k: int) -> None:
        req.drafts = toy_propose(req.seed, req.tokens, k, self.eos_per_mille) if k else []
        req.drafts_for_len = len(req.tokens)

    def _prefill(self, step_id: int, entry: PlanRow, req: _SimRequest) -> RowResult:
        assert not req.sampled, f"{entry.req_id}: prefill chunk after sampling started"
        assert req.seq_len == len(req.tokens)
        assert entry.num_draft_slots == 0
        self._write(step_id, entry.req_id, req, entry.token_ids)
        for token in entry.token_ids:
            self._append_true(req, token)
        req.seq_len += len(entry.token_ids)
        res = RowResult([])
        if entry.sample:
            self._check_limits(entry.req_id, req, 1)
            token, logprobs = self._sample(req)
            res.token_ids.append(token)
            res.logprobs.extend(logprobs)
            self._propose(req, 8)
        return res

    def _verify(self, req: _SimRequest, proposed: list[int]) -> tuple[list[int], list[int]]:
        """The drafts the toy model accepts (a prefix of ``proposed``) and the sequence after them."""
        accepted: list[int] = []
        seq = list(req.tokens)
        for draft in proposed:
            if draft != toy_next_token(req.seed, seq, self.eos_per_mille):
                break
            accepted.append(draft)
            seq.append(draft)
        return accepted, seq

    def _decode(
        self,
        step_id: int,
        entry: PlanRow,
        req: _SimRequest,
        accepted_per_pos: list[int],
    ) -> RowResult:
        assert req.sampled, f"{entry.req_id}: decode without a sampled token (placeholder input)"
        assert req.seq_len == len(req.tokens) - 1
        assert entry.sample, "a decode always samples"
        k = entry.num_draft_slots
        assert k >= 0
        self._check_limits(entry.req_id, req, 1 + k)
        self.stats.num_decode_rows += 1
        if req.num_steps == 1:
            self.stats.num_decode_rows_after_new += 1
            self.stats.num_decode_rows_after_resume += req.resumed
        if req.last_step_id != self._previous_step_id:
            self.stats.num_decode_rows_after_skip += 1
        # Drafts are valid only for the sequence they were proposed after; anything else is
        # stale (the real worker tracks this with num_drafts, reset on new/resume).
        assert req.drafts_for_len in (-1, len(req.tokens)), f"{entry.req_id}: stale drafts"
        proposed = req.drafts[:k] if req.drafts_for_len == len(req.tokens) else []
        num_filled = k - len(proposed)
        self.stats.num_filled_draft_slots += num_filled
        last = req.tokens[-1]
        fed = [last, *proposed, *([last] * num_filled)]
        assert all(t >= 0 for t in fed), "placeholder id fed to the model"
        # The slot of `last` is written at its true position, not the scheduler's count.
        base_len = len(req.tokens)
        self._write(step_id, entry.req_id, req, fed)
        accepted, seq = self._verify(req, proposed)
        for pos in range(len(accepted)):
            if pos >= len(accepted_per_pos):
                accepted_per_pos.append(0)
            accepted_per_pos[pos] += 1
        bonus = toy_next_token(req.seed, seq, self.eos_per_mille)
        out = [*accepted, bonus]
        for token in out:
            self._append_true(req, token)
        req.seq_len += 1 + len(accepted)
        res = RowResult(out, len(proposed))
        if req.logprobs:
            res.logprobs.extend(toy_logprob(base_len + i) for i in range(len(out)))
        if proposed:
            self.stats.num_drafts += 1
        self.stats.num_draft_tokens += len(proposed)
        self.stats.num_accepted_tokens += len(accepted)
        self._propose(req, 8)
        return res


# ------------------------------------------------------------------------------ driving


@dataclass(slots=True)
class Collected:
    """Everything streamed for one request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: int | None = None
    num_events: int = 0
    last_event: RequestEvent | None = None


Hook = Callable[[Scheduler, list[RequestEvent]], None]


def collect(out: dict[str, Collected], events: list[RequestEvent]) -> None:
    """Accumulate events, asserting nothing arrives after a request's final event."""
    for ev in events:
        got = out.setdefault(ev.req_id, Collected())
        assert got.finish_reason is None, f"{ev.req_id}: event after finish"
        got.token_ids.extend(ev.token_ids)
        got.text += ev.text
        got.logprobs.extend(ev.logprobs)
        got.finish_reason = ev.finish_reason
        got.num_events += 1
        got.last_event = ev
        assert ev.num_output_tokens >= len(got.token_ids) or ev.finish_reason is not None


def drive(
    scheduler: Scheduler,
    worker: SimWorker,
    window: int,
    *,
    after_result: Hook | None = None,
    after_plan: Callable[[Scheduler, worker_pb2.StepPlan], None] | None = None,
    max_plans: int = 20000,
    notices: bool = False,
) -> dict[str, Collected]:
    """Run until every request finished and every result is back.

    Up to `window` plans are in flight: a plan's result is handed to the scheduler only when
    the window is full or nothing more can be planned (1 = synchronous). `notices`: when
    nothing is to run, send what `Scheduler.notice_plan` offers, as the worker link does.
    """
    out: dict[str, Collected] = {}
    inflight: deque[worker_pb2.StepResult] = deque()
    num_plans = 0
    while True:
        plan = scheduler.schedule() if len(inflight) < window else None
        if plan is None and notices and len(inflight) < window:
            plan = scheduler.notice_plan()
        if plan is not None:
            num_plans += 1
            assert num_plans <= max_plans, "too many plans: livelock?"
            if after_plan is not None:
                after_plan(scheduler, plan)
            inflight.append(worker.execute(plan))
            continue
        if not inflight:
            assert not scheduler.has_unfinished(), "scheduler stalled with unfinished requests and nothing in flight"
            break
        events = scheduler.on_step_result(inflight.popleft())
        collect(out, events)
        if after_result is not None:
            after_result(scheduler, events)
    return out


@dataclass(slots=True)
class Expected:
    """What running the toy model directly gives for one request."""

    token_ids: list[int]
    text: str
    finish_reason: int


def reference_generate(
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    seed: int,
    stopping: StoppingOptions,
    *,
    max_model_len: int,
    eos_token_ids: Sequence[int] = (EOS_ID,),
    eos_per_mille: int = 15,
) -> Expected:
    """Generate with the toy model one token at a time and apply stop rules naively."""
    tokens = list(prompt)
    out: list[int] = []
    max_tokens = max_model_len - len(prompt)
    if stopping.max_tokens is not None:
        max_tokens = min(max_tokens, stopping.max_tokens)
    while True:
        token = toy_next_token(seed, tokens, eos_per_mille)
        tokens.append(token)
        out.append(token)
        may_stop = len(out) >= stopping.min_tokens
        if may_stop and not stopping.ignore_eos and token in eos_token_ids:
            return Expected(out, tokenizer.decode(out[:-1]), FINISH_EOS)
        if may_stop and token in stopping.stop_token_ids:
            return Expected(out, tokenizer.decode(out[:-1]), FINISH_STOP_SEQUENCE)
        text = tokenizer.decode(out)
        hits = [i for i in (text.find(s) for s in stopping.stop) if i >= 0]
        if hits:
            return Expected(out, text[: min(hits)], FINISH_STOP_SEQUENCE)
        if len(out) >= max_tokens:
            return Expected(out, text, FINISH_MAX_TOKENS)


def add_requests(
    scheduler: Scheduler,
    worker: SimWorker,
    prompts: dict[str, list[int]],
    stopping: dict[str, StoppingOptions] | StoppingOptions,
    *,
    logprobs: bool = False,
    detokenize: bool = True,
) -> dict[str, int]:
    """Queue prompts with seeds 1000+i; tells the worker their limits. Returns the seeds."""
    seeds: dict[str, int] = {}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        stop = stopping[req_id] if isinstance(stopping, dict) else stopping
        seeds[req_id] = 1000 + i
        req = scheduler.add_request(
            req_id, prompt, SamplingOptions(seed=1000 + i, logprobs=logprobs), stop, detokenize=detokenize
        )
        worker.limits[req_id] = (len(prompt), req.max_tokens)
    return seeds


@dataclass(slots=True)
class Case:
    """One scheduler + simulated worker + queued requests."""

    scheduler: Scheduler
    worker: SimWorker
    prompts: dict[str, list[int]]
    seeds: dict[str, int]
    stopping: dict[str, StoppingOptions]
    max_len: int
    eos_per_mille: int


def make_case(
    *,
    num_requests: int = 10,
    prompt_len: tuple[int, int] = (3, 30),
    stopping: StoppingOptions | dict[str, StoppingOptions] | None = None,
    num_blocks: int = 200,
    block_size: int = 4,
    max_model_len: int = 128,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    num_spec_tokens: int = 3,
    spec_disable_batch_size: int = 0,
    max_prefill_tokens_with_decodes: int = 0,
    enable_prefix_caching: bool = True,
    eos_per_mille: int = 15,
    logprobs: bool = False,
    prompts: dict[str, list[int]] | None = None,
    tokenizer: Tokenizer | None = None,
    prompt_seed: int = 5,
    detokenize: bool = True,
    sliding_window: int = 0,
) -> Case:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_spec_tokens=num_spec_tokens,
        spec_disable_batch_size=spec_disable_batch_size,
        max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
        enable_prefix_caching=enable_prefix_caching,
        eos_token_ids=(EOS_ID,),
        sliding_window=sliding_window,
    )
    scheduler = Scheduler(config, tokenizer or make_toy_tokenizer(), rng=random.Random(0))
    worker = SimWorker(num_blocks, block_size, max_model_len, eos_per_mille=eos_per_mille, window=sliding_window)
    if prompts is None:
        rng = random.Random(prompt_seed)
        prompts = {
            f"r{i}": [rng.choice(b"abc xyz") for _ in range(rng.randint(*prompt_len))] for i in range(num_requests)
        }
    stopping = stopping or StoppingOptions(max_tokens=40)
    per_req = stopping if isinstance(stopping, dict) else {r: stopping for r in prompts}
    seeds = add_requests(scheduler, worker, prompts, per_req, logprobs=logprobs, detokenize=detokenize)
    max_len = max_request_len(config)
    return Case(scheduler, worker, prompts, seeds, per_req, max_len, eos_per_mille)


def assert_matches_reference(case: Case, got: dict[str, Collected]) -> None:
    for req_id, prompt in case.prompts.items():
        expected = reference_generate(
            make_toy_tokenizer(),
            prompt,
            case.seeds[req_id],
            case.stopping[req_id],
            max_model_len=case.max_len,
            eos_per_mille=case.eos_per_mille,
        )
        out = got[req_id]
        assert out.token_ids == expected.token_ids, req_id
        assert out.text == expected.text, req_id
        assert out.finish_reason == expected.finish_reason, req_id
