"""The model runner: KV cache, persistent per-request device state, one step per plan.

The runner is what the worker service calls. It executes `StepPlan`s strictly in order and keeps
everything a decode needs on the device between steps: the last sampled token, the drafts
proposed after it, and the true sequence length. The scheduler's optimistic counts never reach
the model: positions and slot mappings are derived here from the worker's own state, so a step
planned before the previous step's result was known still runs on the right positions.

The runner makes no scheduling decisions; it validates what it is told and executes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from kernels.inputs import assemble_inputs
from kernels.seq_lens import update_state
from kernels.verify import count_accepted, rejection_sample
from worker_svc import staging
from worker_svc.cuda_graphs import DecodeGraphs, batch_buckets, draft_widths, num_scratch_blocks
from worker_svc.model import StepInterrupted, allocate_kv_cache
from worker_svc.model_loader import LoadedModel
from worker_svc.proposers import Proposer
from worker_svc.sampler import (
    LogitBias,
    Penalties,
    SamplingTensors,
    SlotSampling,
    context_token_counts,
    has_penalty,
    sample,
    target_probs,
    token_logprobs,
    top_logprobs,
)
from zerobubble.api import worker_pb2
from zerobubble.config import WorkerConfig, default_of
from zerobubble.rows import DecodeColumnLists, PlanRow, add_row_columns, column_rows, decode_columns, message_rows

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunnerConfig:
    """Capacity and speculation settings of one runner."""

    num_blocks: int
    block_size: int = default_of(WorkerConfig, "block_size")
    max_num_seqs: int = default_of(WorkerConfig, "max_num_seqs")
    max_model_len: int = 2048
    num_spec_tokens: int = 0  # K: the most draft slots any decode may carry
    # Replay decode-only steps through CUDA graphs (worker_svc/cuda_graphs.py); emulated with
    # the same padded buffers off CUDA (tests).
    cuda_graphs: bool = False


@dataclass(slots=True)
class DeviceState:
    """Per-slot tensors that persist between steps (see docs/INTERNALS.md)."""

    seq_len: torch.Tensor  # [S] int32: tokens whose K/V are written
    last_token: torch.Tensor  # [S] int32: last sampled token
    drafts: torch.Tensor  # [S, K] int32
    num_drafts: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    history: torch.Tensor  # [num_blocks, block_size] int32: token pages following the KV blocks


@dataclass(slots=True)
class SlotInfo:
    """Host-side bookkeeping of one request's state slot (no device reads needed)."""

    slot: int
    block_ids: list[int]
    sampling: worker_pb2.SamplingParams
    has_sample: bool = False  # a token has been sampled: decode steps are allowed


@dataclass(slots=True)
class DecodeRows:
    """The decode rows a plan carries in columns that a step runs, with their slots; row i
    gains the next ``num_new_blocks[i]`` of ``new_block_ids``.

    They are checked and prepared as columns: at GPU batch sizes nearly every row of a step is
    one of them, and a Python object and a dozen checks per row were a third of the worker's
    step logic at 256 rows under cProfile (columns: 6 % less step logic, `bench_sim.py logic`).
    """

    req_ids: list[str] = field(default_factory=list)
    infos: list[SlotInfo] = field(default_factory=list)
    num_draft_slots: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)

    def add(self, row: PlanRow, info: SlotInfo) -> None:
        self.req_ids.append(row.req_id)
        self.infos.append(info)
        self.num_draft_slots.append(row.num_draft_slots)
        self.num_new_blocks.append(len(row.new_block_ids))
        self.new_block_ids.extend(row.new_block_ids)


@dataclass(slots=True)
class SampledRows:
    """The rows of a step that sample (or verify) tokens, and where their logits come from.

    Logits are computed only for real slots: every fed slot of a decode row, the last token of a
    sampling prefill chunk. A trimmed decode row has fewer than K+1 slots, so per-slot values are
    spread back to ``[num_rows, K+1]`` by ``pad`` (which repeats a row's last slot).
    """

    rows: list[int]  # indices into the step's rows
    rows_t: torch.Tensor  # [S] int64, the same on the device
    slots: torch.Tensor  # [S] int32 state slots
    gather: torch.Tensor  # [G] int64 flat token index of every real slot
    pad: torch.Tensor | None  # [S*(K+1)] int64 index into the G slots; None: G == S*(K+1)
    num_cols: torch.Tensor  # [S] int32 real slots per row
    row_start: torch.Tensor  # [S] int64 flat index of each row's first slot
    positions: torch.Tensor  # [G] int64 absolute position of each sampled token
    sampling: SamplingTensors  # one row per real slot
    logprob_index: torch.Tensor | None  # [G] int64: ``[S, K+1]`` tokens -> real slots (padded, logprobs wanted)
    want_logprobs: bool
    num_top: list[int] = field(default_factory=list)  # top-N logprobs per row; empty: none wants any

    def spread(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """Per-slot values ``[G, ...]`` -> ``[S, width, ...]``."""
        return (t[self.pad] if self.pad is not None else t).view(len(self.rows), width, *t.shape[1:])


@dataclass(slots=True)
class StepBatch:
    """One plan as device inputs: built by `prepare`, read by `run_model` and `sample`."""

    step_id: int
    req_ids: list[str]
    rows: list[SlotInfo]
    num_tokens: int
    req_slots: torch.Tensor  # [R] int32 state slot of each row
    is_decode: torch.Tensor  # [R] bool
    num_scheduled: torch.Tensor  # [R] int32 tokens fed per row
    do_sample: torch.Tensor  # [R] bool
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    want_logprobs: list[bool]  # per row
    sampled: SampledRows | None  # None when no row samples
    row_widths: list[int] = field(default_factory=list)  # host copy of num_scheduled
    all_decode: bool = False  # every row is a decode (a CUDA graph may replay it)


@dataclass(slots=True)
class StepOutputs:
    """What sampling and verification produced for the sampled rows (still on the device)."""

    tokens: torch.Tensor  # [S, K+1] sampled tokens; the first num_accepted+1 are emitted
    num_accepted: torch.Tensor  # [S] accepted drafts
    num_verified: torch.Tensor  # [S] drafts actually verified (real drafts fed)
    logprobs: torch.Tensor | None  # [S, K+1]
    top_ids: torch.Tensor | None = None  # [S, K+1, N] when a row wants top-N logprobs
    top_logprobs: torch.Tensor | None = None  # [S, K+1, N]


class CopyDone(Protocol):
    """What `PendingResult.ready` waits on: a CUDA event, or the simulated device's clock."""

    def synchronize(self) -> None: ...


@dataclass(slots=True)
class PendingResult:
    """A step whose outputs may still be on the device; `materialize` copies them to the host."""

    step_id: int
    req_ids: list[str]
    sampled_rows: list[int]  # rows (into req_ids) that emitted tokens
    out_tokens: torch.Tensor | None  # [num_sampled, K+1]
    num_accepted: torch.Tensor | None
    num_drafts: torch.Tensor | None  # drafts actually verified per sampled row
    logprobs: torch.Tensor | None  # [num_sampled, K+1]
    want_logprobs: list[bool]
    num_tokens: int
    forward_s: float
    ready: CopyDone | None = None  # after the async device-to-host copy
    errors: dict[str, str] = field(default_factory=dict)  # rows left out: req_id -> why
    # A simulated device's own idle time before this step; it replaces the step thread's wait
    # for the plan, which says nothing about a device that runs behind the host.
    idle_s: float | None = None
    # Top-N logprobs: [num_sampled, K+1, N] ids and values, N per sampled row (0 = none).
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    num_top: list[int] = field(default_factory=list)
    # CUDA: timing events (the previous step's end while requests were live, or None; this
    # step's begin and end on the compute stream).
    device_span: tuple[Any, Any, Any] | None = None

    def materialize(self, idle_s: float, num_spec_tokens: int) -> worker_pb2.StepResult:
        """Wait for the copy (if any) and build the wire result (`idle_s`: the step thread's
        wait for this plan while requests were live)."""
        if self.ready is not None:
            self.ready.synchronize()
        forward_s = self.forward_s
        if self.idle_s is not None:
            idle_s = self.idle_s
        if self.device_span is not None:
            # The step's time on the device and the device's gap before it: the step thread
            # runs ahead of the device, so its own times (launching, waiting for the next
            # plan) say nothing about the bubble there.
            prev_end, begin, end = self.device_span
            end.synchronize()
            forward_s = begin.elapsed_time(end) / 1000
            idle_s = max(prev_end.elapsed_time(begin) / 1000, 0.0) if prev_end is not None else 0.0
        result = worker_pb2.StepResult(
            step_id=self.step_id,
            forward_s=forward_s,
            idle_s=idle_s,
            num_tokens=self.num_tokens,
        )
        accepted_per_pos = [0] * num_spec_tokens
        by_row: dict[int, int] = {row: i for i, row in enumerate(self.sampled_rows)}
        tokens = self.out_tokens.tolist() if self.out_tokens is not None else []
        accepted = self.num_accepted.tolist() if self.num_accepted is not None else []
        drafted = self.num_drafts.tolist() if self.num_drafts is not None else []
        logprobs = self.logprobs.tolist() if self.logprobs is not None else []
        top_ids = self.top_ids.tolist() if self.top_ids is not None else []
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else []
        # Rows without logprobs go into columns (most rows, most steps); the others get a
        # message each. Every runnable row appears once, a non-sampling chunk with no tokens.
        col_ids: list[str] = []
        col_num_tokens: list[int] = []
        col_tokens: list[int] = []
        col_drafts: list[int] = []
        for row, req_id in enumerate(self.req_ids):
            i = by_row.get(row)
            if i is None:
                col_ids.append(req_id)
                col_num_tokens.append(0)
                col_drafts.append(0)
                continue
            num_acc = accepted[i]
            for pos in range(num_acc):
                accepted_per_pos[pos] += 1
            if not self.want_logprobs[row] and not (top_ids and self.num_top[i] > 0):
                col_ids.append(req_id)
                col_num_tokens.append(num_acc + 1)
                col_tokens.extend(tokens[i][: num_acc + 1])
                col_drafts.append(drafted[i])
                continue
            entry = result.results.add(
                req_id=req_id, token_ids=tokens[i][: num_acc + 1], num_draft_tokens=drafted[i], num_accepted=num_acc
            )
            if self.want_logprobs[row]:
                entry.logprobs.extend(logprobs[i][: num_acc + 1])
            if top_ids and self.num_top[i] > 0:
                # Column c holds the distribution the token at column c was drawn from.
                n = self.num_top[i]
                for col in range(num_acc + 1):
                    entry.top_logprobs.add(token_ids=top_ids[i][col][:n], logprobs=top_lps[i][col][:n])
        add_row_columns(result, col_ids, col_num_tokens, col_tokens, col_drafts)
        for req_id, error in self.errors.items():
            result.results.add(req_id=req_id, error=error)
        result.accepted_per_pos.extend(accepted_per_pos)
        return result


class SimulatedStep(Protocol):
    """Stands in for `run_model` + `sample` (`worker_svc.simulated.SimulatedDevice`)."""

    def step(self, runner: ModelRunner, batch: StepBatch) -> PendingResult:
        """Tokens and verification for ``batch``, then ``runner.advance``; the result."""
        ...

    def reset(self) -> None:
        """The runner forgot every request (a new scheduler stream)."""
        ...


def worker_info(runner: ModelRunner, **fields) -> worker_pb2.WorkerInfo:
    """What a worker tells a scheduler about a runner (`Describe`): capacity, speculation, EOS
    ids and vocabulary, the fields `SchedulerConfig.with_worker` reads; ``fields`` adds the
    rest (ids, device, tokenizer). Tests and scripts that drive a runner in-process configure
    their scheduler from it too, so they plan as a scheduler facing this worker would.
    """
    cfg = runner.config
    proposer = runner.proposer
    return worker_pb2.WorkerInfo(
        max_model_len=cfg.max_model_len,
        block_size=cfg.block_size,
        num_blocks=cfg.num_blocks,
        vocab_size=runner.loaded.hf_config.vocab_size,
        eos_token_ids=runner.loaded.eos_token_ids,
        spec_method=proposer.method if proposer is not None else "none",
        num_spec_tokens=runner.num_spec_tokens,
        # A draft model writes its chain past the step: the scheduler allocates those slots too.
        num_lookahead_slots=proposer.num_lookahead_slots if proposer is not None else 0,
        max_num_seqs=cfg.max_num_seqs,
        **fields,
    )


def _to_device_list(values: staging.HostValues, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    # Pinned staging and an async copy: a pageable copy would wait for the previous step.
    return staging.to_device(values, dtype, device)


class ModelRunner:
    """Holds the model, its paged KV cache and the persistent batch state; executes plans.

    A step is three calls: `prepare` (admit rows, build inputs, positions, slot mapping,
    attention metadata and sampling tensors), `run_model` (the forward and the logits of the
    sampled slots) and `sample` (sample, verify, logprobs, advance the device state, propose
    the next drafts, start the result copy).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: RunnerConfig,
        proposer: Proposer | None = None,
        simulator: SimulatedStep | None = None,
    ) -> None:
        """``simulator``: run on a simulated device instead of the model (``loaded.model`` may
        then be None; no KV cache is allocated)."""
        self.loaded = loaded
        self.model = loaded.model
        self.config = config
        self.simulator = simulator
        self.proposer = proposer
        self.num_spec_tokens = config.num_spec_tokens if proposer is not None else 0
        # Room for the lookahead slots a step may feed past max_model_len's last block.
        self.max_blocks_per_seq = -(-(config.max_model_len + config.num_spec_tokens + 1) // config.block_size) + 1
        # Requests holding each KV block (prefix-shared blocks are held by several).
        self._block_refs: dict[int, int] = {}
        # Prefill token ids are checked against it (0: unknown, no check).
        self.vocab_size: int = getattr(getattr(loaded, "hf_config", None), "vocab_size", 0)
        widths = draft_widths(self.num_spec_tokens)
        # Padding rows of graphed steps write into blocks past the scheduler's (never handed out).
        num_scratch = num_scratch_blocks(max(widths), config.block_size) if config.cuda_graphs else 0
        if simulator is None:
            assert loaded.model is not None, "a runner without a simulator needs the model"
            self.device = loaded.model.device
            self.kv_caches = allocate_kv_cache(
                loaded.hf_config, config.num_blocks + num_scratch, config.block_size, loaded.model.dtype, self.device
            )
        else:
            self.device = torch.device("cpu")
            self.kv_caches = []
        max_blocks = self.max_blocks_per_seq
        num_slots = config.max_num_seqs
        k = max(self.num_spec_tokens, 1)
        i32, dev = torch.int32, self.device
        self.state = DeviceState(
            seq_len=torch.zeros(num_slots, dtype=i32, device=dev),
            last_token=torch.zeros(num_slots, dtype=i32, device=dev),
            drafts=torch.full((num_slots, k), -1, dtype=i32, device=dev),
            num_drafts=torch.zeros(num_slots, dtype=i32, device=dev),
            block_table=torch.zeros(num_slots, max_blocks, dtype=i32, device=dev),
            history=torch.zeros(config.num_blocks, config.block_size, dtype=i32, device=dev),
        )
        self.slots: dict[str, SlotInfo] = {}
        self.slots_by_index: dict[int, SlotInfo] = {}
        # Requests whose row failed: their state is dropped, and entries for them in plans
        # already sent get a per-request error until the scheduler re-admits (is_new) or
        # finishes them. Without this, a decode row planned before the failure was known would
        # fail as "unknown to this worker" instead of with the error that ended its request.
        self.failed: dict[str, str] = {}
        # Test-only fault injection (tests/test_fault_isolation.py, the chaos suite): called
        # with (plan, None) when a step starts, where an exception fails the whole step as a
        # crash in the model would, then with (plan, entry) for each row, where an exception
        # fails that row alone.
        self.test_fault_hook: Callable[[worker_pb2.StepPlan, PlanRow | None], None] | None = None
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.slot_sampling = SlotSampling(num_slots)
        # Request id -> step id of the latest received plan whose finish notices name it
        # (`note_finished`, called by the thread that receives plans, possibly mid-step).
        self._finished_in: dict[str, int] = {}
        self._finished_lock = threading.Lock()
        self._current: tuple[int, list[str]] | None = None  # (step id, rows) of the running step
        self.num_cut_steps = 0  # steps cut short because a later plan finished all their rows
        self.num_cut_drafts = 0  # draft chains cut short the same way (see `propose_next`)
        if self.model is not None:
            self.model.interrupt = self._moot
        if proposer is not None:
            proposer.bind(self)
        self._copy_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self._last_step_end: Any = None  # CUDA: the latest step's end event while requests were live
        self._next_drafts: tuple[torch.Tensor, StepBatch] | None = None  # see `propose_next`
        # Off the CPU the host never reads device values during a step (see worker_svc/staging.py).
        self.accelerator = staging.is_accelerator(self.device)
        # A simulated device stands for an accelerator too: the host never reads device state.
        self.trim_empty_drafts = not self.accelerator and simulator is None
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs and simulator is None:
            self.graphs = DecodeGraphs(
                self._forward_hidden,
                self.device,
                batch_buckets(config.max_num_seqs),
                widths,
                config.block_size,
                config.num_blocks,
                max_blocks,
                capture=self.device.type == "cuda",
            )
            self.graphs.capture_all()

    # -- request state -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (a new scheduler stream starts from scratch)."""
        self._last_step_end = None
        self._next_drafts = None
        for req_id in list(self.slots):
            self.release(req_id)
        if self.simulator is not None:
            self.simulator.reset()
        self.failed.clear()
        with self._finished_lock:  # a new stream numbers its steps from 1 again
            self._finished_in.clear()

    def note_finished(self, plan: worker_pb2.StepPlan) -> None:
        """Record a just-received plan's finish notices, before the plans ahead of it run.

        A finish notice in plan M means the scheduler has finished, preempted or aborted that
        request: the rows it has in earlier plans produce results it discards as stale. A step
        all of whose rows are such rows is cut short (before the forward, or between layers);
        its result has no rows. At concurrency 1 in async mode this is the step planned ahead
        of an EOS, which would otherwise hold the next request's prefill back by up to a whole
        step. Steps still run strictly in order, and admissions and block appends of the cut
        step are applied as usual (later plans may rely on them).
        """
        if not plan.finished_req_ids:
            return
        with self._finished_lock:
            for req_id in plan.finished_req_ids:
                self._finished_in[req_id] = plan.step_id

    def _moot(self) -> bool:
        """Whether a later plan has finished every row of the running step."""
        current = self._current
        if current is None or not self._finished_in:
            return False
        step_id, req_ids = current
        finished_in = self._finished_in
        return bool(req_ids) and all(finished_in.get(req_id, -1) > step_id for req_id in req_ids)

    def _forget_notices_before(self, step_id: int) -> None:
        """Drop finish notices of plans up to ``step_id``: no step before them is left to run."""
        if not self._finished_in:
            return
        with self._finished_lock:
            for req_id in [r for r, s in self._finished_in.items() if s <= step_id]:
                del self._finished_in[req_id]

    def fail_requests(self, req_ids: list[str], error: str) -> None:
        """Drop the state of requests whose step failed; later rows for them get `error`."""
        for req_id in req_ids:
            self.release(req_id)
            self.failed[req_id] = error

    def release(self, req_id: str) -> None:
        """Drop a request's state slot; unknown ids are ignored (finish may race a preempt)."""
        self.failed.pop(req_id, None)
        info = self.slots.pop(req_id, None)
        if info is None:
            return
        del self.slots_by_index[info.slot]
        # `fill_`, not `t[i] = 0`: on CUDA that assignment copies a host scalar, blocking.
        self.state.num_drafts[info.slot].fill_(0)
        self.free_slots.append(info.slot)
        refs = self._block_refs
        for block_id in info.block_ids:
            if refs[block_id] == 1:
                del refs[block_id]
            else:
                refs[block_id] -= 1

    def kv_usage(self) -> float:
        """KV blocks held by live requests (shared prefix blocks once) / all blocks.

        The service thread reads it after every step: a count kept as blocks come and go, not
        a set built over every block held (0.18 ms per step at 256 requests).
        """
        return len(self._block_refs) / self.config.num_blocks

    def _admit(self, entry: PlanRow) -> SlotInfo:
        """Give a new (or resumed) request a state slot; `_runnable` checked that one is free."""
        self.release(entry.req_id)
        slot = self.free_slots.pop()
        # A new row without sampling parameters samples greedily (every field zero), as its
        # message's default would.
        sampling = entry.sampling if entry.sampling is not None else worker_pb2.SamplingParams()
        info = SlotInfo(slot=slot, block_ids=[], sampling=sampling)
        self.slot_sampling.set(slot, sampling)
        self.slots[entry.req_id] = info
        self.slots_by_index[slot] = info
        self.state.seq_len[slot].fill_(entry.num_cached_tokens)
        self.state.num_drafts[slot].fill_(0)
        if self.proposer is not None:
            self.proposer.admit(slot, entry.num_cached_tokens)
        return info

    def _take_blocks(
        self,
        info: SlotInfo,
        new_blocks: Sequence[int],
        table_slots: list[int],
        table_cols: list[int],
        table_ids: list[int],
    ) -> None:
        """Append a row's new KV blocks to its table (host side; the block-table cells to write
        go to ``table_*``, see `_write_block_tables`) and count the references."""
        start = len(info.block_ids)
        info.block_ids.extend(new_blocks)
        refs = self._block_refs
        for block_id in new_blocks:
            refs[block_id] = refs.get(block_id, 0) + 1
        table_slots.extend([info.slot] * len(new_blocks))
        table_cols.extend(range(start, start + len(new_blocks)))
        table_ids.extend(new_blocks)

    def _decode_widths(self, slots: list[int], num_draft_slots: list[int]) -> list[int]:
        """The slots each decode row computes: its sampled token plus its draft slots.

        Draft slots without a real draft can only be rejected; on the CPU the draft counts are
        already host memory, so those are trimmed. (On an accelerator reading them would stall
        the host behind the device, so the plan's shape is kept.)
        """
        if not self.trim_empty_drafts or not slots:
            return [1 + d for d in num_draft_slots]
        have = self.state.num_drafts[slots].tolist()
        return [1 + min(d, h) for d, h in zip(num_draft_slots, have)]

    def _write_block_tables(self, slots: list[int], cols: list[int], block_ids: list[int]) -> None:
        """``block_table[slots[i], cols[i]] = block_ids[i]`` for a whole step in one indexed
        write: one upload per step instead of a tensor (and, on an accelerator, a pinned copy)
        per row that gained blocks. No (slot, column) repeats within a step (a request appears
        once per plan), so the write order does not matter."""
        if not slots:
            return
        dev = self.device
        self.state.block_table[_to_device_list(slots, dev, torch.long), _to_device_list(cols, dev, torch.long)] = (
            _to_device_list(block_ids, dev)
        )

    # -- one step ------------------------------------------------------------------------------

    def _entry_error(
        self, plan: worker_pb2.StepPlan, entry: PlanRow, seen: set[str], num_free_slots: int
    ) -> str | None:
        """Why an entry cannot run (None: it can), checked before anything is changed, so a
        bad row is left out whole instead of half admitted."""
        # Every row of every step passes here: each field is read once.
        req_id = entry.req_id
        is_new = entry.is_new
        if req_id in seen:
            return f"request {req_id}: scheduled twice in one plan"
        if not is_new and req_id in self.failed:
            return f"request {req_id}: an earlier step failed for it: {self.failed[req_id]}"
        if self.test_fault_hook is not None:
            try:
                self.test_fault_hook(plan, entry)
            except Exception as exc:
                return f"request {req_id}: {exc}"
        info = None if is_new else self.slots.get(req_id)
        if not is_new and info is None:
            return f"request {req_id}: unknown to this worker and not is_new"
        if is_new and num_free_slots < 1:
            return f"request {req_id}: no free state slot (max_num_seqs={self.config.max_num_seqs})"
        new = entry.new_block_ids
        num_blocks = len(new)
        if num_blocks:
            if min(new) < 0 or max(new) >= self.config.num_blocks:
                return f"request {req_id}: block id out of range [0, {self.config.num_blocks})"
            if info is not None:
                num_blocks += len(info.block_ids)
            if num_blocks > self.max_blocks_per_seq:
                return (
                    f"request {req_id}: block table would hold {num_blocks} blocks, more than "
                    f"max_model_len allows ({self.max_blocks_per_seq})"
                )
        chunk = entry.token_ids
        if not chunk:
            if is_new:
                return f"request {req_id}: a new request must start with a prefill chunk"
            assert info is not None  # not new: checked above
            if not info.has_sample:
                return f"request {req_id}: decode step before any sample"
            num_draft_slots = entry.num_draft_slots
            if not 0 <= num_draft_slots <= self.num_spec_tokens:
                return (
                    f"request {req_id}: {num_draft_slots} draft slots, worker proposes at most {self.num_spec_tokens}"
                )
        elif self.vocab_size and (min(chunk) < 0 or max(chunk) >= self.vocab_size):
            return f"request {req_id}: token id outside the vocabulary [0, {self.vocab_size})"
        return None

    def _runnable(self, plan: worker_pb2.StepPlan) -> tuple[DecodeRows, list[PlanRow], dict[str, str]]:
        """Split a plan's rows into the ones to run (the column decode rows, then the message
        rows) and per-request errors for the rest.

        The decode columns are checked in bulk; only when that finds a row that cannot run are
        they checked one by one, in plan order, as the message rows always are, so each bad row
        gets its own error. A failed row drops the request's state (`fail_requests`), so its
        later rows fail too until the scheduler re-admits or finishes it; the other rows are
        untouched.
        """
        cols = decode_columns(plan)
        decodes = self._checked_decodes(cols)
        if decodes is None:
            decodes, rows, num_column_rows = DecodeRows(), column_rows(cols) + message_rows(plan), len(cols.req_ids)
            seen: set[str] = set()
        else:
            rows, num_column_rows = message_rows(plan), 0
            seen = set(decodes.req_ids)
        others: list[PlanRow] = []
        errors: dict[str, str] = {}
        num_free = len(self.free_slots)
        for i, entry in enumerate(rows):
            error = self._entry_error(plan, entry, seen, num_free)
            seen.add(entry.req_id)
            if error is not None:
                logger.warning("step %d: %s", plan.step_id, error)
                errors[entry.req_id] = error
                continue
            if entry.is_new:
                # Re-admitting a live request (a folded finish notice) frees its slot first.
                num_free += (entry.req_id in self.slots) - 1
            if i < num_column_rows:
                decodes.add(entry, self.slots[entry.req_id])
            else:
                others.append(entry)
        if errors:
            good = {*decodes.req_ids, *(e.req_id for e in others)}
            bad = [r for r in errors if r not in good]
            self.fail_requests(bad, "its row was rejected")
            for req_id in bad:
                self.failed[req_id] = errors[req_id]
        return decodes, others, errors

    def _checked_decodes(self, cols: DecodeColumnLists) -> DecodeRows | None:
        """The column decode rows if every one of them can run (what `_entry_error` would find
        for each, checked over whole columns); None if any cannot, or a fault hook is set."""
        req_ids = cols.req_ids
        if not req_ids:
            return DecodeRows()
        ids = set(req_ids)
        if (
            self.test_fault_hook is not None
            or len(ids) != len(req_ids)
            or not ids <= self.slots.keys()
            or not ids.isdisjoint(self.failed)
        ):
            return None
        infos = [self.slots[req_id] for req_id in req_ids]
        drafts = cols.num_draft_slots
        if not all(info.has_sample for info in infos) or min(drafts) < 0 or max(drafts) > self.num_spec_tokens:
            return None
        block_ids = cols.new_block_ids
        if block_ids:
            if min(block_ids) < 0 or max(block_ids) >= self.config.num_blocks:
                return None
            limit = self.max_blocks_per_seq
            if any(n and len(info.block_ids) + n > limit for info, n in zip(infos, cols.num_new_blocks)):
                return None
        return DecodeRows(req_ids, infos, drafts, cols.num_new_blocks, block_ids)

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> PendingResult:
        """Run one plan; returns outputs that may still be on the device.

        Rows that cannot run (see `_entry_error`) are left out with a per-request error in the
        result; the others run as if those rows had never been planned.
        """
        start = time.perf_counter()
        self.propose_next()  # the previous step's drafts, if the caller has not made them
        for req_id in plan.finished_req_ids:
            self.release(req_id)
        if self.test_fault_hook is not None:
            self.test_fault_hook(plan, None)
        # Rows that cannot run are left out: the others run as if they had never been planned.
        decodes, entries, errors = self._runnable(plan)
        self._forget_notices_before(plan.step_id)
        batch = self.prepare(plan, decodes, entries)
        if batch is None:
            return PendingResult(plan.step_id, [], [], None, None, None, None, [], 0, 0.0, errors=errors)
        self._current = (plan.step_id, batch.req_ids)
        try:
            if self._moot():
                raise StepInterrupted
            if self.simulator is not None:
                pending = self.simulator.step(self, batch)
            else:
                begin = self._device_event()
                logits = self.run_model(batch)
                pending = self.sample(batch, logits)
                pending.forward_s = time.perf_counter() - start
                if begin is not None:
                    end = self._device_event()
                    pending.device_span = (self._last_step_end, begin, end)
                    # The next step's gap counts from here while requests stay live.
                    self._last_step_end = end if self.slots else None
        except StepInterrupted:
            # Nothing of the step is used: no state advances, no tokens, no drafts.
            self._last_step_end = None
            self.num_cut_steps += 1
            logger.debug("step %d cut short: a later plan finished all its rows", plan.step_id)
            pending = PendingResult(plan.step_id, [], [], None, None, None, None, [], 0, time.perf_counter() - start)
        finally:
            self._current = None
        pending.errors = errors
        return pending

    def prepare(self, plan: worker_pb2.StepPlan, decodes: DecodeRows, entries: list[PlanRow]) -> StepBatch | None:
        """Apply the plan's finish notices and the admissions of the rows to run (the column
        decode rows ``decodes``, then ``entries``), then build the step's device inputs: input
        ids (decode rows from the device state), positions, slot mapping, attention metadata
        and sampling tensors. None when the step runs nothing.

        Every row must be one `_runnable` accepted (`execute` passes only those), so nothing
        here can fail half way through the admissions.
        """
        for req_id in plan.finished_req_ids:
            self.release(req_id)
        if not decodes.req_ids and not entries:
            return None

        table_slots: list[int] = []  # block-table cells this step writes (see _write_block_tables)
        table_cols: list[int] = []
        table_ids: list[int] = []
        # The column decode rows, a column at a time.
        rows: list[SlotInfo] = list(decodes.infos)
        req_ids: list[str] = list(decodes.req_ids)
        start = 0
        for info, n in zip(rows, decodes.num_new_blocks):
            if n:
                self._take_blocks(info, decodes.new_block_ids[start : start + n], table_slots, table_cols, table_ids)
                start += n
        num_scheduled = self._decode_widths([info.slot for info in rows], decodes.num_draft_slots)
        prefill_ids: list[int] = [0] * sum(num_scheduled)
        is_decode: list[bool] = [True] * len(rows)
        do_sample: list[bool] = [True] * len(rows)
        # The message rows (prefill chunks, new requests, decodes sent as messages), one by one.
        for entry in entries:
            req_id = entry.req_id
            info = self._admit(entry) if entry.is_new else self.slots[req_id]
            if entry.new_block_ids:
                self._take_blocks(info, entry.new_block_ids, table_slots, table_cols, table_ids)
            chunk = entry.token_ids
            decode = len(chunk) == 0
            if decode:
                n = self._decode_widths([info.slot], [entry.num_draft_slots])[0]
                prefill_ids.extend([0] * n)
            else:
                n = len(chunk)
                prefill_ids.extend(chunk)
            rows.append(info)
            req_ids.append(req_id)
            num_scheduled.append(n)
            is_decode.append(decode)
            do_sample.append(decode or entry.sample)

        self._write_block_tables(table_slots, table_cols, table_ids)
        dev = self.device
        qsl_host = [0]
        for n in num_scheduled:
            qsl_host.append(qsl_host[-1] + n)
        slot_ids = [r.slot for r in rows]
        req_slots = _to_device_list(slot_ids, dev)
        qsl = _to_device_list(qsl_host, dev)
        is_decode_t = _to_device_list(is_decode, dev, torch.bool)
        st = self.state
        input_ids, positions, slot_mapping = assemble_inputs(
            req_slots,
            qsl,
            is_decode_t,
            _to_device_list(prefill_ids, dev),
            st.seq_len,
            st.last_token,
            st.drafts,
            st.num_drafts,
            st.block_table,
            st.history,
            self.config.block_size,
        )
        num_sched_t = _to_device_list(num_scheduled, dev)
        max_blocks = max(len(r.block_ids) for r in rows)
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=st.seq_len[req_slots.long()] + num_sched_t,
            block_tables=st.block_table[req_slots.long(), :max_blocks],
            max_query_len=max(num_scheduled),
            max_seq_len=max_blocks * self.config.block_size,
            slot_mapping=slot_mapping,
        )
        want_logprobs = [bool(r.sampling.logprobs) for r in rows]
        sampled_rows = [i for i in range(len(rows)) if do_sample[i]]
        sampled = (
            self._sampled_rows(
                sampled_rows,
                np.asarray(slot_ids, np.int64),
                req_slots,
                positions,
                np.asarray(qsl_host, np.int64),
                np.asarray(num_scheduled, np.int64),
                np.asarray(is_decode, np.bool_),
                want_logprobs,
            )
            if sampled_rows
            else None
        )
        return StepBatch(
            step_id=plan.step_id,
            req_ids=req_ids,
            rows=rows,
            num_tokens=qsl_host[-1],
            req_slots=req_slots,
            is_decode=is_decode_t,
            num_scheduled=num_sched_t,
            do_sample=_to_device_list(do_sample, dev, torch.bool),
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            want_logprobs=want_logprobs,
            sampled=sampled,
            row_widths=num_scheduled,
            all_decode=all(is_decode),
        )

    def _sampled_rows(
        self,
        sampled_rows: list[int],
        slots: np.ndarray,
        req_slots: torch.Tensor,
        positions: torch.Tensor,
        qsl_host: np.ndarray,
        num_scheduled: np.ndarray,
        is_decode: np.ndarray,
        want_logprobs: list[bool],
    ) -> SampledRows:
        """Index and sampling tensors of the rows that sample this step (see `SampledRows`).

        Built with a constant number of array operations, not a Python loop over rows: at GPU
        batch sizes this runs once per step for hundreds of rows.
        """
        dev = self.device
        width = self.num_spec_tokens + 1
        sel = np.asarray(sampled_rows, np.int64)
        # Real slots per sampled row: every fed slot of a decode, the last token of a prefill.
        n = np.where(is_decode[sel], num_scheduled[sel], 1)
        firsts = qsl_host[sel + 1] - n  # flat index of each row's first logit
        base = np.cumsum(n) - n  # where each row starts among the gathered slots
        total = int(n.sum())
        within = np.arange(total) - np.repeat(base, n)  # column of each gathered slot
        gather_idx = np.repeat(firsts, n) + within
        # (sampled row, column) -> gathered slot; a trimmed row repeats its last real slot.
        pad_index = (base[:, None] + np.minimum(np.arange(width)[None, :], n[:, None] - 1)).reshape(-1)
        gather = _to_device_list(gather_idx, dev, torch.long)
        padded = total < len(pad_index)
        any_logprobs = any(want_logprobs[i] for i in sampled_rows)
        # Absolute position of each sampled token = input position + 1 (keys the randomness).
        sample_pos = positions[gather] + 1
        tensors = self.sampling_tensors(slots[sel], n, sample_pos)
        rows_t = _to_device_list(sel, dev, torch.long)
        row_top = self.slot_sampling.top_logprobs[slots[sel]]
        return SampledRows(
            rows=sampled_rows,
            rows_t=rows_t,
            # Indexing with the Python list would copy it to the device from pageable memory.
            slots=req_slots[rows_t],
            gather=gather,
            pad=_to_device_list(pad_index, dev, torch.long) if padded else None,
            num_cols=_to_device_list(n, dev),
            row_start=_to_device_list(firsts, dev, torch.long),
            positions=sample_pos,
            sampling=tensors,
            # Back from [S, K+1] to one entry per real slot, in gather order.
            logprob_index=_to_device_list(np.repeat(np.arange(len(sel)) * width, n) + within, dev, torch.long)
            if padded and any_logprobs
            else None,
            want_logprobs=any_logprobs,
            num_top=row_top.tolist() if row_top.max() > 0 else [],
        )

    def _forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The model body (writes K/V): what a decode graph captures. Its logits are computed
        after the replay: captured, every graph would keep its own ``[rows * width, vocab]``
        output alive (outputs outlive their capture), over 20 GB for 256 sequences, k = 3 and
        a 128k vocabulary, against a few hundred MB of hidden states."""
        assert self.model is not None
        return self.model(input_ids, positions, meta, self.kv_caches)

    def run_model(self, batch: StepBatch) -> torch.Tensor | None:
        """The forward over the flat batch (writes K/V) and the logits of the sampled slots
        (``[G, vocab]``; None when no row samples). Pure-decode steps replay a CUDA graph
        when one was captured for their shape."""
        assert self.model is not None  # a simulated device never gets here
        key = None
        if self.graphs is not None and batch.all_decode:
            key = self.graphs.choose(batch.row_widths, [True] * len(batch.row_widths))
        if key is not None and self.graphs is not None:
            # Every token of a decode row is sampled, in order: the logits are already [G, vocab].
            hidden = self.graphs.run(
                key,
                batch.input_ids,
                batch.positions,
                batch.meta,
                self.state.block_table.index_select(0, batch.req_slots.long()),
            )
            logits = self.model.compute_logits(hidden)
            if self.proposer is not None:
                self.proposer.observe(batch)
            return logits
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
        if self.proposer is not None:
            self.proposer.observe(batch)
        if batch.sampled is None:
            return None
        return self.model.compute_logits(hidden[batch.sampled.gather])

    def sample(self, batch: StepBatch, logits: torch.Tensor | None) -> PendingResult:
        """Sample and verify the sampled rows, then advance the device state (see `advance`)."""
        s = batch.sampled
        if s is None or logits is None:
            return self.advance(batch, None)
        k_max = self.num_spec_tokens
        width = k_max + 1
        num_s = len(s.rows)
        draft_tokens, num_verified = self.fed_drafts(batch)
        if self.proposer is not None and self.proposer.has_draft_probs:
            probs = s.spread(target_probs(logits, s.sampling), width)
            q = self.proposer.draft_probs(s.slots, k_max)
            out_tokens, num_accepted = rejection_sample(
                probs,
                q,
                draft_tokens,
                num_verified,
                s.spread(s.sampling.seeds, width)[:, 0],
                s.spread(s.positions, width)[:, 0],
            )
        else:
            out_tokens = s.spread(sample(logits, s.sampling), width)
            num_accepted = (
                count_accepted(out_tokens, draft_tokens, num_verified)
                if k_max
                else torch.zeros(num_s, dtype=torch.int32, device=self.device)
            )
        lp = None
        if s.want_logprobs:
            # Rejection sampling leaves -1 after the emitted token; those columns are never
            # returned, but gathering at -1 would fail the whole step.
            tokens = out_tokens.reshape(-1)
            if s.logprob_index is not None:
                tokens = tokens[s.logprob_index]
            lp = s.spread(token_logprobs(logits, tokens.long().clamp(min=0)), width)
        out = StepOutputs(out_tokens, num_accepted, num_verified, lp)
        if s.num_top:
            # Column c holds the distribution the token at column c was drawn from.
            top_ids, top_lps = top_logprobs(logits, max(s.num_top))
            out.top_ids, out.top_logprobs = s.spread(top_ids, width), s.spread(top_lps, width)
        return self.advance(batch, out)

    def fed_drafts(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts fed to the sampled rows (``[S, K]``) and how many of them are real (``[S]``).

        Drafts are the inputs after the first slot of each decode row; only the ones the
        proposer really produced count (the rest were filler and must be rejected).
        """
        s = batch.sampled
        assert s is not None
        k_max = self.num_spec_tokens
        num_verified = torch.minimum(self.state.num_drafts[s.slots.long()], s.num_cols - 1)
        if not k_max:
            return batch.input_ids.new_zeros((len(s.rows), 0)), num_verified
        col = torch.arange(k_max, device=self.device)
        draft_idx = (s.row_start[:, None] + 1 + col[None, :]).clamp(max=batch.num_tokens - 1)
        return batch.input_ids[draft_idx], num_verified

    def advance(self, batch: StepBatch, out: StepOutputs | None) -> PendingResult:
        """Sequence-length correction on the device (the true accepted counts, not the plan's)
        and the start of the result copy; the next drafts wait for `propose_next`. ``out`` is
        None when no row sampled."""
        dev = self.device
        num_rows = len(batch.rows)
        st = self.state
        acc_all = torch.zeros(num_rows, dtype=torch.int32, device=dev)
        last_all = torch.zeros(num_rows, dtype=torch.int32, device=dev)
        s = batch.sampled
        if out is not None and s is not None:
            acc_all[s.rows_t] = out.num_accepted.to(torch.int32)
            last_all[s.rows_t] = out.tokens.gather(1, out.num_accepted.long()[:, None])[:, 0].to(torch.int32)
        update_state(
            batch.req_slots,
            batch.is_decode,
            batch.num_scheduled,
            acc_all,
            batch.do_sample,
            last_all,
            st.seq_len,
            st.last_token,
            st.num_drafts,
        )
        if out is None or s is None:
            return PendingResult(
                batch.step_id, batch.req_ids, [], None, None, None, None, batch.want_logprobs, batch.num_tokens, 0.0
            )
        for i in s.rows:
            batch.rows[i].has_sample = True
        pending = PendingResult(
            batch.step_id,
            batch.req_ids,
            s.rows,
            out.tokens,
            out.num_accepted,
            out.num_verified,
            out.logprobs,
            batch.want_logprobs,
            batch.num_tokens,
            0.0,
        )
        if out.top_ids is not None:
            pending.top_ids, pending.top_logprobs = out.top_ids, out.top_logprobs
            pending.num_top = s.num_top
        self._start_copy(pending)
        # The next drafts are left to `propose_next`, after the caller has handed this result
        # on: the copy then waits for this step's sampling only, and the scheduler hears the
        # step while a draft model's k forwards run (on a GPU: while they are launched).
        if self.proposer is not None:
            self._next_drafts = (s.slots, batch)
        return pending

    @torch.inference_mode()
    def propose_next(self) -> None:
        """Make the drafts of the rows the last executed step sampled (a no-op when made).

        The worker's step loop calls it once the step's result is on its way to the copier;
        `execute` calls it first thing, so a caller that does not still gets every draft, in
        the same order.
        """
        if self._next_drafts is None:
            return
        slots, batch = self._next_drafts
        self._next_drafts = None
        assert self.proposer is not None
        # Drafts for requests a later plan has finished are never used: a draft model's chain
        # stops between layers then (its forward asks `_moot`, as the target's does). With the
        # result already out, the finish notice for a request's last step arrives while its
        # chain runs, and the next request's prefill no longer waits for that chain.
        self._current = (batch.step_id, batch.req_ids)
        try:
            self.proposer.propose(slots, batch)
        except StepInterrupted:
            self.num_cut_drafts += 1
            logger.debug("drafts after step %d cut short: a later plan finished all its rows", batch.step_id)
        finally:
            self._current = None

    def sampling_tensors(self, slots: np.ndarray, valid_cols: np.ndarray, sample_pos: torch.Tensor) -> SamplingTensors:
        """Per-logits-row sampling tensors; ``valid_cols[i]`` rows belong to state slot ``slots[i]``.

        The common controls are gathered from `SlotSampling` (host arrays written on
        admission). Penalty counts are taken over each logits row's own context read from the
        token history (``sample_pos`` = its context length, on the device), so the row of draft
        j in a verification sees drafts 0..j-1 of the same row and nothing that was rejected
        before. The draft-model proposer builds its chain's tensors here too (the same controls).
        """
        dev = self.device
        ss = self.slot_sampling
        per_row = np.repeat(slots, valid_cols)
        penalties = bias = None
        if ss.special[slots].any():
            penalties, bias = self._penalties_and_bias(per_row.tolist(), sample_pos)
        return SamplingTensors.from_params(
            temperatures=ss.temperature[per_row],
            top_ks=ss.top_k[per_row],
            top_ps=ss.top_p[per_row],
            seeds=ss.seed[per_row],
            positions=sample_pos,
            device=dev,
            min_ps=ss.min_p[per_row],
            penalties=penalties,
            logit_bias=bias,
        )

    def _penalties_and_bias(
        self, row_slots: list[int], sample_pos: torch.Tensor
    ) -> tuple[Penalties | None, LogitBias | None]:
        """The penalty and logit-bias tensors of the logits rows whose request uses them
        (``row_slots[g]`` is the state slot of logits row g)."""
        dev = self.device
        infos = [self.slots_by_index[slot] for slot in row_slots]
        pen_rows: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for g, info in enumerate(infos):
            p = info.sampling
            if has_penalty(p):
                pen_rows.append(g)
            for token_id, value in p.logit_bias.items():
                bias_rows.append(g)
                bias_ids.append(token_id)
                bias_values.append(value)
        penalties = None
        if pen_rows:
            pens = [infos[g].sampling for g in pen_rows]
            num_blocks = max(len(infos[g].block_ids) for g in pen_rows)
            rep = [p.repetition_penalty if p.repetition_penalty > 0 else 1.0 for p in pens]
            need_counts = any(p.frequency_penalty or p.presence_penalty for p in pens)
            rows_t = _to_device_list(pen_rows, dev, torch.long)
            counts, seen = context_token_counts(
                self.state.history,
                self.state.block_table[_to_device_list([row_slots[g] for g in pen_rows], dev, torch.long), :num_blocks],
                sample_pos[rows_t],
                _to_device_list([p.num_prompt_tokens for p in pens], dev),
                int(self.loaded.hf_config.vocab_size),
                need_counts=need_counts,
                need_seen=any(r != 1.0 for r in rep),
            )
            penalties = Penalties(
                rows=rows_t,
                repetition=_to_device_list(rep, dev, torch.float32),
                frequency=_to_device_list([p.frequency_penalty for p in pens], dev, torch.float32),
                presence=_to_device_list([p.presence_penalty for p in pens], dev, torch.float32),
                output_counts=counts,
                seen=seen,
            )
        bias = None
        if bias_rows:
            bias = LogitBias(
                rows=_to_device_list(bias_rows, dev, torch.long),
                token_ids=_to_device_list(bias_ids, dev, torch.long),
                values=_to_device_list(bias_values, dev, torch.float32),
            )
        return penalties, bias

    def _device_event(self) -> Any:
        """A timing event recorded now on the compute stream (CUDA); None elsewhere."""
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record()
        return event

    def _start_copy(self, pending: PendingResult) -> None:
        """Start the device-to-host copy of a step's outputs without blocking the next step.

        On CUDA the copy runs on a side stream after the step's kernels and `materialize`
        (on the copier thread) waits for its event; the step thread never waits.
        """
        if not self.accelerator:
            return  # CPU tensors are already on the host; materialize() just reads them
        names = ("out_tokens", "num_accepted", "num_drafts", "logprobs", "top_ids", "top_logprobs")
        if self._copy_stream is None:  # an accelerator without streams (the fake test device)
            for name in names:
                t = getattr(pending, name)
                if t is not None:
                    setattr(pending, name, staging.to_host(t))
            return
        main = torch.cuda.current_stream()
        self._copy_stream.wait_stream(main)
        with torch.cuda.stream(self._copy_stream):
            for name in names:
                t = getattr(pending, name)
                if t is not None:
                    t.record_stream(self._copy_stream)
                    setattr(pending, name, staging.to_host(t))
            # Blocking: the copier thread sleeps in `synchronize` instead of spinning a core
            # for most of every step (the copy runs after the whole step).
            event = torch.cuda.Event(blocking=True)
            event.record(self._copy_stream)
        pending.ready = event
