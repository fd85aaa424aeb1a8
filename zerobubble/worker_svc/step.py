"""One step of the worker, plan in to result out, in five named stages (`execute`).

    inputs = prepare(parts, plan, start)        # notices, row checks, admissions -> StepInputs
    logits = run_model(parts, inputs)           # the forward on the device -> Logits
    sampled = sample(parts, inputs, logits)     # sampling and verification -> Sampled
    drafts = advance(parts, inputs, sampled)    # sequence lengths corrected on the device
    result = copy_results(parts, inputs, logits, sampled)  # the copy to the host started

Every stage runs on the step thread and only launches device work; the host reads the step's
outputs once, when the copier thread waits for the copy (`PendingResult.materialize`). The
drafts for the step after (`propose`) are made once the result has been handed on, so the copy
waits for this step's sampling only and the scheduler hears the step while a draft model's k
forwards run. What runs the model and draws the tokens is a `StepDevice`: the model op by op
or through CUDA graphs (`zerobubble.worker_svc.devices`), or a simulated accelerator
(`zerobubble.worker_svc.simulated`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zerobubble.api import worker_pb2
from zerobubble.kernels.seq_lens import update_state
from zerobubble.rows import PlanRow, continuation_rows
from zerobubble.worker_svc.batch import BatchBuilder, StepBatch
from zerobubble.worker_svc.finish_notices import FinishNotices
from zerobubble.worker_svc.grammar import GrammarCompiler, GrammarInputs, StepMasks, copy_inputs, fill_masks
from zerobubble.worker_svc.model import StepInterrupted
from zerobubble.worker_svc.proposers import Proposer
from zerobubble.worker_svc.proposers.prediction import PredictionDrafts
from zerobubble.worker_svc.result_copy import Copy, PendingResult, ResultCopier, ResultRows, StepTiming
from zerobubble.worker_svc.slot_table import DeviceState, RunnableRows, SlotTable
from zerobubble.worker_svc.staging import to_device
from zerobubble.worker_svc.verification import StepOutputs, fed_drafts

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A plan's runnable rows, admitted and uploaded: what the device runs."""

    batch: StepBatch
    grammar: GrammarInputs | None  # constrained rows' drafts, on their way to the host
    errors: Mapping[str, str]  # rows left out: req_id -> why
    start: float  # the step thread's clock when the step began


@dataclass(frozen=True, slots=True)
class Logits:
    """The forward's output: the logits of the sampled slots."""

    values: torch.Tensor | None  # [G, vocab]; None when no row samples or the device draws without
    begin: Any = None  # the device's timing event at the forward's start (CUDA)


@dataclass(frozen=True, slots=True)
class Sampled:
    """The sampled rows' tokens and verification, still on the device."""

    outputs: StepOutputs | None  # None when no row sampled
    errors: Mapping[str, str]  # constrained rows whose grammar failed: req_id -> why
    grammar_s: float = 0.0  # host time spent filling grammar masks


@dataclass(frozen=True, slots=True)
class DraftsDue:
    """The rows of a step whose next drafts are still to be made (`propose`)."""

    slots: torch.Tensor  # [S] int32 state slots of the rows that sampled
    batch: StepBatch


class StepDevice(Protocol):
    """What runs a step's model and draws its tokens (eager, CUDA graphs, or simulated)."""

    def run_model(self, batch: StepBatch) -> Logits:
        """The forward over the flat batch (writes K/V; the proposer observes it) and the
        logits of the sampled slots."""
        ...

    def sample(
        self, batch: StepBatch, logits: Logits, masks: StepMasks | None, prediction_drafts: torch.Tensor | None
    ) -> StepOutputs:
        """The sampled rows' tokens, their drafts verified (see `verification.sample_and_verify`)."""
        ...

    def timing(self, start: float, logits: Logits, grammar_s: float, live: bool) -> StepTiming:
        """The step's times once its work is launched (``live``: requests remain after it)."""
        ...

    def interrupted(self) -> None:
        """A step was cut short: the next step's gap does not count from it."""
        ...

    def reset(self) -> None:
        """The runner forgot every request (a new scheduler stream)."""
        ...


@dataclass(slots=True)
class StepParts:
    """What a step runs through; the runner builds it once (`ModelRunner`)."""

    table: SlotTable
    builder: BatchBuilder
    device: StepDevice
    copier: ResultCopier
    notices: FinishNotices
    state: DeviceState
    proposer: Proposer | None
    predictions: PredictionDrafts | None
    grammars: GrammarCompiler | None
    # The slot table's row check (`SlotTable.runnable`; with a test's faults, `faults.checked_rows`).
    check_rows: Callable[[worker_pb2.StepPlan], RunnableRows]
    block_size: int


def execute(parts: StepParts, plan: worker_pb2.StepPlan, start: float) -> tuple[PendingResult, DraftsDue | None]:
    """Run one plan: its result (outputs possibly still on the device) and the drafts still to
    make after it. Rows that cannot run are left out with a per-request error; a step a later
    plan made moot is cut short, before the forward or between layers."""
    inputs = prepare(parts, plan, start)
    if isinstance(inputs, PendingResult):
        return inputs, None  # nothing runs
    batch = inputs.batch
    with parts.notices.running(batch.step_id, batch.req_ids):
        try:
            logits = run_model(parts, inputs)
            sampled = sample(parts, inputs, logits)
        except StepInterrupted:
            return cut_short(parts, inputs), None
        drafts = advance(parts, inputs, sampled)
        return copy_results(parts, inputs, logits, sampled), drafts


# -- 1. prepare ---------------------------------------------------------------------------------


def prepare(parts: StepParts, plan: worker_pb2.StepPlan, start: float) -> StepInputs | PendingResult:
    """Apply the plan's finish notices, check its rows (`SlotTable.runnable`), admit the ones
    that can run and build the step's device inputs (`BatchBuilder.prepare`); the empty result
    when nothing runs."""
    for req_id in plan.finished_req_ids:
        parts.table.release(req_id)
    rows = parts.check_rows(plan)
    entries, errors = _refuse_bad_grammars(parts, rows)
    parts.notices.forget_before(plan.step_id)
    if plan.continuations.req_ids:
        _take_continuations(parts, plan)
    batch = parts.builder.prepare(plan.step_id, rows.decodes, entries)
    if batch is None:
        return PendingResult.empty(plan.step_id, errors=errors)
    return StepInputs(batch, _grammar_inputs(parts, batch), errors, start)


def _take_continuations(parts: StepParts, plan: worker_pb2.StepPlan) -> None:
    """Suffix decoding: the plan's new continuations into their slots' prediction buffers,
    and those rows' drafts made again from them before the step's inputs are built (a
    request no longer held here, failed or finished, is skipped)."""
    predictions = parts.predictions
    if predictions is None or not predictions.dynamic:
        return
    held = [(parts.table.slots.get(c.req_id), c) for c in continuation_rows(plan)]
    taken = [(info.slot, c) for info, c in held if info is not None and info.has_sample]
    if taken:
        slots, rows = zip(*taken)
        predictions.replace(slots, [c.token_ids for c in rows], [c.anchor for c in rows], parts.state, parts.block_size)


def _refuse_bad_grammars(parts: StepParts, rows: RunnableRows) -> tuple[list[PlanRow], dict[str, str]]:
    """The rows after the leading decodes that run, and every row's error: new rows whose
    grammar does not compile here are left out (the scheduler checked it; this keeps a bad one
    from failing the step)."""
    errors = dict(rows.errors)
    if parts.grammars is None:
        return rows.entries, errors
    kept = []
    for entry in rows.entries:
        grammar = entry.sampling.grammar if entry.is_new and entry.sampling is not None else ""
        error = parts.grammars.error(grammar) if grammar else None
        if error is None:
            kept.append(entry)
        else:
            errors[entry.req_id] = error
            parts.table.fail_requests([entry.req_id], error)
    return kept, errors


def _grammar_inputs(parts: StepParts, batch: StepBatch) -> GrammarInputs | None:
    """The constrained sampled rows' fed drafts, copied to the host now, before the forward is
    launched: their masks are filled while it runs. None without a constrained row."""
    if batch.sampled is None or not parts.table.num_constrained:
        return None
    constrained = [(i, grammar) for i, row in enumerate(batch.sampled.rows) if (grammar := batch.rows[row].grammar)]
    if not constrained:
        return None
    drafts, num_real = fed_drafts(batch, parts.state)
    rows, grammars = map(list, zip(*constrained))
    return copy_inputs(rows, grammars, drafts, num_real)


# -- 2. run the model ---------------------------------------------------------------------------


def run_model(parts: StepParts, inputs: StepInputs) -> Logits:
    """The forward (writes K/V) and the logits of the sampled slots; a step all of whose rows a
    later plan finished is cut here (and between layers: `CausalLM.interrupt`)."""
    if parts.notices.moot():
        raise StepInterrupted
    return parts.device.run_model(inputs.batch)


def cut_short(parts: StepParts, inputs: StepInputs) -> PendingResult:
    """The result of a step cut short: nothing of it is used (no state advances, no tokens,
    no drafts); its rows left out still get their errors."""
    parts.device.interrupted()
    parts.notices.num_cut_steps += 1
    logger.debug("step %d cut short: a later plan finished all its rows", inputs.batch.step_id)
    return PendingResult.empty(inputs.batch.step_id, time.perf_counter() - inputs.start, inputs.errors)


# -- 3. sample and verify -----------------------------------------------------------------------


def sample(parts: StepParts, inputs: StepInputs, logits: Logits) -> Sampled:
    """Sample every real slot of the sampled rows and verify their drafts, under the grammar
    masks of constrained rows and with the drafts of rows fed their predictions."""
    batch = inputs.batch
    s = batch.sampled
    if s is None:
        return Sampled(None, {})
    masks, grammar_s = _masks(parts, inputs, logits)
    predictions = parts.predictions
    drafted = predictions.drafted(s.slots) if predictions is not None and s.predicted else None
    outputs = parts.device.sample(batch, logits, masks, drafted)
    # A row's grammar error replaces its tokens in the result: the request ends with it.
    errors = {batch.req_ids[s.rows[row]]: error for row, error in masks.errors.items()} if masks is not None else {}
    return Sampled(outputs, errors, grammar_s)


def _masks(parts: StepParts, inputs: StepInputs, logits: Logits) -> tuple[StepMasks | None, float]:
    """The constrained rows' masks and the host time filling them took (None, 0 without any)."""
    s = inputs.batch.sampled
    if inputs.grammar is None or logits.values is None or s is None:
        return None, 0.0
    begin = time.perf_counter()
    history = parts.state.history

    def read(row: int, start: int, end: int) -> list[int]:
        # A resumed constrained request replays its earlier outputs into its grammar (rare).
        info = inputs.batch.rows[s.rows[row]]
        pages = history.index_select(0, to_device(info.block_ids, torch.long, history.device))
        return pages.reshape(-1)[start:end].tolist()

    vocab_size = logits.values.shape[1]
    masks = fill_masks(
        inputs.grammar, s.layout.num_cols_host, s.layout.base_host, vocab_size, read, parts.builder.device
    )
    return masks, time.perf_counter() - begin


# -- 4. advance ---------------------------------------------------------------------------------


def advance(parts: StepParts, inputs: StepInputs, sampled: Sampled) -> DraftsDue | None:
    """Sequence-length correction on the device (the true accepted counts, not the plan's) and
    the rows whose next drafts are due."""
    batch = inputs.batch
    out, s = sampled.outputs, batch.sampled
    st = parts.state
    num_rows = len(batch.rows)
    acc_all = torch.zeros(num_rows, dtype=torch.int32, device=batch.req_slots.device)
    last_all = torch.zeros(num_rows, dtype=torch.int32, device=batch.req_slots.device)
    if out is not None and s is not None:
        acc_all[s.rows_t] = out.num_accepted.to(torch.int32)
        last_all[s.rows_t] = out.tokens.gather(1, out.num_accepted.long()[:, None])[:, 0].to(torch.int32)
    rows = batch.updates
    update_state(
        batch.req_slots,
        rows.is_decode,
        rows.num_scheduled,
        acc_all,
        rows.do_sample,
        last_all,
        st.seq_len,
        st.last_token,
        st.num_drafts,
    )
    if out is None or s is None:
        return None
    for i in s.rows:
        batch.rows[i].has_sample = True
    for req_id, error in sampled.errors.items():
        parts.table.fail_requests([req_id], error)
    # A plan that gave no decode row a draft slot fed no drafts, so the carried state a
    # proposer keeps (an EAGLE head's hidden state) is already that of the last accepted
    # position; skipping the chain leaves these rows' draft counts at the zero `update_state`
    # wrote, and the next step verifies no drafts for them.
    if (parts.proposer is not None and batch.drafts_planned) or s.predicted:
        return DraftsDue(s.slots, batch)
    return None


# -- 5. copy the results ------------------------------------------------------------------------


def copy_results(parts: StepParts, inputs: StepInputs, logits: Logits, sampled: Sampled) -> PendingResult:
    """Start the device-to-host copy of the step's outputs and build its result."""
    batch = inputs.batch
    timing = parts.device.timing(inputs.start, logits, sampled.grammar_s, bool(parts.table.slots))
    copy = parts.copier.start(sampled.outputs) if sampled.outputs is not None else Copy(None)
    s = batch.sampled
    sampled_rows, num_top = (s.rows, s.num_top) if s is not None and sampled.outputs is not None else ([], [])
    result = PendingResult(
        step_id=batch.step_id,
        num_tokens=batch.num_tokens,
        rows=ResultRows(batch.req_ids, sampled_rows, batch.want_logprobs, num_top),
        outputs=copy.outputs,
        timing=timing,
        ready=copy.ready,
        errors={**inputs.errors, **sampled.errors},
    )
    if inputs.grammar is not None and sampled.outputs is not None:
        for row, grammar in zip(inputs.grammar.rows, inputs.grammar.grammars):
            grammar.pending = (result, row)  # consumed when the request next samples
    return result


# -- after the step: the next drafts --------------------------------------------------------------


def propose(parts: StepParts, due: DraftsDue) -> None:
    """Make the drafts of the rows a step sampled: the proposer's, then those of rows with a
    predicted output, which win where the prediction is aligned."""
    slots, batch = due.slots, due.batch
    # Drafts for requests a later plan has finished are never used: a draft model's chain
    # stops between layers then (its forward asks `FinishNotices.moot`, as the target's does).
    # With the result already out, the finish notice for a request's last step arrives while
    # its chain runs, and the next request's prefill no longer waits for that chain.
    with parts.notices.running(batch.step_id, batch.req_ids):
        try:
            if parts.proposer is not None and batch.drafts_planned:
                parts.proposer.propose(slots, batch)
            predicted = batch.sampled.predicted if batch.sampled is not None else []
            if predicted and parts.predictions is not None:
                if len(predicted) < len(slots):
                    slots = slots[to_device(predicted, torch.long, slots.device)]
                parts.predictions.propose(slots, parts.state, parts.block_size)
        except StepInterrupted:
            parts.notices.num_cut_drafts += 1
            logger.debug("drafts after step %d cut short: a later plan finished all its rows", batch.step_id)
