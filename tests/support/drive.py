"""Drive a `ModelRunner` in-process with the real `Scheduler`, results one or more plans late,
exactly as the worker link does over the network (no gRPC)."""

from __future__ import annotations

from tests.support.options import split_options
from zerobubble.scheduler_svc.scheduler import SchedulerStats
from zerobubble.tools.in_process import make_scheduler
from zerobubble.worker_svc.runner import ModelRunner


def run_job(
    runner: ModelRunner,
    requests: list[tuple[str, list[int], dict]],
    *,
    window: int = 2,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 64,
    stats: SchedulerStats | None = None,
    num_blocks: int = 0,
    spec_draft_length: str = "adaptive",
) -> dict[str, list[int]]:
    """Run requests to completion through Scheduler + runner; returns req_id -> output ids.

    ``stats``: filled with the scheduler's figures at the end (steps, drafts, acceptances).
    ``num_blocks``: the KV blocks the scheduler may hand out (0: the runner's), fewer to force
    preemptions. ``spec_draft_length``: the scheduler's `--spec-draft-length`.
    """
    scheduler = make_scheduler(
        runner,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        spec_draft_length=spec_draft_length,
    )
    runner.reset()
    for req_id, ids, params in requests:
        scheduler.add_request(req_id, ids, *split_options(params))
    outputs: dict[str, list[int]] = {req_id: [] for req_id, _, _ in requests}
    inflight = []
    while scheduler.has_unfinished() or inflight:
        while len(inflight) < window and (plan := scheduler.schedule()) is not None:
            inflight.append(runner.execute(plan))
        if not inflight:
            break
        result = inflight.pop(0).materialize(0.0, runner.num_proposed)
        assert not result.error, result.error
        for ev in scheduler.on_step_result(result):
            outputs[ev.req_id].extend(ev.token_ids)
    if stats is not None:
        for name in SchedulerStats.__slots__:
            setattr(stats, name, getattr(scheduler.stats, name))
    return outputs
