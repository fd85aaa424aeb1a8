"""A tensor-parallel worker through the real services: greedy output identical to Hugging Face,
and a lost rank ends the worker while its requests finish on another worker.

The worker's leader starts its other ranks (gloo on loopback, one torch thread each), hands
them every plan, and alone answers the scheduler (zerobubble/worker_svc/ranks.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import assert_matches_reference, bench_rows, hf_reference, run_workload
from tests.support.metrics_scrape import scrape, total
from tests.support.polling import wait_until
from tests.support.servers import serving, start_scheduler, start_worker, wait_serving
from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model
from tests.support.tp_ranks import alive, rank_children

pytestmark = pytest.mark.timeout(900)

# Code edits and grounded QA rows with the shorter prompts (tests/services/test_async_spec_e2e.py).
ROWS = (0, 3, 4, 7, 9, 13)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_llama(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama (4 query heads, 2 KV heads) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=tokenizer_vocab_size(smollm2_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tp") / "llama", config, smollm2_dir, init_std=0.15)


def greedy_through_services(model_dir: Path, rows: list[dict[str, Any]], **worker: Any) -> tuple[dict[str, Any], list]:
    """The rows' greedy outputs from a worker with these settings under an async scheduler,
    and the scheduler's metrics after them."""
    options = dict(model=str(model_dir), kv_cache_memory_gb=0.1, max_num_seqs=8, metrics_port=0, **worker)
    with serving(options, max_inflight_steps=2) as scheduler:
        report = run_workload(scheduler.target, bench_rows(rows, MAX_TOKENS), concurrency=len(rows))
        return report, scrape(scheduler.ports["METRICS"])


def test_two_ranks_with_ngram_drafts_match_hf(tiny_llama: Path, grounded_rows: list[dict[str, Any]]) -> None:
    rows = [grounded_rows[i] for i in ROWS[:4]]
    report, metrics = greedy_through_services(tiny_llama, rows, tensor_parallel_size=2, spec_method="ngram")
    reference = hf_reference(tiny_llama, rows, MAX_TOKENS)
    assert_matches_reference(report, reference, tiny_llama, rows, min_identical=len(rows))
    assert total(metrics, "zerobubble_worker_tensor_parallel_size") == 2
    steps = total(metrics, "zerobubble_worker_step_duration_seconds_count")
    collective_s = total(metrics, "zerobubble_worker_collective_seconds_total")
    assert 0 < collective_s < total(metrics, "zerobubble_worker_step_duration_seconds_sum"), (collective_s, steps)
    print(f"collectives: {1e3 * collective_s / steps:.2f} ms per step over {steps:.0f} steps")


@pytest.mark.slow
def test_smollm2_three_ranks_with_ngram_drafts_match_hf(smollm2_dir: Path, grounded_rows: list[dict[str, Any]]) -> None:
    """9 query heads and 3 KV heads over 3 ranks, in float32, async, with n-gram drafts."""
    rows = [grounded_rows[i] for i in ROWS]
    report, _ = greedy_through_services(smollm2_dir, rows, tensor_parallel_size=3, spec_method="ngram")
    reference = hf_reference(smollm2_dir, rows, MAX_TOKENS)
    assert_matches_reference(report, reference, smollm2_dir, rows, min_identical=len(rows))


@pytest.mark.slow
def test_a_killed_rank_ends_its_worker_and_the_requests_finish_elsewhere(
    tiny_llama: Path, grounded_rows: list[dict[str, Any]]
) -> None:
    """Size 4 (KV heads replicated): one rank SIGKILLed while requests run ends the leader
    with status 71 and no rank left behind; the scheduler moves the requests to the other
    worker, and every output is still Hugging Face's."""
    rows = [grounded_rows[i] for i in ROWS]
    options = dict(model=str(tiny_llama), kv_cache_memory_gb=0.1, max_num_seqs=8, metrics_port=0)
    group = start_worker(**options, tensor_parallel_size=4)
    other = start_worker(**options)
    scheduler = start_scheduler([group, other], max_inflight_steps=2)
    try:
        wait_serving(scheduler.target)
        ranks = rank_children(group.proc.pid)
        assert len(ranks) == 3, ranks
        report: dict[str, Any] = {}

        async def run_and_kill() -> None:
            job = asyncio.create_task(
                asyncio.to_thread(run_workload, scheduler.target, bench_rows(rows, 48), len(rows))
            )
            await asyncio.to_thread(
                wait_until,
                lambda: total(scrape(group.ports["METRICS"]), "zerobubble_worker_step_duration_seconds_count") >= 3,
                60,
                "steps on the group",
            )
            signal_at = time.monotonic()
            os.kill(ranks[1], signal.SIGKILL)
            status = await asyncio.to_thread(group.proc.wait, 30)
            report["status"], report["exit_s"] = status, time.monotonic() - signal_at
            report["workload"] = await job

        asyncio.run(run_and_kill())
        assert report["status"] == 71, "".join(group.log[-30:])
        # Whichever sees it first: the leader's watch of its ranks, or a collective failing.
        log = "".join(group.log)
        assert "exited with status -9: the worker cannot step without it" in log or "group lost" in log, log[-3000:]
        assert report["exit_s"] < 5, report["exit_s"]
        wait_until(lambda: not any(alive(pid) for pid in ranks), 10, "the ranks to be gone")
        assert "re-queueing" in "".join(scheduler.log), "the group held no request: the test proved nothing"
        reference = hf_reference(tiny_llama, rows, 48)
        assert_matches_reference(report["workload"], reference, tiny_llama, rows, min_identical=len(rows))
    finally:
        scheduler.stop()
        other.stop()
        group.kill()


@pytest.mark.slow
def test_smollm2_three_ranks_with_an_eagle_head_and_json_schemas_match_one_rank(
    smollm2_dir: Path, eagle_head_dir: Path, grounded_rows: list[dict[str, Any]]
) -> None:
    """EAGLE drafts (the head whole on every rank, over the all-reduced hidden states) and
    JSON-schema constraints (each rank's own grammar masks): every rank reaches the same
    tokens, so the group's output is one rank's, token for token."""
    shipped = Path(__file__).resolve().parents[2] / "zerobubble" / "workloads" / "structured.jsonl"
    structured = [json.loads(line) for line in shipped.read_text().splitlines() if line.strip()]
    rows = [*structured[:3], *(grounded_rows[i] for i in ROWS[:3])]
    outputs = [
        greedy_through_services(
            smollm2_dir, rows, tensor_parallel_size=size, spec_method="eagle", draft_model=str(eagle_head_dir)
        )[0]
        for size in (1, 3)
    ]
    single, group = ([r["token_ids"] for r in report["requests"]] for report in outputs)
    assert all(r["finish_reason"] in ("eos", "max_tokens") for r in outputs[1]["requests"]), outputs[1]["requests"]
    assert group == single


@pytest.mark.slow
def test_ranks_never_outlive_a_killed_leader(tiny_llama: Path) -> None:
    """SIGKILL leaves the leader no chance to stop its ranks: they die with it (PR_SET_PDEATHSIG)."""
    group = start_worker(model=str(tiny_llama), kv_cache_memory_gb=0.05, tensor_parallel_size=2)
    try:
        ranks = rank_children(group.proc.pid)
        assert len(ranks) == 1, ranks
    finally:
        group.kill()
    wait_until(lambda: not any(alive(pid) for pid in ranks), 10, "the ranks to die with their leader")


def test_a_stopped_worker_stops_its_ranks(tiny_llama: Path) -> None:
    """SIGTERM: the leader drains, tells its ranks to stop, and exits 0 after them."""
    group = start_worker(model=str(tiny_llama), kv_cache_memory_gb=0.05, tensor_parallel_size=2, drain_timeout=0)
    ranks = rank_children(group.proc.pid)
    assert len(ranks) == 1, ranks
    assert group.stop() == 0, "".join(group.log[-30:])
    assert not any(alive(pid) for pid in ranks)
