"""`--simulate-device-ms`: the worker's host path on a simulated device, no model weights.

End to end (real scheduler and worker processes over gRPC on loopback): greedy output must be
identical sync or async, with n-gram speculation on or off, because the simulated tokens are a
function of the sequence and verification is the real one. In-process (the real `Scheduler`
driving the runner): the measured acceptance follows `--simulate-acceptance-rate` as the
module docstring of `worker_svc/simulated.py` predicts.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import grpc
import pytest

from tests.support.drive import make_scheduler, run_job
from tests.support.e2e import bench_rows, run_workload
from tests.support.servers import Service, start_scheduler, start_worker, wait_serving
from zerobubble.api import generate_pb2_grpc
from zerobubble.client import build_request, complete
from zerobubble.config import parse_cores
from zerobubble.request_options import StoppingOptions
from zerobubble.scheduler_svc.scheduler import SchedulerStats
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.worker_svc.server import WorkerConfig, build_runner, tokenizer_fields
from zerobubble.worker_svc.simulated import COPY_LAG

pytestmark = pytest.mark.timeout(600)

K = 3
# Copies (and so accepted drafts) start COPY_LAG = 32 tokens in: at 40 tokens n-gram saved only
# 2-3 of ~48 steps, within the admission jitter, and the fewer-steps check failed about 1 run in 6.
MAX_TOKENS = 96
# Both event loops serve in the identity test below, as workers and as schedulers.
EVENT_LOOP = {"none": "asyncio", "ngram": "auto", 1: "uvloop", 2: "asyncio"}
# And --cpu-affinity: the async schedulers on the last core, the n-gram worker on the others
# (the same core where there is one); the rest unbound. The sync schedulers run their loop
# thread alone on the first core (--loop-cores first) where there are two or more.
_CORES = sorted(os.sched_getaffinity(0))
CPU_AFFINITY = {"none": "", "ngram": ",".join(map(str, _CORES[:-1])) or str(_CORES[-1]), 1: "", 2: str(_CORES[-1])}
LOOP_CORES = {1: "first" if len(_CORES) > 1 else "", 2: ""}


def thread_cores(service: Service) -> dict[int, frozenset[int]]:
    """The cores each thread of the service process may run on, by thread id."""
    out = {}
    for task in Path(f"/proc/{service.proc.pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = parse_cores(line.split(":", 1)[1].strip())
    return out


def assert_bound(service: Service, cpu_affinity: str, loop_cores: str = "") -> None:
    """Every thread of the process (gRPC's included) is on `cpu_affinity` (all cores if empty),
    but for the event loop's (the main thread) on `loop_cores` where that is given, the others
    then on the rest. A thread started since the last sweep (once a second) may still be on the
    loop's cores: wait for the next one."""
    allowed = parse_cores(cpu_affinity) if cpu_affinity else frozenset(_CORES)
    loop = parse_cores(str(min(allowed)) if loop_cores == "first" else loop_cores) if loop_cores else allowed
    others = allowed - loop if loop_cores else allowed
    deadline = time.monotonic() + 5.0
    while True:
        cores = thread_cores(service)
        assert len(cores) > 1  # the loop's thread and gRPC's at least
        main = cores.pop(service.proc.pid)
        if main == loop and all(c == others for c in cores.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert main == loop, (loop_cores, main)
    assert all(c == others for c in cores.values()), (cpu_affinity, loop_cores, cores)


def runs_uvloop(service: Service) -> bool:
    """Whether the service process has loaded uvloop (its event loop when it has)."""
    with open(f"/proc/{service.proc.pid}/maps") as f:
        return "uvloop" in f.read()


@pytest.fixture(scope="module")
def sim_workers():
    workers: dict[str, Service] = {}
    try:
        for spec in ("none", "ngram"):
            workers[spec] = start_worker(
                simulate_device_ms=1.0,
                spec_method=spec,
                num_spec_tokens=K,
                max_num_seqs=16,
                kv_cache_memory_gb=1.0,
                event_loop=EVENT_LOOP[spec],
                cpu_affinity=CPU_AFFINITY[spec],
            )
        yield workers
    finally:
        for worker in workers.values():
            worker.stop()


def test_greedy_output_is_identical_sync_async_and_with_speculation(sim_workers, grounded_rows):
    """The same greedy tokens sync or async, with n-gram drafts or without, on either
    `--event-loop` (the workers and the schedulers below use both), with services bound to
    cores by `--cpu-affinity` or `--loop-cores` or not."""
    rows = bench_rows(grounded_rows[:16], max_tokens=MAX_TOKENS)
    outputs = {}
    reports = {}
    for spec, window in itertools.product(("none", "ngram"), (1, 2)):
        scheduler = start_scheduler(
            [sim_workers[spec]],
            max_inflight_steps=window,
            max_num_seqs=16,
            event_loop=EVENT_LOOP[window],
            cpu_affinity=CPU_AFFINITY[window],
            loop_cores=LOOP_CORES[window],
        )
        try:
            wait_serving(scheduler.target)
            report = run_workload(scheduler.target, rows, concurrency=16)
            assert runs_uvloop(scheduler) == (EVENT_LOOP[window] == "uvloop")
            assert runs_uvloop(sim_workers[spec]) == (EVENT_LOOP[spec] != "asyncio")
            assert_bound(scheduler, CPU_AFFINITY[window], LOOP_CORES[window])
            assert_bound(sim_workers[spec], CPU_AFFINITY[spec])
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


async def _replies(target: str, prompts: list[str], max_tokens: int) -> list[list]:
    """Every reply message of each prompt's stream (greedy, all prompts at once)."""
    out: list[list] = [[] for _ in prompts]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        await asyncio.gather(
            *(
                complete(stub, build_request(prompt=p, max_tokens=max_tokens), timeout=120, on_response=out[i].append)
                for i, p in enumerate(prompts)
            )
        )
    return out


def test_stream_interval_gathers_tokens_without_changing_them(sim_workers):
    """`--stream-interval 5`: the first token goes alone at once, every later message but the
    last carries at least 5 tokens, the last one ends the stream; tokens and text are those of
    `--stream-interval 1`, in far fewer messages."""
    prompts = [f"Request {i}: count the stars over the harbour." for i in range(6)]
    replies = {}
    for interval in (1, 5):
        scheduler = start_scheduler([sim_workers["ngram"]], stream_interval=interval)
        try:
            wait_serving(scheduler.target)
            replies[interval] = asyncio.run(_replies(scheduler.target, prompts, MAX_TOKENS))
        finally:
            scheduler.stop()
    for every, gathered in zip(replies[1], replies[5]):
        assert [t for r in gathered for t in r.token_ids] == [t for r in every for t in r.token_ids]
        assert "".join(r.text for r in gathered) == "".join(r.text for r in every)
        with_tokens = [r for r in gathered if r.token_ids]
        assert len(with_tokens[0].token_ids) <= K + 1  # one step's tokens: not held back
        assert all(len(r.token_ids) >= 5 for r in with_tokens[1:-1])
        assert gathered[-1].finish_reason and not any(r.finish_reason for r in gathered[:-1])
        assert [r.num_output_tokens for r in gathered][-1] == MAX_TOKENS
        assert len(gathered) <= 2 + MAX_TOKENS // 5 < len(every)


def _simulated(rate: float, rows, spec_draft_length: str) -> tuple[dict[str, list[int]], SchedulerStats]:
    """The outputs and the scheduler's figures of ``rows`` (160 tokens each) on a simulated
    device whose drafts are accepted at ``rate``."""
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
    outputs = run_job(runner, requests, window=2, stats=stats, spec_draft_length=spec_draft_length)
    return outputs, stats


def _acceptance(rate: float, rows) -> float:
    # Fixed lengths: adaptive ones would draft less where drafts fail, and skew the measure.
    _, stats = _simulated(rate, rows, "fixed")
    return stats.spec.num_accepted_tokens / stats.spec.num_draft_tokens


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.9])
def test_acceptance_follows_the_configured_rate(grounded_rows, rate: float):
    """Given a match at the copy lag, draft j is accepted with probability rate**j (it needs the
    j tokens before it to be copies as well); so accepted / drafted ~ (r + r^2 + r^3) / 3."""
    measured = _acceptance(rate, grounded_rows[:8])
    expected = sum(rate**j for j in range(1, K + 1)) / K
    assert COPY_LAG > K + 1
    # About 8 x 160 tokens: the binomial spread is a few percent; 0.08 is several sigma.
    assert abs(measured - expected) < 0.08, (rate, measured, expected)


def _mean_slots(stats: SchedulerStats) -> float:
    """Mean draft slots of the decode rows (`draft_lengths` counts them by slots)."""
    counts = stats.spec.draft_lengths
    return sum(n * c for n, c in enumerate(counts)) / max(sum(counts), 1)


def test_adaptive_draft_lengths_follow_each_requests_acceptance(grounded_rows):
    """`--spec-draft-length adaptive` on the simulated device: drafts nearly always accepted
    keep all K slots, drafts accepted 60 % of the time (and so rejected at the deeper positions
    more often than not) get fewer at about the same number of steps, and the tokens are those
    of fixed lengths either way (verification decides them, not the length)."""
    rows = grounded_rows[:4]
    for rate in (0.6, 0.97):
        fixed, fixed_stats = _simulated(rate, rows, "fixed")
        adaptive, stats = _simulated(rate, rows, "adaptive")
        assert adaptive == fixed, rate
        assert fixed_stats.spec.draft_lengths[K] > 0.9 * sum(fixed_stats.spec.draft_lengths)
        assert stats.num_steps_completed <= fixed_stats.num_steps_completed * 1.1, rate
        if rate == 0.97:
            assert stats.spec.draft_lengths[K] > 0.9 * sum(stats.spec.draft_lengths)
        else:
            assert _mean_slots(stats) < _mean_slots(fixed_stats) - 0.3
            assert stats.spec.num_accepted_tokens / stats.spec.num_draft_tokens > (
                fixed_stats.spec.num_accepted_tokens / fixed_stats.spec.num_draft_tokens
            )


def test_kv_usage_counts_each_held_block_once_as_requests_come_and_go():
    """The worker's KV gauge is a count kept as blocks are appended and released: after every
    step it equals the distinct blocks the live requests hold (prefix-shared ones once), and 0
    once they are all gone. Requests share a long prompt prefix (prefix-cache hits) and end at
    different lengths, so blocks are shared, appended and freed while others run."""
    runner, _ = build_runner(
        WorkerConfig(simulate_device_ms=0.0, spec_method="ngram", num_spec_tokens=K, kv_cache_memory_gb=1.0)
    )
    runner.reset()
    sched = make_scheduler(runner, max_num_batched_tokens=256, max_num_seqs=8)
    shared = list(range(1000, 1100))  # 100 tokens: several full blocks to share
    for i in range(6):
        sched.add_request(f"r{i}", shared + [2000 + i] * (3 + i), None, StoppingOptions(max_tokens=20 + 15 * i))
    inflight: list = []
    num_checked = 0
    while sched.has_unfinished() or inflight:
        while len(inflight) < 2 and (plan := sched.schedule()) is not None:
            inflight.append(runner.execute(plan))
            held = set(itertools.chain.from_iterable(info.block_ids for info in runner.slots.values()))
            assert runner.kv_usage() * runner.config.num_blocks == pytest.approx(len(held))
            num_checked += 1
        if not inflight:
            break
        sched.on_step_result(inflight.pop(0).materialize(0.0, runner.num_proposed))
    assert num_checked > 20 and sched.prefix_cache_counters.num_hit_tokens > 0
    runner.reset()
    assert runner.kv_usage() == 0.0
