"""The result copy: a step's outputs from the device to the host, and into a wire result.

The step thread only starts the copy (`ResultCopier.start`); the copier thread waits for it and
builds the `StepResult` (`PendingResult.materialize`), so the next step runs meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zerobubble.api import worker_pb2
from zerobubble.rows import ResultBuilder
from zerobubble.worker_svc import staging
from zerobubble.worker_svc.verification import StepOutputs


class CopyDone(Protocol):
    """What `PendingResult.ready` waits on: a CUDA event, or the simulated device's clock."""

    def synchronize(self) -> None: ...


@dataclass(slots=True)
class HostOutputs:
    """A step's outputs read to Python lists, one entry per sampled row."""

    tokens: list[list[int]]
    accepted: list[int]
    drafted: list[int]
    logprobs: list[list[float]]
    top_ids: list[list[list[int]]]
    top_logprobs: list[list[list[float]]]
    prediction_drafts: list[bool]  # empty: no row had a prediction


def _as_list(t: torch.Tensor | None) -> list:
    return t.tolist() if t is not None else []


def host_outputs(outputs: StepOutputs | None) -> HostOutputs:
    """A step's outputs (on the host by now) as Python lists; empty when no row sampled."""
    if outputs is None:
        return HostOutputs([], [], [], [], [], [], [])
    return HostOutputs(
        _as_list(outputs.tokens),
        _as_list(outputs.num_accepted),
        _as_list(outputs.num_verified),
        _as_list(outputs.logprobs),
        _as_list(outputs.top_ids),
        _as_list(outputs.top_logprobs),
        _as_list(outputs.prediction_drafts),
    )


@dataclass(frozen=True, slots=True)
class StepTiming:
    """How long a step took and the gap before it, as its result reports them."""

    forward_s: float  # the step thread's time from the step's start to its result copy
    # A simulated device's own idle time before this step; it replaces the step thread's wait
    # for the plan, which says nothing about a device that runs behind the host.
    idle_s: float | None = None
    # CUDA: timing events (the previous step's end while requests were live, or None; this
    # step's begin and end on the compute stream).
    device_span: tuple[Any, Any, Any] | None = None
    grammar_s: float = 0.0  # host time the step spent filling grammar masks
    # What the result copy waits for besides the copy itself: a simulated device's clock.
    ready: CopyDone | None = None


@dataclass(frozen=True, slots=True)
class ResultRows:
    """A step's rows as its result reports them: which sampled and what each asked for."""

    req_ids: list[str]
    sampled: list[int]  # rows (into req_ids) that emitted tokens
    want_logprobs: list[bool]  # per row
    num_top: list[int] = field(default_factory=list)  # top-N logprobs per sampled row; empty: none


@dataclass(frozen=True, slots=True)
class PendingResult:
    """A step whose outputs may still be on the device; `materialize` copies them to the host.

    Built once, when the step's copy has started (`zerobubble.worker_svc.step.copy_results`).
    """

    step_id: int
    num_tokens: int
    rows: ResultRows
    outputs: StepOutputs | None  # None: no row sampled
    timing: StepTiming
    ready: CopyDone | None = None  # after the async device-to-host copy
    errors: Mapping[str, str] = field(default_factory=dict)  # rows left out or failed: req_id -> why

    @classmethod
    def empty(cls, step_id: int, forward_s: float = 0.0, errors: Mapping[str, str] | None = None) -> PendingResult:
        """The result of a step that ran no row."""
        return cls(step_id, 0, ResultRows([], [], []), None, StepTiming(forward_s), errors=errors or {})

    @property
    def req_ids(self) -> list[str]:
        """Every row the step ran, in order."""
        return self.rows.req_ids

    def materialize(self, idle_s: float, num_spec_tokens: int) -> worker_pb2.StepResult:
        """Wait for the copy (if any) and build the wire result (`idle_s`: the step thread's
        wait for this plan while requests were live)."""
        for ready in (self.ready, self.timing.ready):
            if ready is not None:
                ready.synchronize()
        forward_s, idle_s = self._timings(idle_s)
        result = worker_pb2.StepResult(
            step_id=self.step_id,
            forward_s=forward_s,
            idle_s=idle_s,
            num_tokens=self.num_tokens,
            grammar_s=self.timing.grammar_s,
        )
        out = host_outputs(self.outputs)
        # The proposer's acceptance by position; prediction drafts are counted apart.
        accepted_per_pos = [0] * num_spec_tokens
        for i, num_acc in enumerate(out.accepted):
            if out.prediction_drafts and out.prediction_drafts[i]:
                continue
            if num_acc > len(accepted_per_pos):
                accepted_per_pos.extend([0] * (num_acc - len(accepted_per_pos)))
            for pos in range(num_acc):
                accepted_per_pos[pos] += 1
        rows = self._rows(out)
        for req_id, error in self.errors.items():
            rows.add_error(req_id, error)
        rows.write(result)
        result.accepted_per_pos.extend(accepted_per_pos)
        return result

    def _timings(self, idle_s: float) -> tuple[float, float]:
        """The step's forward time and the idle time before it, as the result reports them."""
        timing = self.timing
        forward_s = timing.forward_s
        if timing.idle_s is not None:
            idle_s = timing.idle_s
        if timing.device_span is not None:
            # The step's time on the device and the device's gap before it: the step thread
            # runs ahead of the device, so its own times (launching, waiting for the next
            # plan) say nothing about the bubble there.
            prev_end, begin, end = timing.device_span
            end.synchronize()
            forward_s = begin.elapsed_time(end) / 1000
            idle_s = max(prev_end.elapsed_time(begin) / 1000, 0.0) if prev_end is not None else 0.0
        return forward_s, idle_s

    def _rows(self, out: HostOutputs) -> ResultBuilder:
        """Every row that ran once, a non-sampling chunk with no tokens; a row that failed
        after it ran (its grammar) is left to its error."""
        built = ResultBuilder()
        rows = self.rows
        by_row: dict[int, int] = {row: i for i, row in enumerate(rows.sampled)}
        # Rows flag prediction drafts only in steps where some row had a prediction.
        flags = out.prediction_drafts
        for row, req_id in enumerate(rows.req_ids):
            if req_id in self.errors:
                continue
            i = by_row.get(row)
            if i is None:
                built.add(req_id)
                continue
            num_emitted = out.accepted[i] + 1
            tokens = out.tokens[i][:num_emitted]
            logprobs = out.logprobs[i][:num_emitted] if rows.want_logprobs[row] else None
            top = None
            if out.top_ids and rows.num_top[i] > 0:
                # Column c holds the distribution the token at column c was drawn from.
                n = rows.num_top[i]
                top = [(out.top_ids[i][c][:n], out.top_logprobs[i][c][:n]) for c in range(num_emitted)]
            built.add(
                req_id,
                tokens,
                out.drafted[i],
                prediction_drafts=bool(flags) and flags[i],
                logprobs=logprobs,
                top_logprobs=top,
            )
        return built


@dataclass(frozen=True, slots=True)
class Copy:
    """A started device-to-host copy: the outputs' host tensors and what to wait for."""

    outputs: StepOutputs | None
    ready: CopyDone | None = None


class ResultCopier:
    """Starts each step's device-to-host copy without blocking the next step."""

    def __init__(self, device: torch.device) -> None:
        self.accelerator = staging.is_accelerator(device)
        self.stream = torch.cuda.Stream() if device.type == "cuda" else None

    def start(self, outputs: StepOutputs) -> Copy:
        """Start the device-to-host copy of a step's outputs without blocking the next step.

        On CUDA the copy runs on a side stream after the step's kernels and `materialize`
        (on the copier thread) waits for its event; the step thread never waits.
        """
        if not self.accelerator:
            return Copy(outputs)  # CPU tensors are already on the host; materialize() just reads them
        stream = self.stream
        if stream is None:  # an accelerator without streams (the fake test device)
            return Copy(_map_tensors(outputs, staging.to_host))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):

            def to_host(t: torch.Tensor) -> torch.Tensor:
                t.record_stream(stream)
                return staging.to_host(t)

            host = _map_tensors(outputs, to_host)
            # Blocking: the copier thread sleeps in `synchronize` instead of spinning a core
            # for most of every step (the copy runs after the whole step).
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        return Copy(host, event)


def _map_tensors(outputs: StepOutputs, function: Callable[[torch.Tensor], torch.Tensor]) -> StepOutputs:
    """``outputs`` with ``function`` applied to each of its tensors."""

    def apply(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else function(t)

    o = outputs
    return StepOutputs(
        function(o.tokens),
        function(o.num_accepted),
        function(o.num_verified),
        apply(o.logprobs),
        apply(o.top_ids),
        apply(o.top_logprobs),
        apply(o.prediction_drafts),
    )
