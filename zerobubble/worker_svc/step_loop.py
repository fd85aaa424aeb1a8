"""One scheduler stream's plans through the runner: three loops and a result copier.

Plans arrive on the `Execute` stream (`StepLoop.read_plans`, on the event loop) and run strictly
in order on the device thread (`StepLoop.run_steps`). While a step runs, the next plans are
already queued (async scheduling), and the host copy of the previous step's results happens on
the copier thread (`run_jobs`), so the device never waits for the host. The answers go back to
the stream in plan order (`StepLoop.answers`). The time the step thread spends waiting for a
plan while requests are live is the bubble; it is reported with every result.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from zerobubble.api import worker_pb2
from zerobubble.rows import plan_req_ids
from zerobubble.worker_svc.faults import with_copy_faults
from zerobubble.worker_svc.parallel import RankLost
from zerobubble.worker_svc.result_copy import PendingResult
from zerobubble.worker_svc.runner import ModelRunner

logger = logging.getLogger(__name__)

# Ends a stream: put on the plan queue by the reader (or the servicer), passed on to the answers.
END = object()

DeviceFaultHandler = Callable[[BaseException], None]


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is the accelerator failing (a kernel fault, after which a CUDA context
    refuses all further work), not one step's bad input or a bug in its host code."""
    if isinstance(exc, RankLost):  # a tensor-parallel rank is gone: no step can run without it
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return "CUDA error" in str(exc)


def run_step(
    runner: ModelRunner, plan: worker_pb2.StepPlan, on_device_fault: DeviceFaultHandler | None = None
) -> PendingResult | worker_pb2.StepResult:
    """Execute one plan; a step that raises becomes an error result and the worker goes on.

    The failed step's requests lose their state (none stays half admitted) and are remembered,
    so plans already sent that hold rows for them answer those rows with a per-request error
    instead of failing as a whole; their co-batched requests in those plans are unaffected.
    A device fault goes to ``on_device_fault`` instead (when given): nothing more can run.
    """
    try:
        return runner.execute(plan)
    except Exception as exc:
        error = fail_step(runner, plan_req_ids(plan), exc, on_device_fault, f"step {plan.step_id}")
        return worker_pb2.StepResult(step_id=plan.step_id, error=error)


def run_proposer(runner: ModelRunner, req_ids: list[str], on_device_fault: DeviceFaultHandler | None = None) -> None:
    """The drafts a step left to make (`ModelRunner.propose_next`), after its result was handed
    on. If they fail, the step's requests fail as a failed step's would (their result already
    went out): later plans answer their rows with a per-request error."""
    try:
        runner.propose_next()
    except Exception as exc:
        fail_step(runner, req_ids, exc, on_device_fault, "the drafts after a step")


def fail_step(
    runner: ModelRunner, req_ids: list[str], exc: Exception, on_device_fault: DeviceFaultHandler | None, what: str
) -> str:
    """What a raising step (or its drafts) does to its requests: a device fault goes to
    ``on_device_fault``; otherwise they lose their state, later rows for them get the returned
    error, and the worker goes on."""
    if on_device_fault is not None and is_device_fault(exc):
        on_device_fault(exc)
    logger.exception("%s failed", what)
    error = f"step failed: {exc}"
    runner.fail_requests(req_ids, error)
    return error


def materialize_result(
    pending: PendingResult, idle_s: float, num_spec_tokens: int, on_device_fault: DeviceFaultHandler | None = None
) -> worker_pb2.StepResult:
    """A step's wire result once its copy is done (on the copier thread), or an error result.

    On CUDA the step thread only launches work, so a fault in a step's kernels (an illegal
    access, a device-side assert) usually surfaces here, at the wait for the copy. Raised on the
    copier thread it would be lost and the step never answered: the scheduler would wait for
    its step deadline while this worker still looked healthy. Answered with an error, the
    scheduler ends the step's requests with ERROR at once. A device fault goes to
    ``on_device_fault`` instead (when given).
    """
    try:
        return pending.materialize(idle_s, num_spec_tokens)
    except Exception as exc:
        if on_device_fault is not None and is_device_fault(exc):
            on_device_fault(exc)
        logger.exception("step %d: reading its result failed", pending.step_id)
        return worker_pb2.StepResult(step_id=pending.step_id, error=f"reading the step's result failed: {exc}")


def run_jobs(jobs: queue.SimpleQueue) -> None:
    """Run each (function, args) from ``jobs`` in order until None; a failing job is logged and
    the next one runs (a copy's own failures are answered by `materialize_result`)."""
    while (job := jobs.get()) is not None:
        function, args = job
        try:
            function(*args)
        except Exception:
            logger.exception("the result copier's job failed")


class StepLoop:
    """The plans of one `Execute` stream run in order, their answers returned in order.

    ``still_current`` says whether the stream is still the servicer's newest (a newer stream
    supersedes it: the reader stops). ``deliver`` may be called from any thread to put an
    answer (or `END`) into the stream.
    """

    def __init__(
        self, runner: ModelRunner, on_device_fault: DeviceFaultHandler, still_current: Callable[[], bool]
    ) -> None:
        self.runner = runner
        self.on_device_fault = on_device_fault
        self.still_current = still_current
        self.plans: queue.SimpleQueue = queue.SimpleQueue()  # C-level: no Python lock and condition per plan
        self.answers_queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        # The result copier: each step's host copy waits here, off the step thread. A bare
        # thread on a C-level queue: an executor's submit (a Future, its Condition, the pool's
        # locks) costs the caller tens of times the CPU of a SimpleQueue's put, on the step
        # thread's critical path (docs/benchmarks/host.md, "What a message costs").
        self.copies: queue.SimpleQueue = queue.SimpleQueue()  # (function, args); None ends the thread
        self._copier = threading.Thread(target=run_jobs, args=(self.copies,), name="d2h", daemon=True)
        # What the copier runs for each step (a test's copy faults wrapped around it).
        self._copy_job = with_copy_faults(self._materialize_and_deliver, runner.faults)
        self.num_inflight = 0  # plans received and not yet answered

    def deliver(self, item: Any) -> None:
        """Put an answer into the stream (from any thread)."""
        self._loop.call_soon_threadsafe(self.answers_queue.put_nowait, item)

    def _materialize_and_deliver(self, pending: PendingResult, idle_s: float, collective_s: float) -> None:
        result = materialize_result(pending, idle_s, self.runner.num_proposed, self.on_device_fault)
        result.collective_s = collective_s
        self.deliver(result)

    def start_copier(self) -> None:
        self._copier.start()

    def stop_copier(self) -> None:
        """End the copier thread once every queued copy is done."""
        self.copies.put(None)
        self._copier.join()

    def run_steps(self) -> None:
        """The device thread: run each plan as it comes, until `END`."""
        runner = self.runner
        while True:
            live = bool(runner.slots)
            t0 = time.perf_counter()
            plan = self.plans.get()
            # Waiting with live requests is the bubble; waiting with none is just no work.
            idle = time.perf_counter() - t0 if live else 0.0
            if plan is END:
                self.copies.put((self.deliver, (END,)))
                return
            pending = run_step(runner, plan, self.on_device_fault)
            if isinstance(pending, worker_pb2.StepResult):
                self.copies.put((self.deliver, (pending,)))
                continue
            collective_s = runner.collective_seconds()  # this step's (drafts run no collective)
            # The host copy overlaps the next step: it happens on the copier thread.
            self.copies.put((self._copy_job, (pending, idle, collective_s)))
            run_proposer(runner, pending.req_ids, self.on_device_fault)

    async def read_plans(self, request_iterator: AsyncIterator[worker_pb2.StepPlan]) -> None:
        """The event loop: queue each plan the stream brings, until it ends or is superseded."""
        try:
            async for plan in request_iterator:
                if not self.still_current():
                    break
                self.num_inflight += 1
                # Seen now, not when the plan's turn comes: the step running meanwhile may
                # be one this plan's finish notices make moot.
                self.runner.note_finished(plan)
                self.runner.prefetch_grammars(plan)
                self.plans.put(plan)
        finally:
            self.plans.put(END)

    async def answers(self) -> AsyncIterator[worker_pb2.StepResult]:
        """Every answer in order, until `END`; a plan's answer counts it out of ``num_inflight``
        (a step_id 0 notice answers no plan)."""
        while True:
            item = await self.answers_queue.get()
            if item is END:
                return
            if item.step_id != 0:
                self.num_inflight -= 1
            yield item
