"""Faults a test asks a worker to inject, through one object handed to it at construction.

Production workers get `NO_FAULTS`, which injects nothing: the step's row check runs unwrapped
(`checked_rows`). The
chaos and multi-worker suites start real worker processes, so they ask for faults through the
environment (`faults_from_env`); in-process tests pass their own `FaultInjector`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from zerobubble.api import worker_pb2
from zerobubble.rows import plan_rows
from zerobubble.worker_svc.result_copy import CopyDone, PendingResult
from zerobubble.worker_svc.slot_table import RunnableRows

logger = logging.getLogger(__name__)

# Every N-th decode row fails (its request ends with ERROR, the rest of its step runs).
FAIL_EVERY_NTH_DECODE_ROW_ENV = "ZEROBUBBLE_TEST_FAIL_EVERY_NTH_DECODE_ROW"
# The result copy of the N-th step of each stream fails as CUDA reports a kernel fault.
DEVICE_FAULT_AT_STEP_ENV = "ZEROBUBBLE_TEST_DEVICE_FAULT_AT_STEP"


class FaultInjector(Protocol):
    """Where a worker lets a test break it: a whole step, single rows, or a result copy."""

    def step_fault(self, plan: worker_pb2.StepPlan) -> None:
        """Called as a step starts; raising fails the whole step, as a crash in the model would."""
        ...

    def row_faults(self, plan: worker_pb2.StepPlan) -> Mapping[str, str] | None:
        """Rows of ``plan`` to reject (request id -> why); each fails alone, the rest of the
        step runs. None injects nothing; a mapping, even an empty one, makes the runner check
        every row on its own instead of the decode columns at once."""
        ...

    def copy_fault(self, step_number: int) -> CopyDone | None:
        """A copy event that stands in for the ``step_number``-th (from 1, per stream) step's
        own, whose wait raises; None leaves the step alone."""
        ...


class NoFaults:
    """The production injector: nothing is injected."""

    def step_fault(self, plan: worker_pb2.StepPlan) -> None:
        return None

    def row_faults(self, plan: worker_pb2.StepPlan) -> Mapping[str, str] | None:
        return None

    def copy_fault(self, step_number: int) -> CopyDone | None:
        return None


NO_FAULTS = NoFaults()


class InjectedDeviceFault:
    """A step's copy event whose wait raises the error CUDA gives after an illegal access."""

    def synchronize(self) -> None:
        raise RuntimeError(
            f"CUDA error: an illegal memory access was encountered (injected: {DEVICE_FAULT_AT_STEP_ENV})"
        )


class EnvFaults:
    """The faults of `FAIL_EVERY_NTH_DECODE_ROW_ENV` and `DEVICE_FAULT_AT_STEP_ENV` (0: off)."""

    def __init__(self, every_nth_decode_row: int, device_fault_at_step: int) -> None:
        self.every_nth_decode_row = every_nth_decode_row
        self.device_fault_at_step = device_fault_at_step
        self.num_decode_rows = 0

    def step_fault(self, plan: worker_pb2.StepPlan) -> None:
        return None

    def row_faults(self, plan: worker_pb2.StepPlan) -> Mapping[str, str] | None:
        every = self.every_nth_decode_row
        if every <= 0:
            return None
        faults: dict[str, str] = {}
        for row in plan_rows(plan):
            if row.token_ids:
                continue
            self.num_decode_rows += 1
            if self.num_decode_rows % every == 0:
                faults[row.req_id] = f"request {row.req_id}: injected test fault (every {every}th decode row)"
        return faults

    def copy_fault(self, step_number: int) -> CopyDone | None:
        return InjectedDeviceFault() if step_number == self.device_fault_at_step else None


RowCheck = Callable[[worker_pb2.StepPlan], RunnableRows]


def checked_rows(runnable: Callable[..., RunnableRows], faults: FaultInjector) -> RowCheck:
    """The step's row check (`SlotTable.runnable`) with a test's step and row faults wrapped
    around it; the check itself for `NO_FAULTS`, so a production step runs no fault code."""
    if faults is NO_FAULTS:
        return runnable

    def check(plan: worker_pb2.StepPlan) -> RunnableRows:
        faults.step_fault(plan)
        return runnable(plan, faults.row_faults(plan))

    return check


CopyJob = Callable[[PendingResult, float, float], None]


def with_copy_faults(copy_job: CopyJob, faults: FaultInjector) -> CopyJob:
    """A stream's copy job (run on its copier thread, once per step in order) with a test's copy
    faults wrapped around it: the N-th step's copy event replaced by `FaultInjector.copy_fault`'s;
    the job itself for `NO_FAULTS`, so a production step runs no fault code."""
    if faults is NO_FAULTS:
        return copy_job
    num_steps = 0

    def job(pending: PendingResult, idle_s: float, collective_s: float) -> None:
        nonlocal num_steps
        num_steps += 1
        injected = faults.copy_fault(num_steps)
        copy_job(pending if injected is None else dataclasses.replace(pending, ready=injected), idle_s, collective_s)

    return job


def faults_from_env(env: Mapping[str, str]) -> FaultInjector:
    """The injector the environment asks for: `NO_FAULTS` unless a test variable is set."""
    every = int(env.get(FAIL_EVERY_NTH_DECODE_ROW_ENV, "0") or 0)
    at_step = int(env.get(DEVICE_FAULT_AT_STEP_ENV, "0") or 0)
    if every <= 0 and at_step <= 0:
        return NO_FAULTS
    if every > 0:
        logger.warning(
            "TEST FAULT INJECTION ON: every %dth decode row fails (%s)", every, FAIL_EVERY_NTH_DECODE_ROW_ENV
        )
    if at_step > 0:
        logger.warning("TEST FAULT INJECTION ON: step %d's result copy fails (%s)", at_step, DEVICE_FAULT_AT_STEP_ENV)
    return EnvFaults(every, at_step)
