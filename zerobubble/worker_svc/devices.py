"""The step's device (`zerobubble.worker_svc.step.StepDevice`) for a real model: op by op
(`EagerDevice`), or replaying CUDA graphs for decode-only steps (`GraphDevice`, emulated with the
same padded buffers off CUDA). The simulated accelerator is `zerobubble.worker_svc.simulated`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.worker_svc.batch import StepBatch
from zerobubble.worker_svc.cuda_graphs import DecodeGraphs
from zerobubble.worker_svc.grammar import StepMasks
from zerobubble.worker_svc.model import CausalLM
from zerobubble.worker_svc.proposers import Proposer
from zerobubble.worker_svc.result_copy import StepTiming
from zerobubble.worker_svc.slot_table import DeviceState
from zerobubble.worker_svc.step import Logits
from zerobubble.worker_svc.verification import StepOutputs, sample_and_verify


class DeviceClock:
    """Times steps on a CUDA device's compute stream; elsewhere the step thread's clock tells.

    The step thread runs ahead of a CUDA device, so its own launch and wait times say nothing
    about the bubble there: a step's time and the gap before it come from events.
    """

    def __init__(self, device: torch.device) -> None:
        self.timed = device.type == "cuda"
        self.last_end: Any = None  # the latest step's end event while requests were live

    def begin(self) -> Any:
        """A timing event recorded now on the compute stream (CUDA); None elsewhere."""
        if not self.timed:
            return None
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record()
        return event

    def timing(self, start: float, begin: Any, grammar_s: float, live: bool) -> StepTiming:
        """The step's times: its host time from ``start``, and on CUDA its span on the device."""
        forward_s = time.perf_counter() - start
        if begin is None:
            return StepTiming(forward_s, grammar_s=grammar_s)
        end = self.begin()
        span = (self.last_end, begin, end)
        # The next step's gap counts from here while requests stay live.
        self.last_end = end if live else None
        return StepTiming(forward_s, device_span=span, grammar_s=grammar_s)


class EagerDevice:
    """The model run op by op; sampling and verification on its logits."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list,
        state: DeviceState,
        proposer: Proposer | None,
        num_proposed: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.state = state
        self.proposer = proposer
        self.num_proposed = num_proposed  # the proposer's drafts per decode
        self.clock = DeviceClock(model.device)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model body (writes K/V): what a decode graph captures. Its logits are computed
        after the replay: captured, every graph would keep its own ``[rows * width, vocab]``
        output alive (outputs outlive their capture), over 20 GB for 256 sequences, k = 3 and
        a 128k vocabulary, against a few hundred MB of hidden states."""
        return self.model(input_ids, positions, meta, self.kv_caches)

    def run_model(self, batch: StepBatch) -> Logits:
        begin = self.clock.begin()
        hidden = self.forward_hidden(batch.input_ids, batch.positions, batch.meta)
        if self.proposer is not None:
            self.proposer.observe(batch, hidden)
        if batch.sampled is None:
            return Logits(None, begin)
        return Logits(self.model.compute_logits(hidden[batch.sampled.layout.gather]), begin)

    def sample(
        self, batch: StepBatch, logits: Logits, masks: StepMasks | None, prediction_drafts: torch.Tensor | None
    ) -> StepOutputs:
        assert logits.values is not None
        return sample_and_verify(
            batch, logits.values, self.state, self.proposer, self.num_proposed, masks, prediction_drafts
        )

    def timing(self, start: float, logits: Logits, grammar_s: float, live: bool) -> StepTiming:
        return self.clock.timing(start, logits.begin, grammar_s, live)

    def interrupted(self) -> None:
        self.clock.last_end = None

    def reset(self) -> None:
        self.clock.last_end = None


class GraphDevice:
    """`EagerDevice` whose decode-only steps replay a CUDA graph captured for their shape."""

    def __init__(self, eager: EagerDevice, graphs: DecodeGraphs) -> None:
        self.eager = eager
        self.graphs = graphs

    def run_model(self, batch: StepBatch) -> Logits:
        graphs, eager = self.graphs, self.eager
        key = graphs.choose(batch.row_widths, [True] * len(batch.row_widths)) if batch.all_decode else None
        if key is None:
            return eager.run_model(batch)
        begin = eager.clock.begin()
        table_rows = eager.state.block_table.index_select(0, batch.req_slots.long())
        hidden = graphs.run(key, batch.input_ids, batch.positions, batch.meta, table_rows)
        if eager.proposer is not None:
            eager.proposer.observe(batch, hidden)
        # Every token of a decode row is sampled, in order: the logits are already [G, vocab].
        return Logits(eager.model.compute_logits(hidden), begin)

    def sample(
        self, batch: StepBatch, logits: Logits, masks: StepMasks | None, prediction_drafts: torch.Tensor | None
    ) -> StepOutputs:
        return self.eager.sample(batch, logits, masks, prediction_drafts)

    def timing(self, start: float, logits: Logits, grammar_s: float, live: bool) -> StepTiming:
        return self.eager.timing(start, logits, grammar_s, live)

    def interrupted(self) -> None:
        self.eager.interrupted()

    def reset(self) -> None:
        self.eager.reset()
