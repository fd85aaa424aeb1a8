"""The result copy: a step's outputs from the device to the host, and into a wire result.

The step thread only starts the copy (`ResultCopier.start`); the copier thread waits for it and
builds the `StepResult` (`PendingResult.materialize`), so the next step runs meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zerobubble.api import worker_pb2
from zerobubble.rows import add_row_columns
from zerobubble.worker_svc import staging

# The output tensors of a `PendingResult` that are copied to the host.
_OUTPUT_FIELDS = (
    "out_tokens",
    "num_accepted",
    "num_drafts",
    "logprobs",
    "top_ids",
    "top_logprobs",
    "prediction_drafts",
)


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


@dataclass(slots=True)
class RowColumns:
    """The rows of a result that go into its columns (no logprobs, no error)."""

    req_ids: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    prediction_drafts: list[bool] = field(default_factory=list)


def _as_list(t: torch.Tensor | None) -> list:
    return t.tolist() if t is not None else []


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
    grammar_s: float = 0.0  # host time the step spent filling grammar masks
    # [num_sampled] bool: the row's verified drafts came from its prediction; None: no row has one.
    prediction_drafts: torch.Tensor | None = None

    @classmethod
    def empty(cls, step_id: int, forward_s: float = 0.0, errors: dict[str, str] | None = None) -> PendingResult:
        """The result of a step that ran no row."""
        return cls(step_id, [], [], None, None, None, None, [], 0, forward_s, errors=errors or {})

    def materialize(self, idle_s: float, num_spec_tokens: int) -> worker_pb2.StepResult:
        """Wait for the copy (if any) and build the wire result (`idle_s`: the step thread's
        wait for this plan while requests were live)."""
        if self.ready is not None:
            self.ready.synchronize()
        forward_s, idle_s = self._timings(idle_s)
        result = worker_pb2.StepResult(
            step_id=self.step_id,
            forward_s=forward_s,
            idle_s=idle_s,
            num_tokens=self.num_tokens,
            grammar_s=self.grammar_s,
        )
        out = HostOutputs(
            _as_list(self.out_tokens),
            _as_list(self.num_accepted),
            _as_list(self.num_drafts),
            _as_list(self.logprobs),
            _as_list(self.top_ids),
            _as_list(self.top_logprobs),
            _as_list(self.prediction_drafts),
        )
        # The proposer's acceptance by position; prediction drafts are counted apart.
        accepted_per_pos = [0] * num_spec_tokens
        for i, num_acc in enumerate(out.accepted):
            if out.prediction_drafts and out.prediction_drafts[i]:
                continue
            if num_acc > len(accepted_per_pos):
                accepted_per_pos.extend([0] * (num_acc - len(accepted_per_pos)))
            for pos in range(num_acc):
                accepted_per_pos[pos] += 1
        cols = self._add_rows(result, out)
        add_row_columns(
            result, cols.req_ids, cols.num_tokens, cols.tokens, cols.num_drafts, cols.prediction_drafts or None
        )
        for req_id, error in self.errors.items():
            result.results.add(req_id=req_id, error=error)
        result.accepted_per_pos.extend(accepted_per_pos)
        return result

    def _timings(self, idle_s: float) -> tuple[float, float]:
        """The step's forward time and the idle time before it, as the result reports them."""
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
        return forward_s, idle_s

    def _add_rows(self, result: worker_pb2.StepResult, out: HostOutputs) -> RowColumns:
        """Every runnable row once, a non-sampling chunk with no tokens: rows without logprobs
        (most rows, most steps) are returned as columns, the others get a message each."""
        cols = RowColumns()
        by_row: dict[int, int] = {row: i for i, row in enumerate(self.sampled_rows)}
        # Rows flag prediction drafts only in steps where some row had a prediction.
        flags = out.prediction_drafts
        for row, req_id in enumerate(self.req_ids):
            i = by_row.get(row)
            if i is None:
                cols.req_ids.append(req_id)
                cols.num_tokens.append(0)
                cols.num_drafts.append(0)
                if flags:
                    cols.prediction_drafts.append(False)
                continue
            num_emitted = out.accepted[i] + 1
            wants_top = bool(out.top_ids) and self.num_top[i] > 0
            if not self.want_logprobs[row] and not wants_top:
                cols.req_ids.append(req_id)
                cols.num_tokens.append(num_emitted)
                cols.tokens.extend(out.tokens[i][:num_emitted])
                cols.num_drafts.append(out.drafted[i])
                if flags:
                    cols.prediction_drafts.append(flags[i])
                continue
            entry = result.results.add(
                req_id=req_id,
                token_ids=out.tokens[i][:num_emitted],
                num_draft_tokens=out.drafted[i],
                num_accepted=out.accepted[i],
                prediction_drafts=bool(flags) and flags[i],
            )
            if self.want_logprobs[row]:
                entry.logprobs.extend(out.logprobs[i][:num_emitted])
            if wants_top:
                # Column c holds the distribution the token at column c was drawn from.
                n = self.num_top[i]
                for col in range(num_emitted):
                    entry.top_logprobs.add(token_ids=out.top_ids[i][col][:n], logprobs=out.top_logprobs[i][col][:n])
        return cols


class ResultCopier:
    """Starts each step's device-to-host copy and times steps on the device (CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.accelerator = staging.is_accelerator(device)
        self.stream = torch.cuda.Stream() if device.type == "cuda" else None
        self.last_step_end: Any = None  # CUDA: the latest step's end event while requests were live

    def device_event(self) -> Any:
        """A timing event recorded now on the compute stream (CUDA); None elsewhere."""
        if self.stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record()
        return event

    def start(self, pending: PendingResult) -> None:
        """Start the device-to-host copy of a step's outputs without blocking the next step.

        On CUDA the copy runs on a side stream after the step's kernels and `materialize`
        (on the copier thread) waits for its event; the step thread never waits.
        """
        if not self.accelerator:
            return  # CPU tensors are already on the host; materialize() just reads them
        if self.stream is None:  # an accelerator without streams (the fake test device)
            for name in _OUTPUT_FIELDS:
                t = getattr(pending, name)
                if t is not None:
                    setattr(pending, name, staging.to_host(t))
            return
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for name in _OUTPUT_FIELDS:
                t = getattr(pending, name)
                if t is not None:
                    t.record_stream(self.stream)
                    setattr(pending, name, staging.to_host(t))
            # Blocking: the copier thread sleeps in `synchronize` instead of spinning a core
            # for most of every step (the copy runs after the whole step).
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
        pending.ready = event
