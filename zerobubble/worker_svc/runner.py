"""The model runner: KV cache, persistent per-request device state, one step per plan.

The runner is what the worker service calls. It executes `StepPlan`s strictly in order and keeps
everything a decode needs on the device between steps: the last sampled token, the drafts
proposed after it, and the true sequence length. The scheduler's optimistic counts never reach
the model: positions and slot mappings are derived here from the worker's own state, so a step
planned before the previous step's result was known still runs on the right positions.

A step runs in named stages, each its own module: the slot table checks and admits the plan's
rows (`zerobubble.worker_svc.slot_table`), the batch builder turns them into device inputs
(`zerobubble.worker_svc.batch`), the model runs, sampling and verification pick the tokens
(`zerobubble.worker_svc.verification`), and the result copy brings them to the host
(`zerobubble.worker_svc.result_copy`). The runner makes no scheduling decisions; it validates what it is
told and executes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from zerobubble.api import worker_pb2
from zerobubble.config import WorkerConfig, default_of
from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.kernels.seq_lens import update_state
from zerobubble.rows import PlanRow
from zerobubble.worker_svc import staging
from zerobubble.worker_svc.batch import BatchBuilder, StepBatch
from zerobubble.worker_svc.cuda_graphs import DecodeGraphs, batch_buckets, draft_widths, num_scratch_blocks
from zerobubble.worker_svc.faults import NO_FAULTS, FaultInjector
from zerobubble.worker_svc.finish_notices import FinishNotices
from zerobubble.worker_svc.grammar import GrammarCompiler, copy_inputs, fill_masks
from zerobubble.worker_svc.model import StepInterrupted, allocate_kv_cache
from zerobubble.worker_svc.model_loader import LoadedModel
from zerobubble.worker_svc.proposers import Proposer
from zerobubble.worker_svc.proposers.prediction import PredictionDrafts
from zerobubble.worker_svc.result_copy import PendingResult, ResultCopier
from zerobubble.worker_svc.sampler import SamplingTensors
from zerobubble.worker_svc.slot_table import DecodeRows, DeviceState, RunnableRows, SlotInfo, SlotLimits, SlotTable
from zerobubble.worker_svc.staging import to_device
from zerobubble.worker_svc.verification import StepOutputs, fed_drafts, sample_and_verify

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunnerConfig:
    """Capacity and speculation settings of one runner."""

    num_blocks: int
    block_size: int = default_of(WorkerConfig, "block_size")
    max_num_seqs: int = default_of(WorkerConfig, "max_num_seqs")
    max_model_len: int = 2048
    num_spec_tokens: int = 0  # the proposer's draft tokens per decode (0: no proposer)
    # The most draft slots a decode of a request with a predicted output may carry (0: the
    # runner makes no drafts from predictions).
    num_prediction_tokens: int = 0
    # Replay decode-only steps through CUDA graphs (worker_svc/cuda_graphs.py); emulated with
    # the same padded buffers off CUDA (tests).
    cuda_graphs: bool = False

    @property
    def max_draft_slots(self) -> int:
        """K: the most draft slots any decode may carry."""
        return max(self.num_spec_tokens, self.num_prediction_tokens)


class SimulatedStep(Protocol):
    """Stands in for `run_model` + `sample` (`zerobubble.worker_svc.simulated.SimulatedDevice`)."""

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
        num_spec_tokens=runner.num_proposed,
        num_prediction_tokens=runner.predictions.max_drafts if runner.predictions is not None else 0,
        # A draft model writes its chain past the step: the scheduler allocates those slots too.
        num_lookahead_slots=proposer.num_lookahead_slots if proposer is not None else 0,
        max_num_seqs=cfg.max_num_seqs,
        **fields,
    )


def max_blocks_per_seq(config: RunnerConfig) -> int:
    """Block-table columns per request: room for the lookahead slots a step may feed past
    max_model_len's last block."""
    return -(-(config.max_model_len + config.max_draft_slots + 1) // config.block_size) + 1


class ModelRunner:
    """The model, its paged KV cache and the persistent batch state, composed into one step.

    A step (`execute`) is: the slot table checks the plan's rows, the batch builder admits them
    and builds the inputs (`prepare`), `run_model` runs the forward and the logits of the
    sampled slots, `sample` samples and verifies, advances the device state and starts the
    result copy; the next drafts follow in `propose_next`.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: RunnerConfig,
        proposer: Proposer | None = None,
        simulator: SimulatedStep | None = None,
        faults: FaultInjector = NO_FAULTS,
    ) -> None:
        """``simulator``: run on a simulated device instead of the model (``loaded.model`` may
        then be None; no KV cache is allocated). ``faults``: what a test injects (nothing by
        default)."""
        self.loaded = loaded
        self.model = loaded.model
        self.config = config
        self.simulator = simulator
        self.proposer = proposer
        self.faults = faults
        # The proposer's drafts per decode, and K, the most draft slots any decode carries
        # (wider for a request with a predicted output).
        self.num_proposed = config.num_spec_tokens if proposer is not None else 0
        # A simulated device's token function knows nothing of predictions.
        num_predicted = config.num_prediction_tokens if simulator is None else 0
        self.num_spec_tokens = max(self.num_proposed, num_predicted)
        self.device, self.kv_caches = self._allocate_kv_cache()
        max_blocks = max_blocks_per_seq(config)
        self.state = DeviceState.allocate(
            config.max_num_seqs, max_blocks, self.num_spec_tokens, config.num_blocks, config.block_size, self.device
        )
        self.predictions = (
            PredictionDrafts(config.max_num_seqs, num_predicted, self.device) if num_predicted > 0 else None
        )
        limits = SlotLimits(
            num_blocks=config.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_blocks_per_seq=max_blocks,
            num_spec_tokens=self.num_spec_tokens,
            vocab_size=getattr(getattr(loaded, "hf_config", None), "vocab_size", 0),
        )
        self.table = SlotTable(limits, self.state)
        # A simulated device stands for an accelerator too: the host never reads device state.
        trim = not staging.is_accelerator(self.device) and simulator is None
        # A simulated device samples no logits: it cannot constrain them.
        self.grammars = (
            GrammarCompiler(loaded.tokenizer_file, loaded.eos_token_ids, limits.vocab_size)
            if simulator is None and getattr(loaded, "tokenizer_file", None) is not None
            else None
        )
        self.builder = BatchBuilder(
            self.table, self.state, self.device, config.block_size, proposer, trim, self.grammars, self.predictions
        )
        self.notices = FinishNotices()
        if self.model is not None:
            self.model.interrupt = self.notices.moot
        if proposer is not None:
            proposer.bind(self)
        self.copier = ResultCopier(self.device)
        self._next_drafts: tuple[torch.Tensor, StepBatch] | None = None  # see `propose_next`
        self.graphs = self._decode_graphs(max_blocks)

    def _allocate_kv_cache(self) -> tuple[torch.device, list]:
        """The device and the KV cache (none on a simulated device); padding rows of graphed
        steps write into blocks past the scheduler's (never handed out)."""
        if self.simulator is not None:
            return torch.device("cpu"), []
        config, loaded = self.config, self.loaded
        assert loaded.model is not None, "a runner without a simulator needs the model"
        widths = draft_widths(self.num_proposed)
        num_scratch = num_scratch_blocks(max(widths), config.block_size) if config.cuda_graphs else 0
        device = loaded.model.device
        caches = allocate_kv_cache(
            loaded.hf_config, config.num_blocks + num_scratch, config.block_size, loaded.model.dtype, device
        )
        return device, caches

    def _decode_graphs(self, max_blocks: int) -> DecodeGraphs | None:
        """The decode steps' CUDA graphs, captured now (emulated off CUDA); None when off."""
        config = self.config
        if not config.cuda_graphs or self.simulator is not None:
            return None
        graphs = DecodeGraphs(
            self._forward_hidden,
            self.device,
            batch_buckets(config.max_num_seqs),
            # Wider rows (drafts from a prediction) run eagerly.
            draft_widths(self.num_proposed),
            config.block_size,
            config.num_blocks,
            max_blocks,
            capture=self.device.type == "cuda",
        )
        graphs.capture_all()
        return graphs

    @property
    def slots(self) -> dict[str, SlotInfo]:
        """Request id -> its state slot, for every request the runner holds."""
        return self.table.slots

    # -- request state -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (a new scheduler stream starts from scratch)."""
        self.copier.last_step_end = None
        self._next_drafts = None
        self.table.reset()
        if self.simulator is not None:
            self.simulator.reset()
        self.notices.clear()

    def note_finished(self, plan: worker_pb2.StepPlan) -> None:
        """Record a just-received plan's finish notices, before the plans ahead of it run (see
        `zerobubble.worker_svc.finish_notices`): a step all of whose rows a later plan finished is cut."""
        self.notices.note(plan)

    def fail_requests(self, req_ids: list[str], error: str) -> None:
        """Drop the state of requests whose step failed; later rows for them get `error`."""
        self.table.fail_requests(req_ids, error)

    def kv_usage(self) -> float:
        """KV blocks held by live requests (shared prefix blocks once) / all blocks."""
        return self.table.kv_usage()

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> PendingResult:
        """Run one plan; returns outputs that may still be on the device.

        Rows that cannot run (see `SlotTable.row_error`) are left out with a per-request error
        in the result; the others run as if those rows had never been planned.
        """
        start = time.perf_counter()
        self.propose_next()  # the previous step's drafts, if the caller has not made them
        for req_id in plan.finished_req_ids:
            self.table.release(req_id)
        self.faults.step_fault(plan)
        rows = self.table.runnable(plan, self.faults.row_faults(plan))
        self._refuse_bad_grammars(rows)
        self.notices.forget_before(plan.step_id)
        batch = self.prepare(plan, rows.decodes, rows.entries)
        if batch is None:
            return PendingResult.empty(plan.step_id, errors=rows.errors)
        pending = self._run_batch(batch, start)
        pending.errors = {**rows.errors, **pending.errors}  # rows left out, rows failed while running
        return pending

    def _refuse_bad_grammars(self, rows: RunnableRows) -> None:
        """Leave out, with a per-request error, new rows whose grammar does not compile here
        (the scheduler checked it; this keeps a bad one from failing the whole step)."""
        if self.grammars is None:
            return
        kept = []
        for entry in rows.entries:
            grammar = entry.sampling.grammar if entry.is_new and entry.sampling is not None else ""
            error = self.grammars.error(grammar) if grammar else None
            if error is None:
                kept.append(entry)
            else:
                rows.errors[entry.req_id] = error
                self.table.fail_requests([entry.req_id], error)
        rows.entries = kept

    def prepare(self, plan: worker_pb2.StepPlan, decodes: DecodeRows, entries: list[PlanRow]) -> StepBatch | None:
        """Apply the plan's finish notices, then admit the rows `SlotTable.runnable` accepted
        and build the step's inputs (`BatchBuilder.prepare`); None when the step runs nothing."""
        for req_id in plan.finished_req_ids:
            self.table.release(req_id)
        batch = self.builder.prepare(plan.step_id, decodes, entries)
        if batch is not None and batch.sampled is not None and self.table.num_constrained:
            constrained = [
                (i, grammar) for i, row in enumerate(batch.sampled.rows) if (grammar := batch.rows[row].grammar)
            ]
            if constrained:
                # Copied now, before the forward is launched: the masks are filled while it runs.
                drafts, num_real = self.fed_drafts(batch)
                rows, grammars = map(list, zip(*constrained))
                batch.grammar = copy_inputs(rows, grammars, drafts, num_real)
        return batch

    def prefetch_grammars(self, plan: worker_pb2.StepPlan) -> None:
        """Start compiling the grammars a just-received plan brings, off the step thread."""
        if self.grammars is not None and plan.requests:
            self.grammars.prefetch(plan)

    def _run_batch(self, batch: StepBatch, start: float) -> PendingResult:
        """The model (or the simulated device), sampling and the start of the result copy; a
        step a later plan made moot is cut short, before the forward or between layers."""
        notices, copier = self.notices, self.copier
        notices.current = (batch.step_id, batch.req_ids)
        try:
            if notices.moot():
                raise StepInterrupted
            if self.simulator is not None:
                return self.simulator.step(self, batch)
            begin = copier.device_event()
            pending = self.sample(batch, self.run_model(batch))
            pending.forward_s = time.perf_counter() - start
            if begin is not None:
                end = copier.device_event()
                pending.device_span = (copier.last_step_end, begin, end)
                # The next step's gap counts from here while requests stay live.
                copier.last_step_end = end if self.table.slots else None
            return pending
        except StepInterrupted:
            # Nothing of the step is used: no state advances, no tokens, no drafts.
            copier.last_step_end = None
            notices.num_cut_steps += 1
            logger.debug("step %d cut short: a later plan finished all its rows", batch.step_id)
            return PendingResult.empty(batch.step_id, time.perf_counter() - start)
        finally:
            notices.current = None

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
                self.proposer.observe(batch, hidden)
            return logits
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
        if self.proposer is not None:
            self.proposer.observe(batch, hidden)
        if batch.sampled is None:
            return None
        return self.model.compute_logits(hidden[batch.sampled.gather])

    def sample(self, batch: StepBatch, logits: torch.Tensor | None) -> PendingResult:
        """Sample and verify the sampled rows, then advance the device state (see `advance`)."""
        if batch.sampled is None or logits is None:
            return self.advance(batch, None)
        masks, grammar_s = None, 0.0
        if batch.grammar is not None:
            begin = time.perf_counter()
            s = batch.sampled
            vocab_size = logits.shape[1]
            masks = fill_masks(
                batch.grammar, s.num_cols_host, s.base_host, vocab_size, self._history(batch), self.device
            )
            grammar_s = time.perf_counter() - begin
        s = batch.sampled
        drafted = self.predictions.drafted(s.slots) if self.predictions is not None and s.predicted else None
        out = sample_and_verify(batch, logits, self.state, self.proposer, self.num_proposed, masks, drafted)
        pending = self.advance(batch, out)
        pending.grammar_s = grammar_s
        if masks is not None and masks.errors:
            # The row's error replaces its tokens in the result: the request ends with it.
            failed = {batch.req_ids[batch.sampled.rows[row]]: error for row, error in masks.errors.items()}
            pending.errors.update(failed)
            for req_id, error in failed.items():
                self.table.fail_requests([req_id], error)
        return pending

    def _history(self, batch: StepBatch) -> Callable[[int, int, int], list[int]]:
        """Reads a sampled row's tokens [start, end) back from the device's history pages (a
        resumed constrained request replays its earlier outputs into its grammar; rare)."""

        def read(row: int, start: int, end: int) -> list[int]:
            assert batch.sampled is not None
            info = batch.rows[batch.sampled.rows[row]]
            pages = self.state.history.index_select(0, to_device(info.block_ids, torch.long, self.device))
            return pages.reshape(-1)[start:end].tolist()

        return read

    def fed_drafts(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts fed to the sampled rows and how many are real (`verification.fed_drafts`)."""
        return fed_drafts(batch, self.state)

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
        pending = PendingResult(
            batch.step_id, batch.req_ids, [], None, None, None, None, batch.want_logprobs, batch.num_tokens, 0.0
        )
        if out is None or s is None:
            return pending
        for i in s.rows:
            batch.rows[i].has_sample = True
        pending.sampled_rows = s.rows
        pending.out_tokens, pending.num_accepted, pending.num_drafts = out.tokens, out.num_accepted, out.num_verified
        pending.logprobs = out.logprobs
        pending.prediction_drafts = out.prediction_drafts
        if out.top_ids is not None:
            pending.top_ids, pending.top_logprobs = out.top_ids, out.top_logprobs
            pending.num_top = s.num_top
        self.copier.start(pending)
        if batch.grammar is not None:
            for row, grammar in zip(batch.grammar.rows, batch.grammar.grammars):
                grammar.pending = (pending, row)  # consumed when the request next samples
        # The next drafts are left to `propose_next`, after the caller has handed this result
        # on: the copy then waits for this step's sampling only, and the scheduler hears the
        # step while a draft model's k forwards run (on a GPU: while they are launched).
        # A plan that gave no decode row a draft slot fed no drafts, so the carried state a
        # proposer keeps (an EAGLE head's hidden state) is already that of the last accepted
        # position; skipping the chain leaves these rows' draft counts at the zero
        # `update_state` wrote, and the next step verifies no drafts for them.
        if (self.proposer is not None and batch.drafts_planned) or s.predicted:
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
        # Drafts for requests a later plan has finished are never used: a draft model's chain
        # stops between layers then (its forward asks `FinishNotices.moot`, as the target's does). With the
        # result already out, the finish notice for a request's last step arrives while its
        # chain runs, and the next request's prefill no longer waits for that chain.
        self.notices.current = (batch.step_id, batch.req_ids)
        try:
            if self.proposer is not None and batch.drafts_planned:
                self.proposer.propose(slots, batch)
            predicted = batch.sampled.predicted if batch.sampled is not None else []
            if predicted and self.predictions is not None:
                # After the proposer: where the prediction is aligned, its drafts win.
                if len(predicted) < len(slots):
                    slots = slots[to_device(predicted, torch.long, self.device)]
                self.predictions.propose(slots, self.state, self.config.block_size)
        except StepInterrupted:
            self.notices.num_cut_drafts += 1
            logger.debug("drafts after step %d cut short: a later plan finished all its rows", batch.step_id)
        finally:
            self.notices.current = None

    def sampling_tensors(self, slots: np.ndarray, valid_cols: np.ndarray, sample_pos: torch.Tensor) -> SamplingTensors:
        """Per-logits-row sampling tensors (`BatchBuilder.sampling_tensors`); the draft-model
        proposer builds its chain's tensors here too (the same controls)."""
        return self.builder.sampling_tensors(slots, valid_cols, sample_pos)
