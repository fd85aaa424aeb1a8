"""The model runner: KV cache, persistent per-request device state, one step per plan.

The runner is what the worker service calls. It executes `StepPlan`s strictly in order and keeps
everything a decode needs on the device between steps: the last sampled token, the drafts
proposed after it, and the true sequence length. The scheduler's optimistic counts never reach
the model: positions and slot mappings are derived here from the worker's own state, so a step
planned before the previous step's result was known still runs on the right positions.

The runner builds the parts a step runs through (slot table, batch builder, the step's device,
result copier) once; the step itself, plan in to result out, is `zerobubble.worker_svc.step`.
The runner makes no scheduling decisions; it validates what it is told and executes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from zerobubble.api import worker_pb2
from zerobubble.config import WorkerConfig, default_of
from zerobubble.kernels._triton import KernelImpl
from zerobubble.worker_svc import staging
from zerobubble.worker_svc.batch import BatchBuilder, StepBatch
from zerobubble.worker_svc.cuda_graphs import DecodeGraphs, batch_buckets, draft_widths, num_scratch_blocks
from zerobubble.worker_svc.devices import EagerDevice, GraphDevice
from zerobubble.worker_svc.faults import NO_FAULTS, FaultInjector, checked_rows
from zerobubble.worker_svc.finish_notices import FinishNotices
from zerobubble.worker_svc.grammar import GrammarCompiler
from zerobubble.worker_svc.model import CausalLM, allocate_kv_cache
from zerobubble.worker_svc.model_loader import LoadedModel
from zerobubble.worker_svc.parallel import PLAN, RESET, PlanChannel
from zerobubble.worker_svc.proposers import Proposer
from zerobubble.worker_svc.proposers.prediction import PredictionDrafts
from zerobubble.worker_svc.result_copy import PendingResult, ResultCopier
from zerobubble.worker_svc.sampler import SamplingTensors
from zerobubble.worker_svc.simulated import SimulatedDevice
from zerobubble.worker_svc.slot_table import DeviceState, SlotInfo, SlotLimits, SlotTable
from zerobubble.worker_svc.step import DraftsDue, StepDevice, StepParts, execute, propose
from zerobubble.worker_svc.verification import fed_drafts


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
        tensor_parallel_size=runner.model.tp.size if runner.model is not None else 1,
        sliding_window=attention_window(runner),
        **fields,
    )


# Proposers that read token history only, never the KV cache: blocks behind the target's window
# mean nothing to them. A draft model or an EAGLE head attends its whole context through the
# request's block table, so with one the scheduler must keep every block.
_KV_FREE_PROPOSERS = frozenset({"ngram", "suffix"})


def attention_window(runner: ModelRunner) -> int:
    """The window the scheduler may free blocks behind (`WorkerInfo.sliding_window`): the
    smallest over the layers when every layer is windowed; 0 when any layer attends the whole
    sequence, with a proposer that reads the KV cache, or on a simulated device."""
    model, proposer = runner.model, runner.proposer
    if model is None or (proposer is not None and proposer.method not in _KV_FREE_PROPOSERS):
        return 0
    if isinstance(runner.parts.device, SimulatedDevice):  # it reads tokens of earlier positions
        return 0
    windows = model.spec.sliding_windows
    return min(windows) if windows and min(windows) > 0 else 0


def max_blocks_per_seq(config: RunnerConfig) -> int:
    """Block-table columns per request: room for the lookahead slots a step may feed past
    max_model_len's last block."""
    return -(-(config.max_model_len + config.max_draft_slots + 1) // config.block_size) + 1


def grammar_compiler(loaded: LoadedModel, vocab_size: int) -> GrammarCompiler | None:
    """What compiles the grammars of constrained requests; None without a tokenizer."""
    if getattr(loaded, "tokenizer_file", None) is None:
        return None
    return GrammarCompiler(loaded.tokenizer_file, loaded.eos_token_ids, vocab_size)


def draft_slots(config: RunnerConfig, proposer: Proposer | None, simulated: bool) -> tuple[int, int, bool]:
    """``(drafts the proposer makes, prediction drafts a row may carry, suffix decoding)``."""
    num_proposed = config.num_spec_tokens if proposer is not None else 0
    # Suffix decoding drafts every row from its prediction buffer (`proposers/suffix.py`).
    suffix = proposer is not None and proposer.method == "suffix"
    # A simulated device's token function knows nothing of predictions.
    num_predicted = config.num_prediction_tokens if not simulated else 0
    if suffix:
        num_predicted = max(num_predicted, num_proposed)
    return num_proposed, num_predicted, suffix


class ModelRunner:
    """The model, its paged KV cache and the persistent batch state, composed into one step.

    A step (`execute`) is `zerobubble.worker_svc.step.execute`'s five stages over the parts
    built here; the next drafts follow in `propose_next`.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: RunnerConfig,
        proposer: Proposer | None = None,
        simulator: SimulatedDevice | None = None,
        faults: FaultInjector = NO_FAULTS,
        channel: PlanChannel | None = None,
    ) -> None:
        """``simulator``: run on a simulated device instead of the model (``loaded.model`` may
        then be None; no KV cache is allocated). ``faults``: what a test injects (nothing by
        default). ``channel``: a tensor-parallel leader's, on which every plan and reset goes
        to the other ranks first (`zerobubble.worker_svc.ranks`)."""
        self.loaded = loaded
        self.channel = channel
        self.config = config
        self.faults = faults
        num_proposed, num_predicted, suffix = draft_slots(config, proposer, simulator is not None)
        # K: the most draft slots any decode carries (wider for a request with a predicted output).
        num_spec_tokens = max(num_proposed, num_predicted)
        self.device, self.kv_caches = self._allocate_kv_cache(num_proposed, simulator is not None)
        max_blocks = max_blocks_per_seq(config)
        state = DeviceState.allocate(
            config.max_num_seqs, max_blocks, num_spec_tokens, config.num_blocks, config.block_size, self.device
        )
        vocab_size = getattr(getattr(loaded, "hf_config", None), "vocab_size", 0)
        limits = SlotLimits(config.num_blocks, config.max_num_seqs, max_blocks, num_spec_tokens, vocab_size)
        table = SlotTable(limits, state)
        predictions = (
            PredictionDrafts(config.max_num_seqs, num_predicted, self.device, dynamic=suffix, kernels=self.kernels)
            if num_predicted > 0
            else None
        )
        # A simulated device samples no logits: it cannot constrain them.
        grammars = grammar_compiler(loaded, limits.vocab_size) if simulator is None else None
        # A simulated device stands for an accelerator too: the host never reads device state.
        trim = not staging.is_accelerator(self.device) and simulator is None
        builder = BatchBuilder(table, state, self.device, config.block_size, proposer, trim, grammars, predictions)
        if simulator is not None:
            simulator.bind(state, config.block_size)
        self.parts = StepParts(
            table=table,
            builder=builder,
            device=simulator if simulator is not None else self._model_device(state, proposer, num_proposed),
            copier=ResultCopier(self.device),
            notices=FinishNotices(),
            state=state,
            proposer=proposer,
            predictions=predictions,
            grammars=grammars,
            check_rows=checked_rows(table.runnable, faults),
            block_size=config.block_size,
        )
        if self.model is not None:
            self.model.interrupt = self.parts.notices.moot
        if proposer is not None:
            proposer.bind(self)
        self._drafts_due: DraftsDue | None = None  # see `propose_next`

    def _allocate_kv_cache(self, num_proposed: int, simulated: bool) -> tuple[torch.device, list]:
        """The device and the KV cache (none on a simulated device); padding rows of graphed
        steps write into blocks past the scheduler's (never handed out)."""
        if simulated:
            return torch.device("cpu"), []
        config, loaded = self.config, self.loaded
        assert loaded.model is not None, "a runner without a simulator needs the model"
        widths = draft_widths(num_proposed)
        num_scratch = num_scratch_blocks(max(widths), config.block_size) if config.cuda_graphs else 0
        device = loaded.model.device
        num_kv_heads = loaded.model.spec.num_kv_heads  # a tensor-parallel rank's own
        caches = allocate_kv_cache(
            loaded.hf_config,
            config.num_blocks + num_scratch,
            config.block_size,
            loaded.model.dtype,
            device,
            num_kv_heads,
        )
        return device, caches

    def _model_device(self, state: DeviceState, proposer: Proposer | None, num_proposed: int) -> StepDevice:
        """The model's step device: eager, or replaying decode graphs (captured now; emulated
        off CUDA) when they are on."""
        config = self.config
        assert self.model is not None
        eager = EagerDevice(self.model, self.kv_caches, state, proposer, num_proposed)
        if not config.cuda_graphs:
            return eager
        graphs = DecodeGraphs(
            eager.forward_hidden,
            self.device,
            batch_buckets(config.max_num_seqs),
            # Wider rows (drafts from a prediction) run eagerly.
            draft_widths(num_proposed),
            config.block_size,
            config.num_blocks,
            max_blocks_per_seq(config),
            capture=self.device.type == "cuda",
        )
        graphs.capture_all()
        return GraphDevice(eager, graphs)

    # -- the parts, by name ----------------------------------------------------------------------

    @property
    def model(self) -> CausalLM | None:
        return self.loaded.model

    @property
    def kernels(self) -> KernelImpl:
        """The model's kernel implementation ("cpp": the compiled CPU kernels), for the
        proposers' own kernels; None without a model (a simulated device)."""
        return self.model.kernels if self.model is not None else None

    @property
    def table(self) -> SlotTable:
        return self.parts.table

    @property
    def builder(self) -> BatchBuilder:
        return self.parts.builder

    @property
    def state(self) -> DeviceState:
        return self.parts.state

    @property
    def copier(self) -> ResultCopier:
        return self.parts.copier

    @property
    def notices(self) -> FinishNotices:
        return self.parts.notices

    @property
    def proposer(self) -> Proposer | None:
        return self.parts.proposer

    @property
    def predictions(self) -> PredictionDrafts | None:
        return self.parts.predictions

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode steps' CUDA graphs; None when off."""
        device = self.parts.device
        return device.graphs if isinstance(device, GraphDevice) else None

    @property
    def num_proposed(self) -> int:
        """The proposer's drafts per decode (0 without one)."""
        return self.config.num_spec_tokens if self.parts.proposer is not None else 0

    @property
    def num_spec_tokens(self) -> int:
        """K, the most draft slots any decode carries (wider for a request with a predicted output)."""
        return self.table.limits.num_spec_tokens

    @property
    def slots(self) -> dict[str, SlotInfo]:
        """Request id -> its state slot, for every request the runner holds."""
        return self.table.slots

    # -- request state -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (a new scheduler stream starts from scratch)."""
        if self.channel is not None:
            self.channel.send(RESET)
        self._drafts_due = None
        self.table.reset()
        self.parts.device.reset()
        self.notices.clear()

    def note_finished(self, plan: worker_pb2.StepPlan) -> None:
        """Record a just-received plan's finish notices, before the plans ahead of it run (see
        `zerobubble.worker_svc.finish_notices`): a step all of whose rows a later plan finished is cut.

        Not on a tensor-parallel group: the other ranks would not know when the leader cut a
        step, and the leader would wait for them in an all-reduce they never reach."""
        if self.model is None or self.model.tp.size == 1:
            self.notices.note(plan)

    def fail_requests(self, req_ids: list[str], error: str) -> None:
        """Drop the state of requests whose step failed; later rows for them get `error`."""
        self.table.fail_requests(req_ids, error)

    def kv_usage(self) -> float:
        """KV blocks held by live requests (shared prefix blocks once) / all blocks."""
        return self.table.kv_usage()

    def prefetch_grammars(self, plan: worker_pb2.StepPlan) -> None:
        """Start compiling the grammars a just-received plan brings, off the step thread."""
        grammars = self.parts.grammars
        if grammars is not None and plan.rows.sampling:
            grammars.prefetch(plan)

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> PendingResult:
        """Run one plan (`zerobubble.worker_svc.step.execute`); returns outputs that may still
        be on the device.

        Rows that cannot run (see `SlotTable.row_error`) are left out with a per-request error
        in the result; the others run as if those rows had never been planned.
        """
        start = time.perf_counter()
        if self.channel is not None:
            self.channel.send(PLAN, plan.SerializeToString())
        self.propose_next()  # the previous step's drafts, if the caller has not made them
        result, self._drafts_due = execute(self.parts, plan, start)
        return result

    @torch.inference_mode()
    def propose_next(self) -> None:
        """Make the drafts of the rows the last executed step sampled (a no-op when made).

        The worker's step loop calls it once the step's result is on its way to the copier;
        `execute` calls it first thing, so a caller that does not still gets every draft, in
        the same order.
        """
        due, self._drafts_due = self._drafts_due, None
        if due is not None:
            propose(self.parts, due)

    def collective_seconds(self) -> float:
        """Host seconds spent in tensor-parallel collectives since the last call: the plans
        and resets sent to the other ranks, and the model's all-reduces (0 on one device)."""
        if self.model is None or self.model.tp.size == 1:
            return 0.0
        sent = self.channel.take_seconds() if self.channel is not None else 0.0
        return sent + self.model.tp.clock.take()

    def fed_drafts(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts fed to the sampled rows and how many are real (`verification.fed_drafts`)."""
        return fed_drafts(batch, self.state)

    def sampling_tensors(self, slots: np.ndarray, valid_cols: np.ndarray, sample_pos: torch.Tensor) -> SamplingTensors:
        """Per-logits-row sampling tensors (`BatchBuilder.sampling_tensors`); the draft-model
        proposer builds its chain's tensors here too (the same controls)."""
        return self.builder.sampling_tensors(slots, valid_cols, sample_pos)
