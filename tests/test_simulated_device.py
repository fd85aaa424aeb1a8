"""`--simulate-device-ms`: the worker's host path on a simulated device, no model weights.

End to end (real scheduler and worker processes over gRPC on loopback): greedy output must be
identical sync or async, with n-gram speculation on or off, because the simulated tokens are a
function of the sequence and verification is the real one. In-process (the real `Scheduler`
driving the runner): the measured acceptance follows `--simulate-acceptance-rate` as the
module docstring of `worker_svc/simulated.py` predicts.
"""

from __future__ import annotations

import itertools

import pytest

from scheduler_svc.scheduler import SchedulerStats
from scheduler_svc.tokenizer import Tokenizer
from tests.drive import run_job
from tests.e2e import bench_rows, run_workload
from tests.servers import Service, start_scheduler, start_worker, wait_serving
from worker_svc.server import WorkerConfig, build_runner, tokenizer_fields
from worker_svc.simulated import COPY_LAG

pytestmark = pytest.mark.timeout(600)

K = 3
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def sim_workers():
    workers: dict[str, Service] = {}
    try:
        for spec in ("none", "ngram"):
            workers[spec] = start_worker(
                simulate_device_ms=1.0, spec_method=spec, num_spec_tokens=K, max_num_seqs=16, kv_cache_memory_gb=1.0
            )
        yield workers
    finally:
        for worker in workers.values():
            worker.stop()


def test_greedy_output_is_identical_sync_async_and_with_speculation(sim_workers, grounded_rows):
    rows = bench_rows(grounded_rows[:16], max_tokens=MAX_TOKENS)
    outputs = {}
    reports = {}
    for spec, window in itertools.product(("none", "ngram"), (1, 2)):
        scheduler = start_scheduler([sim_workers[spec]], max_inflight_steps=window, max_num_seqs=16)
        try:
            wait_serving(scheduler.target)
            report = run_workload(scheduler.target, rows, concurrency=16)
        finally:
            scheduler.stop()
        assert report["num_errors"] == 0, report["finish_reasons"]
        # The token function never produces EOS or another special token.
        assert report["finish_reasons"] == {"max_tokens": len(rows)}
        outputs[spec, window] = [r["token_ids"] for r in report["requests"]]
        reports[spec, window] = report
    baseline = outputs["none", 1]
    assert all(len(ids) == MAX_TOKENS for ids in baseline)
    for config, ids in outputs.items():
        assert ids == baseline, f"{config} differs from sync without speculation"
    for window in (1, 2):
        report = reports["ngram", window]
        # Drafts were proposed and some, not all, accepted: the speculation path really ran.
        assert 0.0 < report["acceptance_rate"] < 1.0
        assert report["server_stats"]["num_steps"] < reports["none", window]["server_stats"]["num_steps"]


def _acceptance(rate: float, rows) -> float:
    runner, loaded = build_runner(
        WorkerConfig(
            simulate_device_ms=0.0,
            spec_method="ngram",
            num_spec_tokens=K,
            max_num_seqs=16,
            kv_cache_memory_gb=1.0,
            simulate_acceptance_rate=rate,
        )
    )
    fields = tokenizer_fields(loaded.path)
    tokenizer = Tokenizer(fields["tokenizer_json"], fields["chat_template"], fields["bos_token"], fields["eos_token"])
    requests = [
        (f"r{i}", tokenizer.apply_chat_template(row["messages"]), dict(max_tokens=160)) for i, row in enumerate(rows)
    ]
    stats = SchedulerStats()
    run_job(runner, requests, window=2, stats=stats)
    return stats.num_accepted_tokens / stats.num_draft_tokens


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.9])
def test_acceptance_follows_the_configured_rate(grounded_rows, rate: float):
    """Given a match at the copy lag, draft j is accepted with probability rate**j (it needs the
    j tokens before it to be copies as well); so accepted / drafted ~ (r + r^2 + r^3) / 3."""
    measured = _acceptance(rate, grounded_rows[:8])
    expected = sum(rate**j for j in range(1, K + 1)) / K
    assert COPY_LAG > K + 1
    # About 8 x 160 tokens: the binomial spread is a few percent; 0.08 is several sigma.
    assert abs(measured - expected) < 0.08, (rate, measured, expected)
