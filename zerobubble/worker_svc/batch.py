"""The batch builder: a plan's runnable rows as one step's device inputs (`StepBatch`).

Input ids of decode rows come from the device state (the last sampled token and the drafts
proposed after it), positions and the slot mapping from the worker's own sequence lengths, so a
step planned before the previous step's result was known still runs on the right positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.kernels.inputs import assemble_inputs
from zerobubble.request_options import has_penalty
from zerobubble.rows import PlanRow
from zerobubble.worker_svc import staging
from zerobubble.worker_svc.grammar import GrammarCompiler
from zerobubble.worker_svc.proposers import Proposer
from zerobubble.worker_svc.proposers.prediction import PredictionDrafts
from zerobubble.worker_svc.sampler import LogitBias, Penalties, SamplingTensors, context_token_counts
from zerobubble.worker_svc.slot_table import BlockTableWrites, DecodeRows, DeviceState, SlotInfo, SlotTable


def to_device(values: staging.HostValues, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    # Pinned staging and an async copy: a pageable copy would wait for the previous step.
    return staging.to_device(values, dtype, device)


@dataclass(frozen=True, slots=True)
class LogitLayout:
    """Where the sampled rows' logits come from, and how per-slot values spread to rows.

    Logits are computed only for real slots: every fed slot of a decode row, the last token of a
    sampling prefill chunk. Per-slot values are spread to ``[num_rows, width]``, ``width`` the
    step's widest row (1 + its draft slots), by ``pad``, which repeats a narrower row's last slot.
    """

    gather: torch.Tensor  # [G] int64 flat token index of every real slot
    pad: torch.Tensor | None  # [S*width] int64 index into the G slots; None: G == S*width
    num_cols: torch.Tensor  # [S] int32 real slots per row
    row_start: torch.Tensor  # [S] int64 flat index of each row's first slot
    logprob_index: torch.Tensor | None  # [G] int64: ``[S, width]`` tokens -> real slots (padded, logprobs wanted)
    # Host copies: real slots per row and where each row starts among the gathered slots.
    num_cols_host: np.ndarray
    base_host: np.ndarray
    # The widest sampled row's slots (1 + draft slots): per-row outputs are [S, width]. Sized by
    # the step, not by K, so a worker that could verify long prediction drafts pays for them
    # only in steps that carry them.
    width: int = 1

    def spread(self, t: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Per-slot values ``[G, ...]`` -> ``[num_rows, width, ...]``."""
        return (t[self.pad] if self.pad is not None else t).view(num_rows, self.width, *t.shape[1:])


@dataclass(frozen=True, slots=True)
class SampledRows:
    """The rows of a step that sample (or verify) tokens, and their sampling controls."""

    rows: list[int]  # indices into the step's rows
    rows_t: torch.Tensor  # [S] int64, the same on the device
    slots: torch.Tensor  # [S] int32 state slots
    layout: LogitLayout
    positions: torch.Tensor  # [G] int64 absolute position of each sampled token
    sampling: SamplingTensors  # one row per real slot
    want_logprobs: bool
    num_top: list[int] = field(default_factory=list)  # top-N logprobs per row; empty: none wants any
    # Positions among ``rows`` of the rows with a predicted output (read once per step by the
    # runner: which rows' drafts to report and to make from their predictions).
    predicted: list[int] = field(default_factory=list)

    def spread(self, t: torch.Tensor) -> torch.Tensor:
        """Per-slot values ``[G, ...]`` -> ``[S, width, ...]``."""
        return self.layout.spread(t, len(self.rows))


@dataclass(frozen=True, slots=True)
class RowUpdates:
    """Per-row device tensors the sequence-length correction reads after the step."""

    is_decode: torch.Tensor  # [R] bool
    num_scheduled: torch.Tensor  # [R] int32 tokens fed per row
    do_sample: torch.Tensor  # [R] bool


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One plan as device inputs: built by `BatchBuilder.prepare`, read by the model, the
    sampler and the proposer."""

    step_id: int
    req_ids: list[str]
    rows: list[SlotInfo]
    num_tokens: int
    req_slots: torch.Tensor  # [R] int32 state slot of each row
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    updates: RowUpdates
    want_logprobs: list[bool]  # per row
    sampled: SampledRows | None  # None when no row samples
    row_widths: list[int] = field(default_factory=list)  # host copy of num_scheduled
    all_decode: bool = False  # every row is a decode (a CUDA graph may replay it)
    # False when the plan gave its decode rows no draft slot (`plans_drafts`): the step fed no
    # drafts, and the runner makes none after it.
    drafts_planned: bool = True


def plans_drafts(decodes: DecodeRows, entries: list[PlanRow]) -> bool:
    """Whether a step's plan gives a draft slot to some decode row, or has no decode row at
    all (a step of prefill chunks says nothing about the decodes that follow it).

    Decodes without a draft slot mean the scheduler stopped drafting (`--spec-disable-batch-size`)
    or every row is at its last tokens: drafts made after such a step would rarely be verified.
    """
    draft_slots = decodes.num_draft_slots + [e.num_draft_slots for e in entries if not e.token_ids]
    return not draft_slots or any(draft_slots)


@dataclass(slots=True)
class HostRows:
    """A step's rows on the host, once admitted: what `BatchBuilder` uploads."""

    rows: list[SlotInfo]
    req_ids: list[str]
    num_scheduled: list[int]  # tokens fed per row
    prefill_ids: list[int]  # the fed tokens; 0 for the slots a decode row reads from the state
    is_decode: list[bool]
    do_sample: list[bool]
    writes: BlockTableWrites

    def query_start_loc(self) -> list[int]:
        """Flat index of each row's first token, and the step's token count last."""
        qsl = [0]
        for n in self.num_scheduled:
            qsl.append(qsl[-1] + n)
        return qsl


class BatchBuilder:
    """Admits a plan's runnable rows to the slot table and builds the step's device inputs."""

    def __init__(
        self,
        table: SlotTable,
        state: DeviceState,
        device: torch.device,
        block_size: int,
        proposer: Proposer | None,
        trim_empty_drafts: bool,
        grammars: GrammarCompiler | None = None,
        predictions: PredictionDrafts | None = None,
    ) -> None:
        """``grammars``: builds the matchers of constrained requests (None: the worker has no
        tokenizer to constrain with, a simulated device); ``predictions``: where new rows'
        predicted outputs go (None: the runner drafts from none)."""
        self.table = table
        self.grammars = grammars
        self.state = state
        self.device = device
        self.block_size = block_size
        self.proposer = proposer
        self.predictions = predictions
        # Draft slots without a real draft can only be rejected; on the CPU the draft counts are
        # already host memory, so those are trimmed. (On an accelerator reading them would stall
        # the host behind the device, so the plan's shape is kept.)
        self.trim_empty_drafts = trim_empty_drafts

    def prepare(self, step_id: int, decodes: DecodeRows, entries: list[PlanRow]) -> StepBatch | None:
        """Admit the rows to run (the leading decode rows ``decodes``, then ``entries``) and
        build the step's device inputs: input ids (decode rows from the device state),
        positions, slot mapping, attention metadata and sampling tensors. None when the step
        runs nothing.

        Every row must be one `SlotTable.runnable` accepted, so nothing here can fail half way
        through the admissions.
        """
        if not decodes.req_ids and not entries:
            return None
        host = self._admit_rows(decodes, entries)
        self._write_block_tables(host.writes)
        dev = self.device
        qsl_host = host.query_start_loc()
        req_slots = to_device([r.slot for r in host.rows], dev)
        qsl = to_device(qsl_host, dev)
        updates = RowUpdates(
            is_decode=to_device(host.is_decode, dev, torch.bool),
            num_scheduled=to_device(host.num_scheduled, dev),
            do_sample=to_device(host.do_sample, dev, torch.bool),
        )
        input_ids, positions, meta = self._model_inputs(host, req_slots, qsl, updates)
        want_logprobs = [bool(r.sampling.logprobs) for r in host.rows]
        return StepBatch(
            step_id=step_id,
            req_ids=host.req_ids,
            rows=host.rows,
            num_tokens=qsl_host[-1],
            req_slots=req_slots,
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            updates=updates,
            want_logprobs=want_logprobs,
            sampled=self._sampled_rows(host, req_slots, positions, want_logprobs),
            row_widths=host.num_scheduled,
            all_decode=all(host.is_decode),
            drafts_planned=plans_drafts(decodes, entries),
        )

    def _model_inputs(
        self, host: HostRows, req_slots: torch.Tensor, qsl: torch.Tensor, updates: RowUpdates
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids (decode rows from the device state; writes the history pages), positions
        and attention metadata of the admitted rows."""
        st = self.state
        input_ids, positions, slot_mapping = assemble_inputs(
            req_slots,
            qsl,
            updates.is_decode,
            to_device(host.prefill_ids, self.device),
            st.seq_len,
            st.last_token,
            st.drafts,
            st.num_drafts,
            st.block_table,
            st.history,
            self.block_size,
        )
        max_blocks = max(len(r.block_ids) for r in host.rows)
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=st.seq_len[req_slots.long()] + updates.num_scheduled,
            block_tables=st.block_table[req_slots.long(), :max_blocks],
            max_query_len=max(host.num_scheduled),
            max_seq_len=max_blocks * self.block_size,
            slot_mapping=slot_mapping,
        )
        return input_ids, positions, meta

    def _admit_rows(self, decodes: DecodeRows, entries: list[PlanRow]) -> HostRows:
        """Admissions and new KV blocks of the rows to run, and what each row feeds."""
        table = self.table
        writes = BlockTableWrites()
        # The leading decode rows, a column at a time.
        rows: list[SlotInfo] = list(decodes.infos)
        start = 0
        for info, n in zip(rows, decodes.num_new_blocks):
            if n:
                table.take_blocks(info, decodes.new_block_ids[start : start + n], writes)
                start += n
        num_scheduled = self._decode_widths([info.slot for info in rows], decodes.num_draft_slots)
        host = HostRows(
            rows=rows,
            req_ids=list(decodes.req_ids),
            num_scheduled=num_scheduled,
            prefill_ids=[0] * sum(num_scheduled),
            is_decode=[True] * len(rows),
            do_sample=[True] * len(rows),
            writes=writes,
        )
        # The other rows (prefill chunks, new requests, decodes after a chunk), one by one.
        for entry in entries:
            if entry.is_new:
                info = table.admit(entry)
                if self.proposer is not None:
                    self.proposer.admit(info.slot, entry.num_cached_tokens)
                if self.predictions is not None:
                    predicted = entry.sampling.prediction_token_ids if entry.sampling is not None else ()
                    num_prompt = entry.sampling.num_prompt_tokens if entry.sampling is not None else 0
                    self.predictions.admit(info.slot, predicted, num_prompt)
                    info.predicted = len(predicted) > 0 or self.predictions.dynamic
                if self.grammars is not None and entry.sampling is not None and entry.sampling.grammar:
                    table.constrain(info, self.grammars.start(entry.sampling, entry.num_cached_tokens))
            else:
                info = table.slots[entry.req_id]
            if entry.new_block_ids:
                table.take_blocks(info, entry.new_block_ids, writes)
            chunk = entry.token_ids
            if info.grammar is not None:
                info.grammar.num_seen += len(chunk)
            decode = len(chunk) == 0
            if decode:
                n = self._decode_widths([info.slot], [entry.num_draft_slots])[0]
                host.prefill_ids.extend([0] * n)
            else:
                n = len(chunk)
                host.prefill_ids.extend(chunk)
            host.rows.append(info)
            host.req_ids.append(entry.req_id)
            host.num_scheduled.append(n)
            host.is_decode.append(decode)
            host.do_sample.append(decode or entry.sample)
        return host

    def _decode_widths(self, slots: list[int], num_draft_slots: list[int]) -> list[int]:
        """The slots each decode row computes: its sampled token plus its draft slots (those
        without a real draft trimmed, see ``trim_empty_drafts``)."""
        if not self.trim_empty_drafts or not slots:
            return [1 + d for d in num_draft_slots]
        have = self.state.num_drafts[slots].tolist()
        return [1 + min(d, h) for d, h in zip(num_draft_slots, have)]

    def _write_block_tables(self, writes: BlockTableWrites) -> None:
        """All of a step's block-table cells in one indexed write: one upload per step instead
        of a tensor (and, on an accelerator, a pinned copy) per row that gained blocks. No
        (slot, column) repeats within a step (a request appears once per plan), so the write
        order does not matter."""
        if not writes.slots:
            return
        dev = self.device
        self.state.block_table[to_device(writes.slots, dev, torch.long), to_device(writes.cols, dev, torch.long)] = (
            to_device(writes.block_ids, dev)
        )

    def _sampled_rows(
        self, host: HostRows, req_slots: torch.Tensor, positions: torch.Tensor, want_logprobs: list[bool]
    ) -> SampledRows | None:
        """Index and sampling tensors of the rows that sample this step (see `SampledRows`);
        None when none does.

        Built with a constant number of array operations, not a Python loop over rows: at GPU
        batch sizes this runs once per step for hundreds of rows.
        """
        sampled_rows = [i for i, do in enumerate(host.do_sample) if do]
        if not sampled_rows:
            return None
        dev = self.device
        sel = np.asarray(sampled_rows, np.int64)
        is_decode = np.asarray(host.is_decode, np.bool_)
        qsl_host = np.asarray(host.query_start_loc(), np.int64)
        # Real slots per sampled row: every fed slot of a decode, the last token of a prefill.
        n = np.where(is_decode[sel], np.asarray(host.num_scheduled, np.int64)[sel], 1)
        width = int(n.max())
        firsts = qsl_host[sel + 1] - n  # flat index of each row's first logit
        base = np.cumsum(n) - n  # where each row starts among the gathered slots
        total = int(n.sum())
        within = np.arange(total) - np.repeat(base, n)  # column of each gathered slot
        # (sampled row, column) -> gathered slot; a trimmed row repeats its last real slot.
        pad_index = (base[:, None] + np.minimum(np.arange(width)[None, :], n[:, None] - 1)).reshape(-1)
        gather = to_device(np.repeat(firsts, n) + within, dev, torch.long)
        padded = total < len(pad_index)
        any_logprobs = any(want_logprobs[i] for i in sampled_rows)
        # Absolute position of each sampled token = input position + 1 (keys the randomness).
        sample_pos = positions[gather] + 1
        slots = np.asarray([r.slot for r in host.rows], np.int64)[sel]
        rows_t = to_device(sel, dev, torch.long)
        row_top = self.table.sampling.top_logprobs[slots]
        return SampledRows(
            rows=sampled_rows,
            rows_t=rows_t,
            # Indexing with the Python list would copy it to the device from pageable memory.
            slots=req_slots[rows_t],
            layout=LogitLayout(
                gather=gather,
                pad=to_device(pad_index, dev, torch.long) if padded else None,
                num_cols=to_device(n, dev),
                row_start=to_device(firsts, dev, torch.long),
                # Back from [S, K+1] to one entry per real slot, in gather order.
                logprob_index=to_device(np.repeat(np.arange(len(sel)) * width, n) + within, dev, torch.long)
                if padded and any_logprobs
                else None,
                num_cols_host=n,
                base_host=base,
                width=width,
            ),
            positions=sample_pos,
            sampling=self.sampling_tensors(slots, n, sample_pos),
            want_logprobs=any_logprobs,
            num_top=row_top.tolist() if row_top.max() > 0 else [],
            predicted=[j for j, i in enumerate(sampled_rows) if host.rows[i].predicted]
            if self.predictions is not None
            else [],
        )

    def sampling_tensors(self, slots: np.ndarray, valid_cols: np.ndarray, sample_pos: torch.Tensor) -> SamplingTensors:
        """Per-logits-row sampling tensors; ``valid_cols[i]`` rows belong to state slot ``slots[i]``.

        The common controls are gathered from `SlotSampling` (host arrays written on
        admission). Penalty counts are taken over each logits row's own context read from the
        token history (``sample_pos`` = its context length, on the device), so the row of draft
        j in a verification sees drafts 0..j-1 of the same row and nothing that was rejected
        before. The draft-model proposer builds its chain's tensors here too (the same controls).
        """
        ss = self.table.sampling
        per_row = np.repeat(slots, valid_cols)
        penalties = bias = None
        if ss.special[slots].any():
            infos = [self.table.by_index[slot] for slot in per_row.tolist()]
            penalties = self._penalties(infos, per_row.tolist(), sample_pos)
            bias = self._logit_bias(infos)
        return ss.tensors(per_row, sample_pos, self.device, penalties, bias)

    def _penalties(self, infos: list[SlotInfo], row_slots: list[int], sample_pos: torch.Tensor) -> Penalties | None:
        """The penalty tensors of the logits rows whose request uses penalties (``infos[g]``
        and ``row_slots[g]``: the request and state slot of logits row g)."""
        pen_rows = [g for g, info in enumerate(infos) if has_penalty(info.sampling)]
        if not pen_rows:
            return None
        dev = self.device
        pens = [infos[g].sampling for g in pen_rows]
        num_blocks = max(len(infos[g].block_ids) for g in pen_rows)
        rep = [p.repetition_penalty if p.repetition_penalty > 0 else 1.0 for p in pens]
        rows_t = to_device(pen_rows, dev, torch.long)
        counts, seen = context_token_counts(
            self.state.history,
            self.state.block_table[to_device([row_slots[g] for g in pen_rows], dev, torch.long), :num_blocks],
            sample_pos[rows_t],
            to_device([p.num_prompt_tokens for p in pens], dev),
            self.table.limits.vocab_size,
            need_counts=any(p.frequency_penalty or p.presence_penalty for p in pens),
            need_seen=any(r != 1.0 for r in rep),
        )
        return Penalties(
            rows=rows_t,
            repetition=to_device(rep, dev, torch.float32),
            frequency=to_device([p.frequency_penalty for p in pens], dev, torch.float32),
            presence=to_device([p.presence_penalty for p in pens], dev, torch.float32),
            output_counts=counts,
            seen=seen,
        )

    def _logit_bias(self, infos: list[SlotInfo]) -> LogitBias | None:
        """The logit-bias tensors of the logits rows whose request biases tokens."""
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for g, info in enumerate(infos):
            for token_id, value in info.sampling.logit_bias.items():
                bias_rows.append(g)
                bias_ids.append(token_id)
                bias_values.append(value)
        if not bias_rows:
            return None
        dev = self.device
        return LogitBias(
            rows=to_device(bias_rows, dev, torch.long),
            token_ids=to_device(bias_ids, dev, torch.long),
            values=to_device(bias_values, dev, torch.float32),
        )
