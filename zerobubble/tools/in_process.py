"""A scheduler and a runner in one process, joined as a worker link joins them over gRPC.

For what measures or tests the step logic without the transport (`scripts/bench_sim.py logic`,
the in-process tests): the real `Scheduler`, configured from the runner's `WorkerInfo` and
tokenizer exactly as `WorkerLink` configures it from `Describe`.
"""

from __future__ import annotations

import random

from zerobubble.scheduler_svc.scheduler import Scheduler, SchedulerConfig
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.worker_svc.runner import ModelRunner, worker_info
from zerobubble.worker_svc.server import tokenizer_fields


def make_scheduler(
    runner: ModelRunner,
    *,
    num_blocks: int = 0,
    num_spec_tokens: int | None = None,
    tokenizer: Tokenizer | None = None,
    **policy,
) -> Scheduler:
    """The real Scheduler for `runner` (`policy`: `SchedulerConfig` fields; `num_blocks` and
    `num_spec_tokens` override what the runner reports; `tokenizer` replaces the model's, for
    random-weight models that have none)."""
    info = worker_info(runner)
    if num_blocks:
        info.num_blocks = num_blocks
    if num_spec_tokens is not None:
        info.num_spec_tokens = num_spec_tokens
    if tokenizer is None:
        fields = tokenizer_fields(runner.loaded.path)
        tokenizer = Tokenizer(
            fields["tokenizer_json"], fields["chat_template"], fields["bos_token"], fields["eos_token"]
        )
    return Scheduler(SchedulerConfig(**policy).with_worker(info), tokenizer, rng=random.Random(0))
