"""A model whose every layer attends a sliding window, through the real services: the scheduler
frees each running request's blocks behind the window, other requests reuse them, and greedy
output stays identical to Hugging Face's `generate`.

The tiny Mistral (random weights, tests/support/tiny_models.py) has a window of 24 tokens and
the worker blocks of 8, so a request holds about 4 blocks plus those its steps in flight write,
whatever its length; every request generates several windows past its prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import assert_matches_reference, bench_rows, hf_reference, prompt_ids, run_workload
from tests.support.metrics_scrape import metric
from tests.support.servers import serving
from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model

pytestmark = pytest.mark.timeout(600)

WINDOW = 24
BLOCK_SIZE = 8
MAX_TOKENS = 128
CHUNK = 64  # prefill chunk: the scheduler's token budget per step
# Bytes of one block: 2 layers x (K, V) x 2 KV heads x 16 dims x float32, per token.
BLOCK_BYTES = BLOCK_SIZE * 2 * 2 * 2 * 16 * 4
ROWS = (0, 3, 4, 7)  # chat rows of 157 to 188 prompt tokens; 0 and 3 are code edits (n-grams draft well)


@pytest.fixture(scope="module")
def mistral_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Mistral, both layers windowed (no `layer_types`), with SmolLM2's tokenizer."""
    from transformers import MistralConfig

    config = MistralConfig(
        vocab_size=tokenizer_vocab_size(smollm2_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("mistral"), config, smollm2_dir, init_std=0.05)


@contextmanager
def peak_kv_usage(metrics_port: int) -> Iterator[list[float]]:
    """The scheduler's KV usage ratio, scraped every 50 ms while the block runs (its peak is
    ``max`` of the list yielded)."""
    seen: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append(metric(metrics_port, "zerobubble_kv_cache_usage_ratio"))
            stop.wait(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def _gib(num_blocks: int) -> float:
    """The worker's KV budget that holds ``num_blocks`` blocks of the tiny model."""
    return (num_blocks + 0.5) * BLOCK_BYTES / (1 << 30)


def _serve_and_check(
    model_dir: Path,
    rows: list[dict[str, Any]],
    worker: dict[str, Any],
    max_tokens: int,
    rounds: int = 1,
    **scheduler: Any,
) -> tuple[dict[str, Any], float, float]:
    """Every row's greedy output, in each of ``rounds`` rounds of the batch, equals Hugging
    Face's and runs several windows past its prompt; the server's stats (of the last round), the
    peak KV usage ratio seen and the prompt tokens served from the prefix cache."""
    reference = hf_reference(model_dir, rows, max_tokens)
    worker = dict(model=str(model_dir), dtype="float32", block_size=BLOCK_SIZE, **worker)
    with serving(worker, **scheduler) as service:
        with peak_kv_usage(service.ports["METRICS"]) as seen:
            for _ in range(rounds):
                report = run_workload(service.target, bench_rows(rows, max_tokens=max_tokens), len(rows))
                assert_matches_reference(report, reference, model_dir, rows, min_identical=len(rows))
                assert all(len(r["token_ids"]) > 3 * WINDOW for r in report["requests"])
        hits = metric(service.ports["METRICS"], "zerobubble_prefix_cache_hits_total")
    return report["server_stats"], max(seen, default=0.0), hits


@pytest.mark.slow  # make test's time: the window's reads are checked by the scheduler and kernel tests
def test_windowed_mistral_matches_hf_async_with_ngram_drafts(
    mistral_dir: Path, grounded_rows: list[dict[str, Any]]
) -> None:
    """The short version: two requests, two plans in flight, n-gram drafts, each request
    generating well past its window; the same batch again hits the prompt blocks that were freed
    behind the window into the prefix cache, and its outputs are the same."""
    rows = [grounded_rows[i] for i in ROWS[:2]]
    worker = dict(kv_cache_memory_gb=_gib(64), max_num_seqs=8, spec_method="ngram", num_spec_tokens=3)
    stats, peak, hits = _serve_and_check(mistral_dir, rows, worker, 3 * WINDOW + 8, rounds=2, max_inflight_steps=2)
    assert stats["num_draft_tokens"] > 0 and stats["num_preemptions"] == 0, stats
    assert peak > 0
    assert hits >= sum(len(p) for p in prompt_ids(mistral_dir, rows)) // 2, hits


@pytest.mark.slow
@pytest.mark.parametrize("max_inflight_steps", [1, 2])
def test_windowed_mistral_matches_hf_with_ngram_drafts_in_bounded_memory(
    mistral_dir: Path, grounded_rows: list[dict[str, Any]], max_inflight_steps: int
) -> None:
    """Four requests batched, sync and async, with n-gram drafts: outputs identical, and the
    KV usage never comes near what the batch would fill without the window."""
    rows = [grounded_rows[i] for i in ROWS]
    num_blocks = 400
    worker = dict(kv_cache_memory_gb=_gib(num_blocks), max_num_seqs=8, spec_method="ngram", num_spec_tokens=3)
    stats, peak, _ = _serve_and_check(
        mistral_dir, rows, worker, MAX_TOKENS, max_inflight_steps=max_inflight_steps, max_num_batched_tokens=CHUNK
    )
    assert stats["num_draft_tokens"] > 0, stats
    # Each request keeps its window, the slots of its steps in flight (a prefill chunk, or
    # 1 + 3 drafts per decode; blocks are freed once their step's result is back, for the prefix
    # cache) and the block being written.
    in_flight = max_inflight_steps * CHUNK
    bound = len(rows) * (-(-(WINDOW + in_flight) // BLOCK_SIZE) + 2)
    prompts = prompt_ids(mistral_dir, rows)
    full = sum(-(-(len(p) + MAX_TOKENS) // BLOCK_SIZE) for p in prompts)  # without the window, at the end
    assert bound < 0.7 * full
    print(f"peak {peak * num_blocks:.0f} blocks, bound {bound}, without the window {full}")
    assert 0 < peak * num_blocks <= bound, (peak * num_blocks, bound, full)


@pytest.mark.slow
def test_windowed_mistral_matches_hf_preempted_in_a_cache_smaller_than_one_request(
    mistral_dir: Path, grounded_rows: list[dict[str, Any]]
) -> None:
    """A cache of a few windows, smaller than any single request's whole sequence, 32-token
    prefill chunks, one plan in flight: requests are preempted and resumed (recomputed chunk by
    chunk, freeing behind the window), and each still generates past the cache's size."""
    rows = [grounded_rows[i] for i in ROWS]
    num_blocks, max_tokens = 16, 128
    worker = dict(kv_cache_memory_gb=_gib(num_blocks), max_num_seqs=8, max_model_len=512)
    stats, _, _ = _serve_and_check(
        mistral_dir, rows, worker, max_tokens, max_inflight_steps=1, max_num_batched_tokens=32
    )
    assert stats["num_preemptions"] > 0, stats
    assert num_blocks * BLOCK_SIZE < min(len(p) for p in prompt_ids(mistral_dir, rows)) + max_tokens
