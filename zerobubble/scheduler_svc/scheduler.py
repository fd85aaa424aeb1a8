"""Admission, plan building with optimistic placeholders, reconciliation and preemption.

The scheduler plans step N+1 before step N's result is back. It assumes every draft slot it
schedules will be accepted (`num_computed`/`num_placeholders` on the request run ahead), and
corrects itself when results arrive (`on_step_result`). The worker never needs token values
from the scheduler for decode steps: it feeds its own last sample and drafts.

Rules that keep this safe (DESIGN.md, "The async + speculative contract"):

- KV blocks are allocated for the optimistic count, so the worker never runs out of slots even
  when every draft is accepted.
- A decode is only scheduled with as many draft slots as can still be verified before
  `max_tokens` / the model length, counting tokens still in flight.
- Results planned before a request's latest (re)admission are stale and discarded; results for
  finished or aborted requests are discarded too. Each is counted.
- Blocks freed after plan N-1 was sent may go to anyone in plan N or later: plans execute in
  order, so nothing in flight can write them after their new owner starts.
- Only full blocks of confirmed tokens whose K/V are certainly written enter the prefix cache.
- With a sliding-window model, the blocks no query of a running request's next step can attend
  are freed before it is planned (`scheduler_svc/window.py`), so its footprint follows the
  window, not its length.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from zerobubble.api import generate_pb2, worker_pb2
from zerobubble.config import SchedulerConfig
from zerobubble.request_options import (
    SamplingOptions,
    StoppingOptions,
    reads_whole_context,
    to_worker_sampling,
    validate_options,
)
from zerobubble.rows import NewRow, PlanBuilder, RowResult, add_continuations, result_rows
from zerobubble.scheduler_svc.block_pool import BlockPool, PrefixCacheCounters, extend_hash_chain
from zerobubble.scheduler_svc.detokenizer import Detokenizer
from zerobubble.scheduler_svc.draft_length import ADAPTIVE, DraftLengthChooser, plan_drafts
from zerobubble.scheduler_svc.request import PredictionProgress, Request, RequestStatus
from zerobubble.scheduler_svc.suffix import SharedOutputs, SuffixDrafter, SuffixPlan
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.scheduler_svc.window import num_blocks_behind

logger = logging.getLogger(__name__)

FINISH_EOS = generate_pb2.FINISH_REASON_EOS
FINISH_MAX_TOKENS = generate_pb2.FINISH_REASON_MAX_TOKENS
FINISH_STOP_SEQUENCE = generate_pb2.FINISH_REASON_STOP_SEQUENCE
FINISH_CANCELLED = generate_pb2.FINISH_REASON_CANCELLED
FINISH_ERROR = generate_pb2.FINISH_REASON_ERROR


class QueueFullError(Exception):
    """The waiting queue holds `max_waiting` requests (the servicer answers RESOURCE_EXHAUSTED)."""


@dataclass(slots=True)
class RequestEvent:
    """What one request produced since its previous event; the last one has a finish reason."""

    req_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: int | None  # generate_pb2.FinishReason; None while running
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    error: str = ""
    queue_s: float | None = None  # on the finishing event: arrival to first scheduling
    # One (token ids, logprobs) per token id, most likely first, when top_logprobs > 0.
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # With a predicted output: its drafts accepted and rejected so far.
    prediction: tuple[int, int] | None = None


@dataclass(slots=True)
class SpeculationStats:
    """Cumulative speculative-decoding figures: drafts the worker verified (its proposer's or
    suffix decoding's, not a request's predicted output) and the plan's draft slots.

    Kept apart from `SchedulerStats`' step and token counters so each concern reads as one
    group; all stay zero (the histograms empty) while nothing speculates.
    """

    num_drafts: int = 0  # decode rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Suffix decoding: continuations sent, by length (index = tokens; 0 = one cleared).
    suffix_continuations: list[int] = field(default_factory=list)
    # Decode rows by draft slots planned (index = slots), while the worker speculates.
    draft_lengths: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PredictionStats:
    """Cumulative drafts taken from requests' predicted outputs (apart from the proposer's in
    `SpeculationStats`): verified, and of those accepted."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative figures for metrics (the servicer/metrics module reads and diffs them): step
    and token counters here, drafting's in `spec` and `prediction`."""

    num_steps_planned: int = 0
    num_steps_completed: int = 0
    num_failed_steps: int = 0
    num_prompt_tokens: int = 0  # of requests admitted for the first time
    num_generation_tokens: int = 0  # output tokens delivered to requests
    num_preemptions: int = 0
    num_rolled_back_tokens: int = 0  # draft slots undone by reconciliation
    num_stale_results: int = 0  # result entries discarded (finished, aborted or preempted)
    spec: SpeculationStats = field(default_factory=SpeculationStats)
    prediction: PredictionStats = field(default_factory=PredictionStats)


@dataclass(slots=True)
class _Scheduled:
    """What a plan asked of one request, remembered until the step's result arrives."""

    request: Request
    admission_id: int
    num_draft_slots: int
    sample: bool
    is_prefill: bool
    num_computed_after: int  # known tokens covered once a prefill chunk is done


@dataclass(slots=True)
class _NextPlan:
    """A plan while it is built: its rows, and suffix decoding's new continuations
    (`Continuations`: request, anchor, tokens)."""

    rows: PlanBuilder = field(default_factory=PlanBuilder)
    continuations: list[tuple[str, int, list[int]]] = field(default_factory=list)


@dataclass(slots=True)
class _Drafting:
    """The scheduler's speculative-drafting state, held as one so the scheduler's own fields
    stay its queues and accounting: the adaptive draft-length chooser (None with fixed
    lengths), the draft slots it chose per request for the plan being built, and suffix
    decoding's drafter (None unless `spec_method` is suffix)."""

    lengths: DraftLengthChooser | None = None
    chosen: dict[str, int] = field(default_factory=dict)  # this plan's adaptive draft slots by request
    suffix: SuffixDrafter | None = None


@dataclass(frozen=True, slots=True)
class _Limits:
    """What requests on this worker may ask for."""

    eos_token_ids: frozenset[int]
    vocab_size: int
    max_len: int  # tokens a request may hold: prompt and output
    # The same for a request that keeps all its blocks (no sliding window, or it reads its
    # whole context): a request longer than the whole cache could never be resumed.
    max_len_whole: int


@dataclass(slots=True)
class _Ids:
    """The next step id and admission id to hand out (both start at 1: 0 means none)."""

    next_step_id: int = 1
    next_admission_id: int = 1

    def take_step_id(self) -> int:
        self.next_step_id += 1
        return self.next_step_id - 1

    def take_admission_id(self) -> int:
        self.next_admission_id += 1
        return self.next_admission_id - 1


def _extend_counts(counts: list[int], size: int) -> None:
    """Zero counts appended to ``counts`` until it holds ``size``."""
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))


def _count_length(counts: list[int], length: int) -> None:
    """One more of ``length`` in a histogram kept as counts by value."""
    _extend_counts(counts, length + 1)
    counts[length] += 1


def fail_unplaced(req: Request, error: str, clock: Callable[[], float] = time.monotonic) -> RequestEvent:
    """End a request that no scheduler holds (taken with `take_unfinished`, not adoptable)
    with ERROR; returns its final event, so its client stream ends instead of waiting."""
    req.status = RequestStatus.FINISHED
    req.finish_reason = FINISH_ERROR
    req.error = error
    req.finish_time = clock()
    queue_s = None
    if req.first_scheduled_time is not None:
        queue_s = req.first_scheduled_time - req.arrival_time
    return RequestEvent(
        req_id=req.req_id,
        token_ids=[],
        text="",
        logprobs=[],
        finish_reason=FINISH_ERROR,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_prompt_tokens,
        error=error,
        queue_s=queue_s,
    )


@dataclass(slots=True)
class _Confirmed:
    """The tokens one result confirmed for a request, up to and including a stop."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]]
    text: str
    finish_reason: int | None


def _confirm_tokens(req: Request, res: RowResult) -> _Confirmed:
    """Append a result's tokens to `req`'s output in order, applying the stop rules to each;
    tokens after a stop are dropped."""
    token_ids = res.token_ids
    logprobs = res.logprobs if req.sampling.logprobs else []
    if len(logprobs) != len(token_ids):
        logprobs = []
    tops = res.top_logprobs if req.sampling.top_logprobs else []
    if len(tops) != len(token_ids):
        tops = []
    new_ids: list[int] = []
    new_logprobs: list[float] = []
    new_tops: list[tuple[list[int], list[float]]] = []
    text_parts: list[str] = []
    finish_reason: int | None = None
    # This loop runs for every token of every running request, so what it reads is looked up
    # once per row.
    stopping = req.stopping
    eos_ids = () if stopping.ignore_eos else req.eos_token_ids
    stop_ids = stopping.stop_token_ids
    outputs = req.output_token_ids
    detokenizer = req.detokenizer
    for i, token_id in enumerate(token_ids):
        outputs.append(token_id)
        new_ids.append(token_id)
        if logprobs:
            req.output_logprobs.append(logprobs[i])
            new_logprobs.append(logprobs[i])
        if tops:
            new_tops.append(tops[i])
        num_outputs = len(outputs)
        if num_outputs >= stopping.min_tokens:
            if token_id in eos_ids:
                finish_reason = FINISH_EOS
                break
            if token_id in stop_ids:
                finish_reason = FINISH_STOP_SEQUENCE
                break
        if detokenizer is not None:
            text, stopped = detokenizer.append(token_id)
            text_parts.append(text)
            if stopped:
                finish_reason = FINISH_STOP_SEQUENCE
                break
        if num_outputs >= req.max_tokens:
            finish_reason = FINISH_MAX_TOKENS
            break
    if detokenizer is not None and finish_reason is not None and finish_reason != FINISH_STOP_SEQUENCE:
        text_parts.append(detokenizer.flush())
    return _Confirmed(new_ids, new_logprobs, new_tops, "".join(text_parts), finish_reason)


def max_request_len(config: SchedulerConfig) -> int:
    """Tokens a request may hold, prompt and output.

    With all its blocks held, a request longer than the whole cache could never be resumed
    after preemption. Behind a sliding window a request holds its window's blocks only: a
    cache with room for the window, the block being written and one more serves any length.
    """
    window_blocks = -(-config.sliding_window // config.block_size)
    if config.sliding_window > 0 and config.num_blocks >= window_blocks + 2:
        return config.max_model_len
    return min(config.max_model_len, config.num_blocks * config.block_size)


class Scheduler:
    """Owns requests, KV block accounting and plan building for one worker."""

    def __init__(
        self,
        config: SchedulerConfig,
        tokenizer: Tokenizer,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        suffix_outputs: SharedOutputs | None = None,
    ) -> None:
        """`rng` draws seeds for requests without one (pass a seeded one in tests);
        `suffix_outputs`: the outputs index suffix decoding shares with other schedulers
        (None: one of its own)."""
        config.validate()
        self.config = config
        self.stats = SchedulerStats()
        self._tokenizer = tokenizer
        self._clock = clock
        self._rng = rng or random.Random()
        self._pool = BlockPool(config.num_blocks, config.block_size)
        self._limits = _Limits(
            eos_token_ids=frozenset(config.eos_token_ids),
            vocab_size=config.vocab_size or tokenizer.vocab_size,
            max_len=max_request_len(config),
            max_len_whole=min(config.max_model_len, config.num_blocks * config.block_size),
        )
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order: the last one is preempted first
        self._inflight: dict[int, dict[str, _Scheduled]] = {}
        self._pending_finished: list[str] = []
        # Sequences 2..n of an n > 1 request, by the id of the first: they are queued once its
        # prompt blocks are in the prefix cache, so they share them instead of recomputing.
        self._deferred: dict[str, list[Request]] = {}
        self._ids = _Ids()
        self._drafting = _Drafting()
        if config.spec_method == "suffix" and config.num_prediction_tokens > 0:
            self._drafting.suffix = SuffixDrafter(
                config.num_prediction_tokens, suffix_outputs, sent_lengths=self.stats.spec.suffix_continuations
            )
        if config.spec_draft_length == ADAPTIVE and config.num_spec_tokens > 0:
            self._drafting.lengths = DraftLengthChooser()

    # ----------------------------------------------------------------- requests in and out

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingOptions | None = None,
        stopping: StoppingOptions | None = None,
        *,
        share_prompt_with: str | None = None,
        detokenize: bool = True,
    ) -> Request:
        """Queue a request; it keeps ``sampling`` and ``stopping`` (defaults: greedy, up to the
        model length). `InvalidRequest` (a `ValueError` naming the field) on bad fields,
        `QueueFullError` when the queue is full.

        An unset seed is drawn here. `share_prompt_with`: the id of an active request with the
        same prompt (the first sequence of an n > 1 request); this one waits until that one's
        prompt is computed and then takes its KV blocks from the prefix cache. `detokenize`
        False: no text and no stop strings here (its front detokenizes; they are still validated).
        """
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in use")
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self._waiting)} requests already waiting")
        req = self._new_request(req_id, list(prompt_token_ids), sampling or SamplingOptions(), stopping, detokenize)
        self._requests[req_id] = req
        leader = self._requests.get(share_prompt_with) if share_prompt_with else None
        if leader is not None and self._can_share_prompt(leader, req):
            req.waits_for = leader.req_id
            self._deferred.setdefault(leader.req_id, []).append(req)
        else:
            self._waiting.append(req)
        return req

    def _new_request(
        self,
        req_id: str,
        prompt: list[int],
        sampling: SamplingOptions,
        stopping: StoppingOptions | None,
        detokenize: bool,
    ) -> Request:
        """A validated, keyed `Request`, not queued yet."""
        stopping = stopping or StoppingOptions()
        max_len = self._max_len_of(sampling)
        validate_options(prompt, sampling, stopping, vocab_size=self._limits.vocab_size, max_len=max_len)
        if sampling.seed is None:
            # Every request is keyed, so its randomness never depends on batching.
            sampling.seed = self._rng.getrandbits(64)
        room = max_len - len(prompt)
        limit = self.config.num_prediction_tokens
        return Request(
            req_id=req_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            stopping=stopping,
            max_tokens=room if stopping.max_tokens is None else min(stopping.max_tokens, room),
            eos_token_ids=self._limits.eos_token_ids,
            detokenizer=Detokenizer(self._tokenizer, prompt, stopping.stop) if detokenize else None,
            arrival_time=self._clock(),
            prediction=PredictionProgress(limit, limit) if limit and sampling.prediction_token_ids else None,
        )

    def _max_len_of(self, sampling: SamplingOptions) -> int:
        """Tokens a request with ``sampling`` may hold, prompt and output."""
        return self._limits.max_len_whole if reads_whole_context(sampling) else self._limits.max_len

    def _can_share_prompt(self, leader: Request, req: Request) -> bool:
        """Whether ``req`` may wait for ``leader``'s prompt blocks instead of computing its own."""
        return (
            self.config.enable_prefix_caching
            and leader.status is not RequestStatus.FINISHED
            and not leader.output_token_ids
            and leader.prompt_token_ids == req.prompt_token_ids
        )

    def _release_siblings(self, leader: Request) -> None:
        """Queue the requests deferred behind `leader` (its prompt is computed, or it is gone)."""
        siblings = self._deferred.pop(leader.req_id, None)
        for req in reversed(siblings or ()):
            req.waits_for = None
            # They arrived with the leader, so they go ahead of anything queued after it.
            self._waiting.appendleft(req)

    def abort_request(self, req_id: str) -> RequestEvent | None:
        """Cancel a request (client gone); returns its final event, or None if not active."""
        req = self._requests.get(req_id)
        if req is None:
            return None
        self._finish(req, FINISH_CANCELLED)
        return self._event(req, [], "", [])

    def take_unfinished(self) -> list[Request]:
        """Remove every waiting and running request, e.g. to move them to another worker.

        For when this scheduler's worker is lost: in-flight steps are forgotten, blocks freed,
        and each request keeps only its confirmed outputs (running ones first, in admission
        order, then the waiting queue). Hand them to another scheduler with `adopt`.
        """
        self._inflight.clear()
        self._pending_finished.clear()
        deferred = [req for reqs in self._deferred.values() for req in reqs]
        self._deferred.clear()
        for req in deferred:
            req.waits_for = None
        moved = list(self._running) + list(self._waiting) + deferred
        for req in self._running:
            self._reset_admission(req)
        self._running.clear()
        self._waiting.clear()
        for req in moved:
            del self._requests[req.req_id]
        return moved

    def take_waiting(self) -> list[Request]:
        """Remove the requests that wait for admission (they hold no blocks), to move them to
        another scheduler with `adopt` (their worker is shutting down)."""
        moved = list(self._waiting)
        self._waiting.clear()
        for req in moved:
            del self._requests[req.req_id]
        return moved

    def adopt(self, req: Request) -> None:
        """Queue a request taken from another scheduler of the same model (`take_unfinished`).

        It goes to the back of the waiting queue and resumes from prompt + confirmed outputs;
        its seed is kept, so its output is unchanged. `ValueError` if the id is in use or it
        does not fit this worker's model length.
        """
        if req.req_id in self._requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        if req.status is not RequestStatus.WAITING or req.block_ids:
            raise ValueError(f"request {req.req_id!r} is still held by another scheduler")
        room = self._max_len_of(req.sampling) - req.num_prompt_tokens
        if req.num_output_tokens >= room:
            raise ValueError(f"request {req.req_id!r} does not fit this worker's model length")
        if req.stopping.max_tokens is None:
            req.max_tokens = room
        else:
            req.max_tokens = min(req.stopping.max_tokens, room)
        self._requests[req.req_id] = req
        self._waiting.append(req)

    # ------------------------------------------------------------------------- accessors

    def get_request(self, req_id: str) -> Request | None:
        """The state of an active (waiting or running) request."""
        return self._requests.get(req_id)

    def running_requests(self) -> list[Request]:
        """Running requests in admission order (a copy of the list; the requests are live)."""
        return list(self._running)

    def num_running(self) -> int:
        """Requests admitted and not finished."""
        return len(self._running)

    def num_waiting(self) -> int:
        """Requests queued (new or preempted, or deferred behind a sibling)."""
        return len(self._waiting) + sum(len(reqs) for reqs in self._deferred.values())

    def num_unfinished(self) -> int:
        """Waiting plus running requests (a worker's load, for routing)."""
        return len(self._running) + self.num_waiting()

    def num_inflight_steps(self) -> int:
        """Plans returned by `schedule` whose results have not arrived."""
        return len(self._inflight)

    @property
    def block_pool(self) -> BlockPool:
        """The KV block pool (read it, do not change it)."""
        return self._pool

    @property
    def prefix_cache_counters(self) -> PrefixCacheCounters:
        """Prefix-cache queries and hits, in prompt tokens."""
        return self._pool.counters

    def kv_usage(self) -> float:
        """Used KV blocks ÷ all blocks (`zerobubble_kv_cache_usage_ratio`)."""
        return self._pool.usage_ratio()

    def cached_prefix_blocks(self, token_ids: Sequence[int]) -> int:
        """How many leading full blocks of `token_ids` this worker's prefix cache holds.

        For routing a request to the replica that can reuse the most; changes nothing.
        """
        if not self.config.enable_prefix_caching:
            return 0
        return self._pool.num_cached_prefix_blocks(token_ids)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._running or self._waiting or self._deferred)

    # -------------------------------------------------------------------------- planning

    def schedule(self) -> worker_pb2.StepPlan | None:
        """Build the next plan without waiting for earlier ones; None when nothing can run.

        Running requests go first (prefill chunks and decodes), then waiting requests are
        admitted first come, first served while the token budget, `max_num_seqs` and free
        blocks allow. Requests finished, aborted or preempted since the last plan are listed
        in `finished_req_ids` of the next plan that is returned.
        """
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget(budget)
        next_plan = _NextPlan()
        records: dict[str, _Scheduled] = {}
        num_preemptions_before = self.stats.num_preemptions
        max_drafts = self._draft_limit()
        self._drafting.chosen = self._choose_drafts(max_drafts, budget)
        if self._drafting.suffix is not None:
            self._drafting.suffix.new_plan()
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            prefilling = req.is_prefilling
            limit = min(budget, prefill_budget) if prefilling else budget
            if limit > 0:
                num_tokens = self._schedule_running(req, limit, max_drafts, next_plan, records)
                budget -= num_tokens
                prefill_budget -= num_tokens if prefilling else 0
            i += 1
        # Admitting right after a preemption would only hand the freed blocks back and forth.
        if self.stats.num_preemptions == num_preemptions_before:
            while self._waiting and min(budget, prefill_budget) > 0 and len(self._running) < self.config.max_num_seqs:
                num_tokens = self._admit(self._waiting[0], min(budget, prefill_budget), next_plan.rows, records)
                if num_tokens == 0:
                    break
                budget, prefill_budget = budget - num_tokens, prefill_budget - num_tokens
        if not next_plan.rows:
            return None
        plan = worker_pb2.StepPlan()
        next_plan.rows.write(plan)
        if next_plan.continuations:
            req_ids, anchors, token_ids = zip(*next_plan.continuations)
            add_continuations(plan, req_ids, anchors, token_ids)
        return self._issue(plan, records)

    def _prefill_budget(self, budget: int) -> int:
        """Prompt tokens the next step may carry: all of ``budget``, or the cap while any request
        decodes (a step's decodes wait for its whole prefill chunk)."""
        cap = self.config.max_prefill_tokens_with_decodes
        if cap and any(not req.is_prefilling for req in self._running):
            return min(cap, budget)
        return budget

    def _issue(self, plan: worker_pb2.StepPlan, records: dict[str, _Scheduled]) -> worker_pb2.StepPlan:
        """Number a built plan, attach the pending finish notices and track it as in flight."""
        plan.step_id = self._ids.take_step_id()
        plan.finished_req_ids.extend(self._pending_finished)
        self._pending_finished.clear()
        self._inflight[plan.step_id] = records
        self.stats.num_steps_planned += 1
        return plan

    def notice_plan(self) -> worker_pb2.StepPlan | None:
        """A plan that runs nothing and only carries finish notices, or None when none helps.

        Call it when `schedule` has nothing to run. Finish notices normally ride on the next
        plan; with nothing else to run there is none. Two cases need them sooner:

        - a step planned ahead whose every row has finished since (the step after an EOS or a
          stop string at concurrency 1) would run to its end, holding the cores or the device
          while the finished request's client gets its last message and sends the next request;
          this plan lets the worker cut that step short at once (its `note_finished`);
        - with no step in flight the worker would keep the finished requests' slots (their
          draft and grammar state) until the next request, and a worker holding requests that
          waits for a plan counts the wait as a bubble: an idle server would look like a stalled one.
        """
        if not self._pending_finished:
            return None
        if self._inflight and not any(
            records and all(self._is_stale(rec) for rec in records.values()) for records in self._inflight.values()
        ):
            return None
        return self._issue(worker_pb2.StepPlan(), {})

    @staticmethod
    def _is_stale(rec: _Scheduled) -> bool:
        """Whether a row's result will be discarded (its request finished, left or was re-admitted)."""
        req = rec.request
        return req.status is not RequestStatus.RUNNING or req.admission_id != rec.admission_id

    def _draft_limit(self) -> int:
        """Draft slots a decode of the next plan may carry: `num_spec_tokens`, or 0 while at
        least `spec_disable_batch_size` requests run (where verifying drafts in a large batch
        costs a compute-bound device more than the accepted tokens save).

        The count is of running requests as the plan starts, prefilling ones included (their
        chunks share the step's compute): it is known before any row is planned and stays the
        same for every row of a plan, whereas the decodes a plan ends up with depend on the
        budget and on preemptions made while it is built. Drafts come back as requests finish.
        """
        limit = self.config.spec_disable_batch_size
        if limit and len(self._running) >= limit:
            return 0
        return self.config.num_spec_tokens

    def _choose_drafts(self, max_drafts: int, budget: int) -> dict[str, int]:
        """`--spec-draft-length adaptive`: each decode row's draft slots in the next plan, at
        most ``max_drafts``; empty with fixed lengths."""
        if self._drafting.lengths is None:
            return {}
        return plan_drafts(self._drafting.lengths, self._running, max_drafts, budget, self.config.uniform_draft_length)

    def _schedule_running(
        self,
        req: Request,
        budget: int,
        max_drafts: int,
        next_plan: _NextPlan,
        records: dict[str, _Scheduled],
    ) -> int:
        """Add a running request's next prefill chunk or decode (with at most ``max_drafts``
        draft slots) to ``next_plan``; returns the tokens used."""
        self._free_behind_window(req)
        if req.is_prefilling:
            return self._schedule_chunk(req, budget, next_plan.rows, records)
        max_drafts, suffix = self._decode_drafts(req, max_drafts)
        # Tokens confirmed or in flight; slots beyond the limit could never be verified.
        num_draft_slots = min(
            max_drafts,
            req.max_tokens - req.num_pending_outputs - 1,
            budget - 1,
        )
        if num_draft_slots < 0:
            return 0  # the in-flight results will finish it
        num_tokens = 1 + num_draft_slots
        config = self.config
        if len(req.block_ids) * config.block_size - req.num_computed >= num_tokens + config.num_lookahead_slots:
            # Most decodes: the blocks held already cover this step's slots and the lookahead,
            # so nothing is allocated and nobody is preempted (`_make_room` and `_grow` would
            # find the same, at a visible share of the step at hundreds of rows).
            new_block_ids: list[int] = []
        else:
            if not self._make_room(req):
                return 0
            num_draft_slots = min(num_draft_slots, self._capacity(req) - 1)
            num_tokens = 1 + num_draft_slots
            new_block_ids = self._grow(req, num_tokens)
        req.num_computed += num_tokens
        req.num_placeholders += num_tokens
        req.num_inflight_drafts += num_draft_slots
        if config.num_spec_tokens > 0:
            _count_length(self.stats.spec.draft_lengths, num_draft_slots)
        next_plan.rows.add_decode(req.req_id, num_draft_slots, new_block_ids)
        if suffix is not None and suffix.send is not None:
            assert self._drafting.suffix is not None
            self._drafting.suffix.commit(req, suffix)
            next_plan.continuations.append((req.req_id, suffix.anchor, suffix.send))
        records[req.req_id] = _Scheduled(
            request=req,
            admission_id=req.admission_id,
            num_draft_slots=num_draft_slots,
            sample=True,
            is_prefill=False,
            num_computed_after=req.num_computed,
        )
        return num_tokens

    def _schedule_chunk(self, req: Request, budget: int, rows: PlanBuilder, records: dict[str, _Scheduled]) -> int:
        """Add a running request's next prefill chunk (at most ``budget`` tokens); returns the
        tokens used (0: it was preempted)."""
        if not self._make_room(req):
            return 0
        num_tokens = min(req.num_prefill_tokens - req.num_computed, budget, self._capacity(req))
        start = req.num_computed
        token_ids = req.token_ids_between(start, start + num_tokens)
        self._add_prefill(req, token_ids, rows, records, is_new=False, num_cached_tokens=0)
        return num_tokens

    def _decode_drafts(self, req: Request, max_drafts: int) -> tuple[int, SuffixPlan | None]:
        """The most draft slots ``req``'s next decode may carry, and its suffix continuation."""
        if req.prediction is not None:
            # Its own budget, even where drafting is off for the batch: drafts the output keeps
            # accepting pay for their slots at any batch size.
            return max(max_drafts, req.prediction.max_drafts), None
        drafting = self._drafting
        max_drafts = drafting.chosen.get(req.req_id, max_drafts)
        if drafting.suffix is None or max_drafts <= 0:
            return max_drafts, None
        # A continuation is sized by its own match statistics: an adaptive length says whether
        # the row drafts at all and how far prompt lookup goes without one.
        suffix = drafting.suffix.plan(req, max_drafts)
        return suffix.num_draft_slots, suffix

    def _admit(
        self,
        req: Request,
        budget: int,
        rows: PlanBuilder,
        records: dict[str, _Scheduled],
    ) -> int:
        """Admit the head of the waiting queue with its first chunk; returns tokens used (0: no)."""
        token_ids = req.all_token_ids()
        block_size = self.config.block_size
        cached_block_ids: list[int] = []
        if self.config.enable_prefix_caching:
            # The block holding the last known token is always computed: the step must produce
            # at least one token, and nobody may write into a block others share.
            cached_block_ids = self._pool.lookup(token_ids, max_num_blocks=(len(token_ids) - 1) // block_size)
        num_cached_tokens = len(cached_block_ids) * block_size
        num_tokens = min(len(token_ids) - num_cached_tokens, budget, self._pool.num_free * block_size)
        if num_tokens < 1:
            self._pool.free(cached_block_ids)
            return 0
        self._waiting.popleft()
        if self.config.enable_prefix_caching:
            self._pool.record_query(len(token_ids), num_cached_tokens)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self._clock()
            req.num_cached_prompt_tokens = min(num_cached_tokens, req.num_prompt_tokens)
            self.stats.num_prompt_tokens += req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        req.admission_id = self._ids.take_admission_id()
        req.block_ids = cached_block_ids
        req.num_registered_blocks = len(cached_block_ids)
        req.num_computed = num_cached_tokens
        req.num_placeholders = 0
        req.num_prefill_tokens = len(token_ids)
        if self._drafting.suffix is not None:
            self._drafting.suffix.admitted(req)
        self._running.append(req)
        # A prefix hit longer than the window: its leading blocks are needed for their ids only.
        self._free_behind_window(req)
        chunk = token_ids[num_cached_tokens : num_cached_tokens + num_tokens]
        self._add_prefill(req, chunk, rows, records, is_new=True, num_cached_tokens=num_cached_tokens)
        return num_tokens

    def _add_prefill(
        self,
        req: Request,
        token_ids: list[int],
        rows: PlanBuilder,
        records: dict[str, _Scheduled],
        *,
        is_new: bool,
        num_cached_tokens: int,
    ) -> None:
        """Schedule a prefill chunk; it samples when it reaches the end of the known tokens."""
        new_block_ids = self._grow(req, len(token_ids))
        req.num_computed += len(token_ids)
        sample = req.num_computed == req.num_prefill_tokens
        if sample:
            req.num_placeholders += 1
        new = NewRow(num_cached_tokens, to_worker_sampling(req.sampling, req.num_prompt_tokens)) if is_new else None
        rows.add(
            req.req_id, token_ids, new_block_ids=req.block_ids if is_new else new_block_ids, sample=sample, new=new
        )
        records[req.req_id] = _Scheduled(
            request=req,
            admission_id=req.admission_id,
            num_draft_slots=0,
            sample=sample,
            is_prefill=True,
            num_computed_after=req.num_computed,
        )

    def _capacity(self, req: Request) -> int:
        """Token slots the request could still get: its spare slots plus every free block."""
        num_slots = (len(req.block_ids) + self._pool.num_free) * self.config.block_size
        return num_slots - req.num_computed

    def _free_behind_window(self, req: Request) -> None:
        """Give back the leading blocks no query of ``req``'s next step can attend (a
        sliding-window model; `scheduler_svc/window.py` says why this position is certain)."""
        window = self.config.sliding_window
        if window <= 0 or reads_whole_context(req.sampling):
            return
        first_query_pos = req.num_computed - req.num_inflight_drafts
        num_behind = min(num_blocks_behind(first_query_pos, window, self.config.block_size), len(req.block_ids))
        if self.config.enable_prefix_caching:
            # Only blocks already offered to the prefix cache: one freed before its step's
            # result could not be offered later (someone else may have it by then), and a
            # long prompt's leading blocks would never be cached.
            num_behind = min(num_behind, req.num_registered_blocks)
        if num_behind > req.num_freed_blocks:
            self._pool.free(req.block_ids[req.num_freed_blocks : num_behind])
            req.num_freed_blocks = num_behind

    def _make_room(self, req: Request) -> bool:
        """Preempt the newest running requests until `req` can get one more slot.

        Returns False when `req` itself had to be preempted.
        """
        while self._capacity(req) < 1:
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, num_tokens: int) -> list[int]:
        """Allocate the blocks that `num_tokens` more slots need; returns the new block ids."""
        bs = self.config.block_size
        num_needed = -(-(req.num_computed + num_tokens) // bs)
        num_new = num_needed - len(req.block_ids)
        # Best effort: also cover the lookahead slots, where a draft model writes its chain after
        # this step (the worker never writes outside the blocks it holds either way).
        lookahead = -(-(req.num_computed + num_tokens + self.config.num_lookahead_slots) // bs)
        num_extra = max(0, lookahead - max(num_needed, len(req.block_ids)))
        if num_extra and self._pool.num_free >= max(num_new, 0) + num_extra:
            num_new = max(num_new, 0) + num_extra
        if num_new <= 0:
            return []
        new_block_ids = self._pool.allocate(num_new)
        if new_block_ids is None:
            raise AssertionError("capacity was checked before growing")
        req.block_ids.extend(new_block_ids)
        return new_block_ids

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV blocks, keep the confirmed outputs.

        In-flight results for it become stale (its admission id changes); on resumption its
        prefill is prompt + confirmed outputs.
        """
        logger.debug("preempting %s (%d outputs)", req.req_id, req.num_output_tokens)
        self._reset_admission(req)
        req.num_preemptions += 1
        self._running.remove(req)
        self._waiting.appendleft(req)
        self._pending_finished.append(req.req_id)
        self.stats.num_preemptions += 1

    def _reset_admission(self, req: Request) -> None:
        """Undo an admission: free its blocks and forget what is in flight for it."""
        self._pool.free(req.block_ids[req.num_freed_blocks :])
        req.block_ids = []
        req.num_freed_blocks = 0
        req.num_inflight_drafts = 0
        req.num_registered_blocks = 0
        req.num_computed = 0
        req.num_placeholders = 0
        req.num_prefill_tokens = 0
        req.admission_id = 0
        req.status = RequestStatus.WAITING

    # --------------------------------------------------------------------- reconciliation

    def on_step_result(self, result: worker_pb2.StepResult) -> list[RequestEvent]:
        """Apply a worker's result for an earlier plan; returns one event per request with news."""
        records = self._inflight.pop(result.step_id, None)
        if records is None:
            logger.warning("result for unknown step %d ignored", result.step_id)
            return []
        self.stats.num_steps_completed += 1
        lengths = self._drafting.lengths
        if lengths is not None and not result.error:
            lengths.observe_step(result.num_tokens, result.forward_s)
        if result.error:
            self.stats.num_failed_steps += 1
            logger.error("step %d failed on the worker: %s", result.step_id, result.error)
        by_id = result_rows(result)
        events: list[RequestEvent] = []
        for req_id, rec in records.items():
            req = rec.request
            if self._is_stale(rec):
                self.stats.num_stale_results += 1
                continue
            res = by_id.get(req_id)
            error = result.error or (res.error if res is not None else "")
            if error:
                # A per-request error ends that request only; the step's other rows are valid.
                self._finish(req, FINISH_ERROR, f"worker step failed: {error}")
                events.append(self._event(req, [], "", []))
                continue
            if not rec.sample:
                self._register_confirmed(req, rec.num_computed_after)
                continue
            num_returned = len(res.token_ids) if res is not None else 0
            if not 1 <= num_returned <= rec.num_draft_slots + 1:
                error = f"worker returned {num_returned} tokens for {rec.num_draft_slots} drafts"
                logger.error("request %s: %s", req_id, error)
                self._finish(req, FINISH_ERROR, error)
                events.append(self._event(req, [], "", []))
                continue
            assert res is not None  # num_returned >= 1 above
            # Counted here, after the stale filter: figures for preempted, aborted or already
            # finished requests would describe drafts nobody used.
            if req.prediction is not None:
                self._count_prediction(req, rec, res)
            if not res.prediction_drafts:
                self._count_speculation(res)
                if lengths is not None and req.prediction is None:
                    lengths.observe_row(req.draft_counts, rec.num_draft_slots, num_returned - 1, res.num_draft_tokens)
            try:
                events.append(self._reconcile(req, rec, res))
            except Exception as exc:
                # One request's bad result (a counter check, the detokenizer) ends that request
                # only; the step's other rows and the worker link go on.
                logger.exception("request %s: applying step %d failed", req_id, result.step_id)
                if req.status is not RequestStatus.FINISHED:
                    self._finish(req, FINISH_ERROR, f"applying a step result failed: {exc}")
                events.append(self._event(req, [], "", []))
        return events

    def fail_step(self, step_id: int, error: str) -> list[RequestEvent]:
        """Finish the requests of a failed step with ERROR (same as an error `StepResult`)."""
        return self.on_step_result(worker_pb2.StepResult(step_id=step_id, error=error))

    def _count_speculation(self, res: RowResult) -> None:
        """Account the drafts one applied result verified.

        Accepted drafts are a prefix of the proposed ones, so a row with `a` accepted adds one
        to each of the positions 0..a-1 (what the worker's step-level `accepted_per_pos` sums
        over all rows, stale ones included).
        """
        if res.num_draft_tokens <= 0:
            return
        stats = self.stats.spec
        num_accepted = min(max(res.num_accepted, 0), res.num_draft_tokens)
        stats.num_drafts += 1
        stats.num_draft_tokens += res.num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.accepted_per_pos
        _extend_counts(per_pos, num_accepted)
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def _count_prediction(self, req: Request, rec: _Scheduled, res: RowResult) -> None:
        """Account one applied result of a request with a predicted output."""
        assert req.prediction is not None
        if not res.prediction_drafts or res.num_draft_tokens <= 0:
            if rec.num_draft_slots > 0:
                req.prediction.unaligned()
            return
        num_accepted = min(max(res.num_accepted, 0), res.num_draft_tokens)
        req.prediction.record(res.num_draft_tokens, num_accepted)
        stats = self.stats.prediction
        stats.num_draft_tokens += res.num_draft_tokens
        stats.num_accepted_tokens += num_accepted

    def _reconcile(self, req: Request, rec: _Scheduled, res: RowResult) -> RequestEvent:
        """Replace placeholders with real tokens, roll back rejected slots, check stops."""
        token_ids = res.token_ids
        num_rejected = rec.num_draft_slots + 1 - len(token_ids)
        req.num_inflight_drafts -= rec.num_draft_slots
        req.num_computed -= num_rejected
        req.num_placeholders -= num_rejected + len(token_ids)
        if req.num_placeholders < 0:
            raise AssertionError(f"{req.req_id}: placeholders underflow ({req.num_placeholders})")
        self.stats.num_rolled_back_tokens += num_rejected
        if req.first_token_time is None:
            req.first_token_time = self._clock()
        confirmed = _confirm_tokens(req, res)
        self.stats.num_generation_tokens += len(confirmed.token_ids)
        # The newest token's K/V is written by the next step; everything before it is done.
        self._register_confirmed(req, req.num_tokens - 1)
        if self._deferred:  # only the first sequence of an n > 1 request has siblings waiting
            self._release_siblings(req)
        if confirmed.finish_reason is not None:
            self._finish(req, confirmed.finish_reason)
        event = self._event(req, confirmed.token_ids, confirmed.text, confirmed.logprobs)
        event.top_logprobs = confirmed.top_logprobs
        return event

    def _register_confirmed(self, req: Request, num_written: int) -> None:
        """Offer the full blocks among the first `num_written` (confirmed, K/V written) tokens."""
        if not self.config.enable_prefix_caching:
            return
        block_size = self.config.block_size
        num_full = min(num_written // block_size, len(req.block_ids))
        if num_full <= req.num_registered_blocks:
            return
        first = len(req.block_hashes) * block_size
        extend_hash_chain(
            req.block_hashes, req.token_ids_between(first, num_full * block_size), block_size, num_full, first
        )
        for i in range(req.num_registered_blocks, num_full):
            self._pool.register(req.block_ids[i], req.block_hashes[i])
        req.num_registered_blocks = num_full

    def _finish(self, req: Request, finish_reason: int, error: str = "") -> None:
        """Release everything a request holds; the worker forgets it before the next plan."""
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
            self._pending_finished.append(req.req_id)
        elif req.status is RequestStatus.WAITING:
            if req.waits_for is not None:
                self._deferred[req.waits_for].remove(req)
                if not self._deferred[req.waits_for]:
                    del self._deferred[req.waits_for]
                req.waits_for = None
            else:
                self._waiting.remove(req)
        self._release_siblings(req)
        self._pool.free(req.block_ids[req.num_freed_blocks :])
        if self._drafting.suffix is not None:
            self._drafting.suffix.finish(req)
        req.block_ids = []
        req.num_freed_blocks = 0
        req.admission_id = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = finish_reason
        req.error = error
        req.finish_time = self._clock()
        del self._requests[req.req_id]

    def _event(self, req: Request, token_ids: list[int], text: str, logprobs: list[float]) -> RequestEvent:
        finished = req.status is RequestStatus.FINISHED
        queue_s = None
        if finished and req.first_scheduled_time is not None:
            queue_s = req.first_scheduled_time - req.arrival_time
        return RequestEvent(
            req_id=req.req_id,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_prompt_tokens,
            error=req.error,
            queue_s=queue_s,
            prediction=(req.prediction.num_accepted, req.prediction.num_rejected) if req.prediction else None,
        )
