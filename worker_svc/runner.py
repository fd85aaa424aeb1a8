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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels.attention import AttentionMetadata
from kernels.inputs import assemble_inputs
from kernels.seq_lens import update_state
from kernels.verify import count_accepted, rejection_sample
from worker_svc.model_loader import LoadedModel
from worker_svc.model import allocate_kv_cache
from worker_svc.proposers import Proposer
from worker_svc.sampler import SEED_MASK, SamplingTensors, sample, target_probs, token_logprobs
from zerobubble.api import worker_pb2
from zerobubble.config import WorkerConfig, default_of

logger = logging.getLogger(__name__)




class PlanError(ValueError):
    """A plan the runner cannot execute (it names the request and what is wrong)."""


@dataclass(slots=True)
class RunnerConfig:
    """Capacity and speculation settings of one runner."""

    num_blocks: int
    block_size: int = default_of(WorkerConfig, "block_size")
    max_num_seqs: int = default_of(WorkerConfig, "max_num_seqs")
    max_model_len: int = 2048
    num_spec_tokens: int = 0  # K: the most draft slots any decode may carry


@dataclass(slots=True)
class DeviceState:
    """Per-slot tensors that persist between steps (see docs/INTERNALS.md)."""

    seq_len: torch.Tensor      # [S] int32: tokens whose K/V are written
    last_token: torch.Tensor   # [S] int32: last sampled token
    drafts: torch.Tensor       # [S, K] int32
    num_drafts: torch.Tensor   # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    history: torch.Tensor      # [num_blocks, block_size] int32: token pages following the KV blocks


@dataclass(slots=True)
class SlotInfo:
    """Host-side bookkeeping of one request's state slot (no device reads needed)."""

    slot: int
    block_ids: list[int]
    sampling: worker_pb2.SamplingParams
    has_sample: bool = False  # a token has been sampled: decode steps are allowed


@dataclass(slots=True)
class PendingResult:
    """A step whose outputs may still be on the device; `materialize` copies them to the host."""

    step_id: int
    req_ids: list[str]
    sampled_rows: list[int]          # rows (into req_ids) that emitted tokens
    out_tokens: torch.Tensor | None  # [num_sampled, K+1]
    num_accepted: torch.Tensor | None
    num_drafts: torch.Tensor | None  # drafts actually verified per sampled row
    logprobs: torch.Tensor | None    # [num_sampled, K+1]
    want_logprobs: list[bool]
    num_tokens: int
    forward_s: float
    ready: object | None = None      # CUDA event after the async device-to-host copy
    extra: dict = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # rows left out: req_id -> why

    def materialize(self, idle_s: float, num_spec_tokens: int) -> worker_pb2.StepResult:
        """Wait for the copy (if any) and build the wire result."""
        if self.ready is not None:
            self.ready.synchronize()
        result = worker_pb2.StepResult(step_id=self.step_id, forward_s=self.forward_s,
                                       idle_s=idle_s, num_tokens=self.num_tokens)
        accepted_per_pos = [0] * num_spec_tokens
        by_row: dict[int, int] = {row: i for i, row in enumerate(self.sampled_rows)}
        tokens = self.out_tokens.tolist() if self.out_tokens is not None else []
        accepted = self.num_accepted.tolist() if self.num_accepted is not None else []
        drafted = self.num_drafts.tolist() if self.num_drafts is not None else []
        logprobs = self.logprobs.tolist() if self.logprobs is not None else []
        for row, req_id in enumerate(self.req_ids):
            entry = result.results.add(req_id=req_id)
            i = by_row.get(row)
            if i is None:
                continue
            num_acc = int(accepted[i])
            entry.token_ids.extend(tokens[i][: num_acc + 1])
            entry.num_draft_tokens = int(drafted[i])
            entry.num_accepted = num_acc
            if self.want_logprobs[row]:
                entry.logprobs.extend(logprobs[i][: num_acc + 1])
            for pos in range(num_acc):
                accepted_per_pos[pos] += 1
        for req_id, error in self.errors.items():
            result.results.add(req_id=req_id, error=error)
        result.accepted_per_pos.extend(accepted_per_pos)
        return result


def _to_device_list(values: list[int], device: torch.device, dtype=torch.int32) -> torch.Tensor:
    # One host-to-device copy per list; pinned staging is not worth it at these sizes.
    return torch.tensor(values, dtype=dtype, device=device)


class ModelRunner:
    """Holds the model, its paged KV cache and the persistent batch state; executes plans."""

    def __init__(self, loaded: LoadedModel, config: RunnerConfig,
                 proposer: Proposer | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = config
        self.device = loaded.model.device
        self.proposer = proposer
        self.num_spec_tokens = config.num_spec_tokens if proposer is not None else 0
        self.kv_caches = allocate_kv_cache(loaded.hf_config, config.num_blocks, config.block_size,
                                           loaded.model.dtype, self.device)
        # Room for the lookahead slots a step may feed past max_model_len's last block.
        max_blocks = -(-(config.max_model_len + config.num_spec_tokens + 1) // config.block_size) + 1
        self.max_blocks_per_seq = max_blocks
        num_slots = config.max_num_seqs
        k = max(self.num_spec_tokens, 1)
        z = dict(dtype=torch.int32, device=self.device)
        self.state = DeviceState(
            seq_len=torch.zeros(num_slots, **z),
            last_token=torch.zeros(num_slots, **z),
            drafts=torch.full((num_slots, k), -1, **z),
            num_drafts=torch.zeros(num_slots, **z),
            block_table=torch.zeros(num_slots, max_blocks, **z),
            history=torch.zeros(config.num_blocks, config.block_size, **z),
        )
        self.slots: dict[str, SlotInfo] = {}
        self.slots_by_index: dict[int, SlotInfo] = {}
        # Requests whose row failed: their state is dropped, and entries for them in plans
        # already sent get a per-request error until the scheduler re-admits (is_new) or
        # finishes them. Without this, a decode row planned before the failure was known would
        # be a `PlanError` for the whole next plan.
        self.failed: dict[str, str] = {}
        # Test-only fault injection (tests/test_fault_isolation.py, the chaos suite): called
        # with (plan, None) when a step starts, where an exception fails the whole step as a
        # crash in the model would, then with (plan, entry) for each row, where an exception
        # fails that row alone.
        self.test_fault_hook: Callable[[worker_pb2.StepPlan,
                                        worker_pb2.ScheduledRequest | None], None] | None = None
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        if proposer is not None:
            proposer.bind(self)
        self._copy_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self.trim_empty_drafts = self.device.type == "cpu"

    # -- request state -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (a new scheduler stream starts from scratch)."""
        for req_id in list(self.slots):
            self.release(req_id)
        self.failed.clear()

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
        self.state.num_drafts[info.slot] = 0
        self.free_slots.append(info.slot)
        if self.proposer is not None:
            self.proposer.release(info.slot)

    def _admit(self, entry: worker_pb2.ScheduledRequest) -> SlotInfo:
        if entry.req_id in self.slots:
            # A resumed request whose finish notice was folded into the same plan.
            self.release(entry.req_id)
        if not self.free_slots:
            raise PlanError(f"request {entry.req_id}: no free state slot "
                            f"(max_num_seqs={self.config.max_num_seqs})")
        slot = self.free_slots.pop()
        info = SlotInfo(slot=slot, block_ids=[], sampling=entry.sampling)
        self.slots[entry.req_id] = info
        self.slots_by_index[slot] = info
        self.state.seq_len[slot] = entry.num_cached_tokens
        self.state.num_drafts[slot] = 0
        if self.proposer is not None:
            self.proposer.admit(slot, entry.num_cached_tokens)
        return info

    def _append_blocks(self, info: SlotInfo, entry: worker_pb2.ScheduledRequest) -> None:
        new = list(entry.new_block_ids)
        if not new:
            return
        start = len(info.block_ids)
        end = start + len(new)
        if end > self.max_blocks_per_seq:
            raise PlanError(f"request {entry.req_id}: block table would hold {end} blocks, "
                            f"more than max_model_len allows ({self.max_blocks_per_seq})")
        if min(new) < 0 or max(new) >= self.config.num_blocks:
            raise PlanError(f"request {entry.req_id}: block id out of range "
                            f"[0, {self.config.num_blocks})")
        self.state.block_table[info.slot, start:end] = _to_device_list(new, self.device)
        info.block_ids.extend(new)

    def kv_usage(self) -> float:
        """KV blocks held by live requests (shared prefix blocks once) / all blocks."""
        held = set()
        # A snapshot: the service thread reads this while the step thread admits requests.
        for info in list(self.slots.values()):
            held.update(info.block_ids)
        return len(held) / self.config.num_blocks

    # -- one step ------------------------------------------------------------------------------

    def _entry_error(self, plan: worker_pb2.StepPlan, entry: worker_pb2.ScheduledRequest,
                     seen: set[str], num_free_slots: int) -> str | None:
        """Why an entry cannot run (None: it can), checked before anything is changed, so a
        bad row is left out whole instead of half admitted."""
        req_id = entry.req_id
        if req_id in seen:
            return f"request {req_id}: scheduled twice in one plan"
        if not entry.is_new and req_id in self.failed:
            return f"request {req_id}: an earlier step failed for it: {self.failed[req_id]}"
        if self.test_fault_hook is not None:
            try:
                self.test_fault_hook(plan, entry)
            except Exception as exc:
                return f"request {req_id}: {exc}"
        info = None if entry.is_new else self.slots.get(req_id)
        if not entry.is_new and info is None:
            return f"request {req_id}: unknown to this worker and not is_new"
        if entry.is_new and num_free_slots < 1:
            return (f"request {req_id}: no free state slot "
                    f"(max_num_seqs={self.config.max_num_seqs})")
        new = list(entry.new_block_ids)
        if new and (min(new) < 0 or max(new) >= self.config.num_blocks):
            return f"request {req_id}: block id out of range [0, {self.config.num_blocks})"
        num_blocks = (0 if info is None else len(info.block_ids)) + len(new)
        if num_blocks > self.max_blocks_per_seq:
            return (f"request {req_id}: block table would hold {num_blocks} blocks, more than "
                    f"max_model_len allows ({self.max_blocks_per_seq})")
        if len(entry.token_ids) == 0:
            if entry.is_new:
                return f"request {req_id}: a new request must start with a prefill chunk"
            if not info.has_sample:
                return f"request {req_id}: decode step before any sample"
            if not 0 <= entry.num_draft_slots <= self.num_spec_tokens:
                return (f"request {req_id}: {entry.num_draft_slots} draft slots, worker "
                        f"proposes at most {self.num_spec_tokens}")
        else:
            vocab_size = self.loaded.hf_config.vocab_size
            if min(entry.token_ids) < 0 or max(entry.token_ids) >= vocab_size:
                return f"request {req_id}: token id outside the vocabulary [0, {vocab_size})"
        return None

    def _runnable(self, plan: worker_pb2.StepPlan) -> tuple[list[worker_pb2.ScheduledRequest],
                                                           dict[str, str]]:
        """Split a plan's entries into the ones to run and per-request errors for the rest.

        A failed row drops the request's state (`fail_requests`), so its later rows fail too
        until the scheduler re-admits or finishes it; the other rows are untouched.
        """
        good: list[worker_pb2.ScheduledRequest] = []
        errors: dict[str, str] = {}
        seen: set[str] = set()
        num_free = len(self.free_slots)
        for entry in plan.requests:
            error = self._entry_error(plan, entry, seen, num_free)
            seen.add(entry.req_id)
            if error is not None:
                logger.warning("step %d: %s", plan.step_id, error)
                errors[entry.req_id] = error
                continue
            if entry.is_new:
                # Re-admitting a live request (a folded finish notice) frees its slot first.
                num_free += (entry.req_id in self.slots) - 1
            good.append(entry)
        bad = [r for r in errors if r not in {e.req_id for e in good}]
        self.fail_requests(bad, "its row was rejected")
        for req_id in bad:
            self.failed[req_id] = errors[req_id]
        return good, errors

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> PendingResult:
        """Run one plan; returns outputs that may still be on the device.

        Rows that cannot run (see `_entry_error`) are left out with a per-request error in the
        result; the others run as if those rows had never been planned.
        """
        start = time.perf_counter()
        for req_id in plan.finished_req_ids:
            self.release(req_id)
        if self.test_fault_hook is not None:
            self.test_fault_hook(plan, None)
        entries, errors = self._runnable(plan)
        if not entries:
            return PendingResult(plan.step_id, [], [], None, None, None, None, [], 0, 0.0,
                                 errors=errors)

        rows: list[SlotInfo] = []
        req_ids: list[str] = []
        num_scheduled: list[int] = []
        is_decode: list[bool] = []
        do_sample: list[bool] = []
        prefill_ids: list[int] = []
        for entry in entries:
            info = self._admit(entry) if entry.is_new else self.slots.get(entry.req_id)
            if info is None:
                raise PlanError(f"request {entry.req_id}: unknown to this worker and not is_new")
            self._append_blocks(info, entry)
            decode = len(entry.token_ids) == 0
            if decode:
                if not info.has_sample:
                    raise PlanError(f"request {entry.req_id}: decode step before any sample")
                if entry.num_draft_slots > self.num_spec_tokens:
                    raise PlanError(f"request {entry.req_id}: {entry.num_draft_slots} draft slots, "
                                    f"worker proposes at most {self.num_spec_tokens}")
                n = 1 + entry.num_draft_slots
                if self.trim_empty_drafts:
                    # Slots without a real draft can only be rejected; on the CPU the draft count
                    # is already host memory, so skip computing them. (On CUDA reading it would
                    # stall the host behind the device, so the plan's shape is kept.)
                    n = 1 + min(entry.num_draft_slots, int(self.state.num_drafts[info.slot]))
                prefill_ids.extend([0] * n)
            else:
                n = len(entry.token_ids)
                prefill_ids.extend(entry.token_ids)
            rows.append(info)
            req_ids.append(entry.req_id)
            num_scheduled.append(n)
            is_decode.append(decode)
            do_sample.append(decode or entry.sample)

        dev = self.device
        num_rows = len(rows)
        qsl_host = [0]
        for n in num_scheduled:
            qsl_host.append(qsl_host[-1] + n)
        num_tokens = qsl_host[-1]
        req_slots = _to_device_list([r.slot for r in rows], dev)
        qsl = _to_device_list(qsl_host, dev)
        is_decode_t = torch.tensor(is_decode, dtype=torch.bool, device=dev)
        st = self.state
        input_ids, positions, slot_mapping = assemble_inputs(
            req_slots, qsl, is_decode_t, _to_device_list(prefill_ids, dev), st.seq_len,
            st.last_token, st.drafts, st.num_drafts, st.block_table, st.history,
            self.config.block_size)
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
        hidden = self.model(input_ids, positions, meta, self.kv_caches)

        # Logits only where a token is sampled or verified: every slot of a decode row, the last
        # token of a sampling prefill chunk.
        k_max = self.num_spec_tokens
        width = k_max + 1
        sampled_rows = [i for i in range(num_rows) if do_sample[i]]
        if not sampled_rows:
            update_state(req_slots, is_decode_t, num_sched_t, torch.zeros_like(num_sched_t),
                         torch.zeros(num_rows, dtype=torch.bool, device=dev),
                         torch.zeros_like(num_sched_t), st.seq_len, st.last_token, st.num_drafts)
            return PendingResult(plan.step_id, req_ids, [], None, None, None, None,
                                 [bool(r.sampling.logprobs) for r in rows], num_tokens,
                                 time.perf_counter() - start, errors=errors)
        # Logits only for real slots (a trimmed decode row has fewer than K+1); ``pad_index``
        # then spreads the per-slot results to K+1 columns per row, repeating a row's last slot.
        gather_idx: list[int] = []   # flat token index of every real slot
        pad_index: list[int] = []    # (sampled row, column) -> index into gather_idx
        valid_cols: list[int] = []   # real slots per sampled row
        firsts: list[int] = []       # flat index of each sampled row's first logit
        for i in sampled_rows:
            n = num_scheduled[i] if is_decode[i] else 1
            first = qsl_host[i + 1] - n
            base = len(gather_idx)
            gather_idx.extend(range(first, first + n))
            pad_index.extend(base + min(c, n - 1) for c in range(width))
            valid_cols.append(n)
            firsts.append(first)
        num_s = len(sampled_rows)
        sampled_slots = req_slots[sampled_rows]
        gather_t = _to_device_list(gather_idx, dev, torch.long)
        padded = len(gather_idx) < len(pad_index)
        pad_t = _to_device_list(pad_index, dev, torch.long) if padded else None

        def spread(t: torch.Tensor) -> torch.Tensor:
            """Per-slot values -> ``[num_s, width, ...]``."""
            return (t[pad_t] if padded else t).view(num_s, width, *t.shape[1:])

        logits = self.model.compute_logits(hidden[gather_t])
        # Absolute position of each sampled token = input position + 1 (keys the randomness).
        sample_pos = positions[gather_t] + 1
        infos = [rows[i].sampling for i in sampled_rows]
        tensors = SamplingTensors.from_params(
            temperatures=[p.temperature for p, n in zip(infos, valid_cols) for _ in range(n)],
            top_ks=[p.top_k for p, n in zip(infos, valid_cols) for _ in range(n)],
            top_ps=[p.top_p if p.top_p > 0 else 1.0 for p, n in zip(infos, valid_cols) for _ in range(n)],
            seeds=[p.seed & SEED_MASK for p, n in zip(infos, valid_cols) for _ in range(n)],
            positions=sample_pos, device=dev)

        # Drafts fed this step are the inputs after the first slot of each decode row; only the
        # ones the proposer really produced count (the rest were filler and must be rejected).
        ncols = _to_device_list(valid_cols, dev)
        num_verified = torch.minimum(st.num_drafts[sampled_slots.long()], ncols - 1)
        col = torch.arange(width, device=dev)
        row_start = _to_device_list(firsts, dev, torch.long)
        draft_idx = (row_start[:, None] + 1 + col[None, :k_max]).clamp(max=num_tokens - 1)
        draft_tokens = input_ids[draft_idx] if k_max else input_ids.new_zeros((num_s, 0))
        if self.proposer is not None and self.proposer.has_draft_probs:
            probs = spread(target_probs(logits, tensors))
            q = self.proposer.draft_probs(sampled_slots, k_max)
            out_tokens, num_accepted = rejection_sample(
                probs, q, draft_tokens, num_verified, spread(tensors.seeds)[:, 0], spread(sample_pos)[:, 0])
        else:
            out_tokens = spread(sample(logits, tensors))
            num_accepted = count_accepted(out_tokens, draft_tokens, num_verified) if k_max else \
                torch.zeros(num_s, dtype=torch.int32, device=dev)
        want_lp = [bool(r.sampling.logprobs) for r in rows]
        lp = None
        if any(want_lp[i] for i in sampled_rows):
            # Rejection sampling leaves -1 after the emitted token; those columns are never
            # returned, but gathering at -1 would fail the whole step.
            tokens = out_tokens.reshape(-1)
            if padded:  # back to one entry per real slot, in gather_idx order
                tokens = tokens[_to_device_list([r * width + c for r, n in enumerate(valid_cols)
                                                 for c in range(n)], dev, torch.long)]
            lp = spread(token_logprobs(logits, tokens.long().clamp(min=0)))

        # Sequence-length correction, on the device: the true accepted counts, not the plan's.
        acc_all = torch.zeros(num_rows, dtype=torch.int32, device=dev)
        last_all = torch.zeros(num_rows, dtype=torch.int32, device=dev)
        rows_t = _to_device_list(sampled_rows, dev, torch.long)
        acc_all[rows_t] = num_accepted.to(torch.int32)
        last_all[rows_t] = out_tokens.gather(1, num_accepted.long()[:, None])[:, 0].to(torch.int32)
        update_state(req_slots, is_decode_t, num_sched_t, acc_all,
                     torch.tensor(do_sample, dtype=torch.bool, device=dev), last_all,
                     st.seq_len, st.last_token, st.num_drafts)
        for i in sampled_rows:
            rows[i].has_sample = True
        if self.proposer is not None:
            self.proposer.propose(sampled_slots, self.kv_caches)

        pending = PendingResult(plan.step_id, req_ids, sampled_rows, out_tokens, num_accepted,
                                num_verified, lp, want_lp, num_tokens, 0.0, errors=errors)
        self._start_copy(pending)
        pending.forward_s = time.perf_counter() - start
        return pending

    def _start_copy(self, pending: PendingResult) -> None:
        """Start the device-to-host copy of a step's outputs without blocking the next step."""
        if self._copy_stream is None:
            return  # CPU tensors are already on the host; materialize() just reads them
        main = torch.cuda.current_stream()
        self._copy_stream.wait_stream(main)
        with torch.cuda.stream(self._copy_stream):
            for name in ("out_tokens", "num_accepted", "num_drafts", "logprobs"):
                t = getattr(pending, name)
                if t is not None:
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t, non_blocking=True)
                    t.record_stream(self._copy_stream)
                    setattr(pending, name, host)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        pending.ready = event
