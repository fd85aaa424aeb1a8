"""Finish notices seen ahead of their plan's turn, and whether the running step is moot.

A finish notice in plan M means the scheduler has finished, preempted or aborted that request:
the rows it has in earlier plans produce results it discards as stale. A step all of whose rows
are such rows is cut short (before the forward, or between layers); its result has no rows. At
concurrency 1 in async mode this is the step planned ahead of an EOS, which would otherwise hold
the next request's prefill back by up to a whole step. Steps still run strictly in order, and
admissions and block appends of a cut step are applied as usual (later plans may rely on them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from zerobubble.api import worker_pb2


class FinishNotices:
    """Request id -> step id of the latest received plan whose finish notices name it.

    Written by the thread that receives plans (possibly mid-step), read by the step thread.
    """

    def __init__(self) -> None:
        self.finished_in: dict[str, int] = {}
        self._lock = threading.Lock()
        self.current: tuple[int, list[str]] | None = None  # (step id, rows) of the running step
        self.num_cut_steps = 0  # steps cut short because a later plan finished all their rows
        self.num_cut_drafts = 0  # draft chains cut short the same way

    def note(self, plan: worker_pb2.StepPlan) -> None:
        """Record a just-received plan's finish notices, before the plans ahead of it run."""
        if not plan.finished_req_ids:
            return
        with self._lock:
            for req_id in plan.finished_req_ids:
                self.finished_in[req_id] = plan.step_id

    def clear(self) -> None:
        """Forget every notice (a new stream numbers its steps from 1 again)."""
        with self._lock:
            self.finished_in.clear()

    def moot(self) -> bool:
        """Whether a later plan has finished every row of the running step (`current`)."""
        current = self.current
        if current is None or not self.finished_in:
            return False
        step_id, req_ids = current
        finished_in = self.finished_in
        return bool(req_ids) and all(finished_in.get(req_id, -1) > step_id for req_id in req_ids)

    @contextmanager
    def running(self, step_id: int, req_ids: list[str]) -> Iterator[None]:
        """Marks the step (or the drafts after it) whose rows `moot` checks while it runs."""
        self.current = (step_id, req_ids)
        try:
            yield
        finally:
            self.current = None

    def forget_before(self, step_id: int) -> None:
        """Drop notices of plans up to ``step_id``: no step before them is left to run."""
        if not self.finished_in:
            return
        with self._lock:
            for req_id in [r for r, s in self.finished_in.items() if s <= step_id]:
                del self.finished_in[req_id]
