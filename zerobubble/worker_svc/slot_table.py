"""The slot table: which request holds which state slot and KV blocks, and which rows may run.

Every request the worker serves holds one state slot (a row of `DeviceState`) and a list of KV
blocks; prefix-shared blocks are held by several requests, so blocks are reference-counted.
Requests whose row or step failed are remembered until the scheduler re-admits or finishes them,
so rows for them in plans already sent get the error that ended them. Every row of a plan is
checked here before anything changes (`SlotTable.runnable`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions
from zerobubble.rows import DecodeColumnLists, PlanRow, read_plan
from zerobubble.worker_svc.grammar import RequestGrammar
from zerobubble.worker_svc.sampler import SlotSampling

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DeviceState:
    """Per-slot tensors that persist between steps (see docs/INTERNALS.md)."""

    seq_len: torch.Tensor  # [S] int32: tokens whose K/V are written
    last_token: torch.Tensor  # [S] int32: last sampled token
    drafts: torch.Tensor  # [S, K] int32
    num_drafts: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    history: torch.Tensor  # [num_blocks, block_size] int32: token pages following the KV blocks

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        max_blocks: int,
        num_spec_tokens: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> DeviceState:
        """Zeroed state for ``num_slots`` requests (no drafts anywhere)."""
        i32 = torch.int32
        return cls(
            seq_len=torch.zeros(num_slots, dtype=i32, device=device),
            last_token=torch.zeros(num_slots, dtype=i32, device=device),
            drafts=torch.full((num_slots, max(num_spec_tokens, 1)), -1, dtype=i32, device=device),
            num_drafts=torch.zeros(num_slots, dtype=i32, device=device),
            block_table=torch.zeros(num_slots, max_blocks, dtype=i32, device=device),
            history=torch.zeros(num_blocks, block_size, dtype=i32, device=device),
        )


@dataclass(slots=True)
class SlotInfo:
    """Host-side bookkeeping of one request's state slot (no device reads needed)."""

    slot: int
    block_ids: list[int]
    sampling: SamplingOptions
    has_sample: bool = False  # a token has been sampled: decode steps are allowed
    grammar: RequestGrammar | None = None  # structured output (`zerobubble.worker_svc.grammar`)
    predicted: bool = False  # the request has a predicted output (`proposers/prediction.py`)


@dataclass(slots=True)
class DecodeRows:
    """The leading decode rows of a plan that a step runs, with their slots; row i gains the
    next ``num_new_blocks[i]`` of ``new_block_ids``.

    They are checked and prepared as columns: at GPU batch sizes nearly every row of a step is
    one of them, and a Python object and a dozen checks per row were a third of the worker's
    step logic at 256 rows under cProfile.
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
class BlockTableWrites:
    """Block-table cells a step writes: ``block_table[slots[i], cols[i]] = block_ids[i]``."""

    slots: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SlotLimits:
    """What a row may ask of this worker."""

    num_blocks: int  # KV blocks in the pool
    max_num_seqs: int  # state slots
    max_blocks_per_seq: int  # block-table columns
    num_spec_tokens: int  # the most draft slots a decode row may carry
    vocab_size: int  # prefill token ids are checked against it (0: unknown, no check)


@dataclass(slots=True)
class RunnableRows:
    """A plan's rows split by `SlotTable.runnable`: the leading decode rows and the other rows
    that run, and per-request errors for the rows left out."""

    decodes: DecodeRows
    entries: list[PlanRow]
    errors: dict[str, str]


class SlotTable:
    """Admission, release and KV-block references of the requests a worker serves."""

    def __init__(self, limits: SlotLimits, state: DeviceState) -> None:
        self.limits = limits
        self.state = state
        self.slots: dict[str, SlotInfo] = {}
        self.by_index: dict[int, SlotInfo] = {}
        self.free_slots: list[int] = list(range(limits.max_num_seqs - 1, -1, -1))
        self.sampling = SlotSampling(limits.max_num_seqs)
        self.num_constrained = 0  # live requests with a grammar (none: a step pays nothing for it)
        # Requests holding each KV block (prefix-shared blocks are held by several).
        self.block_refs: dict[int, int] = {}
        # Requests whose row failed: their state is dropped, and entries for them in plans
        # already sent get a per-request error until the scheduler re-admits (is_new) or
        # finishes them. Without this, a decode row planned before the failure was known would
        # fail as "unknown to this worker" instead of with the error that ended its request.
        self.failed: dict[str, str] = {}

    def reset(self) -> None:
        """Forget every request."""
        for req_id in list(self.slots):
            self.release(req_id)
        self.failed.clear()

    def release(self, req_id: str) -> None:
        """Drop a request's state slot; unknown ids are ignored (finish may race a preempt)."""
        self.failed.pop(req_id, None)
        info = self.slots.pop(req_id, None)
        if info is None:
            return
        del self.by_index[info.slot]
        if info.grammar is not None:
            self.num_constrained -= 1
        # `fill_`, not `t[i] = 0`: on CUDA that assignment copies a host scalar, blocking.
        self.state.num_drafts[info.slot].fill_(0)
        self.free_slots.append(info.slot)
        refs = self.block_refs
        for block_id in info.block_ids:
            if refs[block_id] == 1:
                del refs[block_id]
            else:
                refs[block_id] -= 1

    def fail_requests(self, req_ids: Sequence[str], error: str) -> None:
        """Drop the state of requests whose step failed; later rows for them get `error`."""
        for req_id in req_ids:
            self.release(req_id)
            self.failed[req_id] = error

    def kv_usage(self) -> float:
        """KV blocks held by live requests (shared prefix blocks once) / all blocks.

        The service thread reads it after every step: a count kept as blocks come and go, not
        a set built over every block held (0.18 ms per step at 256 requests).
        """
        return len(self.block_refs) / self.limits.num_blocks

    def admit(self, entry: PlanRow) -> SlotInfo:
        """Give a new (or resumed) request a state slot; `runnable` checked that one is free."""
        self.release(entry.req_id)
        slot = self.free_slots.pop()
        # A new row without sampling parameters samples greedily, as the options' defaults do.
        sampling = entry.sampling if entry.sampling is not None else SamplingOptions()
        info = SlotInfo(slot=slot, block_ids=[], sampling=sampling)
        self.sampling.set(slot, sampling)
        self.slots[entry.req_id] = info
        self.by_index[slot] = info
        self.state.seq_len[slot].fill_(entry.num_cached_tokens)
        self.state.num_drafts[slot].fill_(0)
        return info

    def constrain(self, info: SlotInfo, grammar: RequestGrammar) -> None:
        """Attach a just-admitted request's grammar."""
        info.grammar = grammar
        self.num_constrained += 1

    def take_blocks(self, info: SlotInfo, new_blocks: Sequence[int], writes: BlockTableWrites) -> None:
        """Append a row's new KV blocks to its table (host side; the block-table cells to write
        go to ``writes``) and count the references."""
        start = len(info.block_ids)
        info.block_ids.extend(new_blocks)
        refs = self.block_refs
        for block_id in new_blocks:
            refs[block_id] = refs.get(block_id, 0) + 1
        writes.slots.extend([info.slot] * len(new_blocks))
        writes.cols.extend(range(start, start + len(new_blocks)))
        writes.block_ids.extend(new_blocks)

    # -- which rows may run ----------------------------------------------------------------------

    def runnable(self, plan: worker_pb2.StepPlan, rejected: Mapping[str, str] | None = None) -> RunnableRows:
        """Split a plan's rows into the ones to run (the leading decode rows, then the others)
        and per-request errors for the rest; ``rejected`` rows fail with the given error.

        The leading decode rows are checked in bulk, as columns; only when that finds a row
        that cannot run (or rows are rejected from outside) are they checked one by one by
        `row_error`, in plan order, as the later rows always are, so each bad row gets its own
        error. A failed row drops the request's state (`fail_requests`), so its later rows fail
        too until the scheduler re-admits or finishes it; the other rows are untouched.

        Raises:
            ValueError: the plan's columns do not line up (`read_plan`).
        """
        cols = read_plan(plan)
        leading = cols.leading_decodes()
        decodes = self._decodes_if_all_run(leading) if rejected is None else None
        if decodes is None:
            decodes, rows, num_leading = DecodeRows(), cols.rows(), len(leading.req_ids)
            seen: set[str] = set()
        else:
            rows, num_leading = cols.rows(len(leading.req_ids)), 0
            seen = set(decodes.req_ids)
        out = RunnableRows(decodes, [], {})
        num_free = len(self.free_slots)
        for i, entry in enumerate(rows):
            error = self.row_error(entry, seen, num_free, rejected or {})
            seen.add(entry.req_id)
            if error is not None:
                logger.warning("step %d: %s", plan.step_id, error)
                out.errors[entry.req_id] = error
                continue
            if entry.is_new:
                # Re-admitting a live request (a folded finish notice) frees its slot first.
                num_free += (entry.req_id in self.slots) - 1
            if i < num_leading:
                decodes.add(entry, self.slots[entry.req_id])
            else:
                out.entries.append(entry)
        if out.errors:
            good = {*decodes.req_ids, *(e.req_id for e in out.entries)}
            bad = [r for r in out.errors if r not in good]
            self.fail_requests(bad, "its row was rejected")
            for req_id in bad:
                self.failed[req_id] = out.errors[req_id]
        return out

    def row_error(self, entry: PlanRow, seen: set[str], num_free_slots: int, rejected: Mapping[str, str]) -> str | None:
        """Why a row cannot run (None: it can), checked before anything is
        changed, so a bad row is left out whole instead of half admitted."""
        # Every row of a step checked one by one passes here: each field is read once.
        req_id = entry.req_id
        is_new = entry.is_new
        if req_id in seen:
            return f"request {req_id}: scheduled twice in one plan"
        if not is_new and req_id in self.failed:
            return f"request {req_id}: an earlier step failed for it: {self.failed[req_id]}"
        if req_id in rejected:
            return rejected[req_id]
        info = None if is_new else self.slots.get(req_id)
        if not is_new and info is None:
            return f"request {req_id}: unknown to this worker and not is_new"
        if is_new and num_free_slots < 1:
            return f"request {req_id}: no free state slot (max_num_seqs={self.limits.max_num_seqs})"
        error = self._blocks_error(req_id, entry.new_block_ids, info)
        if error is not None:
            return error
        limits = self.limits
        chunk = entry.token_ids
        if not chunk:
            if is_new:
                return f"request {req_id}: a new request must start with a prefill chunk"
            assert info is not None  # not new: checked above
            if not info.has_sample:
                return f"request {req_id}: decode step before any sample"
            if not 0 <= entry.num_draft_slots <= limits.num_spec_tokens:
                return (
                    f"request {req_id}: {entry.num_draft_slots} draft slots, "
                    f"worker proposes at most {limits.num_spec_tokens}"
                )
        elif limits.vocab_size and (min(chunk) < 0 or max(chunk) >= limits.vocab_size):
            return f"request {req_id}: token id outside the vocabulary [0, {limits.vocab_size})"
        return None

    def _blocks_error(self, req_id: str, new: Sequence[int], info: SlotInfo | None) -> str | None:
        """Why a row's new KV blocks cannot be taken (None: they can)."""
        if not new:
            return None
        limits = self.limits
        if min(new) < 0 or max(new) >= limits.num_blocks:
            return f"request {req_id}: block id out of range [0, {limits.num_blocks})"
        num_blocks = len(new) + (len(info.block_ids) if info is not None else 0)
        if num_blocks > limits.max_blocks_per_seq:
            return (
                f"request {req_id}: block table would hold {num_blocks} blocks, more than "
                f"max_model_len allows ({limits.max_blocks_per_seq})"
            )
        return None

    def _decodes_if_all_run(self, cols: DecodeColumnLists) -> DecodeRows | None:
        """The leading decode rows if `row_error` would find nothing for any of them (the same
        rules, checked over whole columns); None if any row breaks one."""
        req_ids = cols.req_ids
        if not req_ids:
            return DecodeRows()
        ids = set(req_ids)
        if len(ids) != len(req_ids) or not ids <= self.slots.keys() or not ids.isdisjoint(self.failed):
            return None
        infos = [self.slots[req_id] for req_id in req_ids]
        drafts = cols.num_draft_slots
        limits = self.limits
        if not all(info.has_sample for info in infos) or min(drafts) < 0 or max(drafts) > limits.num_spec_tokens:
            return None
        block_ids = cols.new_block_ids
        if block_ids:
            if min(block_ids) < 0 or max(block_ids) >= limits.num_blocks:
                return None
            limit = limits.max_blocks_per_seq
            if any(n and len(info.block_ids) + n > limit for info, n in zip(infos, cols.num_new_blocks)):
                return None
        return DecodeRows(req_ids, infos, drafts, cols.num_new_blocks, block_ids)
