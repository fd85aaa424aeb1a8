"""Families beyond Llama through the real services: a random-weight Gemma 3 served by a worker and
a scheduler process, greedy output identical to Hugging Face's `generate`.

The tiny model (tests/support/tiny_models.py) alternates sliding and full layers with a window of
16 tokens, far shorter than the chat prompts, so every row runs past its window; the scheduler
keeps two plans in flight and the worker drafts with n-grams, so drafts are verified in windowed
layers too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import assert_matches_reference, bench_rows, hf_reference, run_workload
from tests.support.servers import serving
from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 32
# Chat rows with short prompts (prefill dominates on CPU): code edits, where n-grams draft well,
# and open questions.
ROWS = (0, 3, 24, 27)
WINDOW = 16


@pytest.fixture(scope="module")
def gemma3_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer Gemma 3 (sliding, sliding, full; each kind with its own RoPE base) with the
    embedded SmolLM2's tokenizer and special tokens. Its tied embeddings at this spread make it
    repeat a token a few times, then change: n-gram drafts are accepted and rejected."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=tokenizer_vocab_size(smollm2_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("gemma3"), config, smollm2_dir, init_std=0.05)


def test_gemma3_greedy_matches_hf_async_with_ngram_drafts(
    gemma3_dir: Path, grounded_rows: list[dict[str, Any]]
) -> None:
    rows = [grounded_rows[i] for i in ROWS]
    worker = dict(
        model=str(gemma3_dir), dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=8, spec_method="ngram",
        num_spec_tokens=3,
    )  # fmt: skip
    stats = _check_greedy(gemma3_dir, rows, worker, max_inflight_steps=2)
    # Drafts both accepted and rejected (the model's runs of one token, then a change).
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats


@pytest.mark.slow
def test_gemma3_greedy_matches_hf_sync_preempted_with_chunked_prefill(
    gemma3_dir: Path, grounded_rows: list[dict[str, Any]]
) -> None:
    """About 24 KV blocks for 4 requests of 7 to 14 blocks each and 64-token prefill chunks,
    one plan in flight: requests are preempted and resumed (their windowed layers recomputed
    from the prompt), outputs stay Hugging Face's."""
    rows = [grounded_rows[i] for i in ROWS]
    worker = dict(model=str(gemma3_dir), dtype="float32", kv_cache_memory_gb=0.0003, max_model_len=320)
    stats = _check_greedy(gemma3_dir, rows, worker, max_inflight_steps=1, max_num_batched_tokens=64)
    assert stats["num_preemptions"] > 0, stats


@pytest.mark.slow
def test_gemma3_greedy_matches_hf_drafting_for_itself(gemma3_dir: Path, grounded_rows: list[dict[str, Any]]) -> None:
    """The same model as its own draft model, two plans in flight: every draft accepted."""
    rows = [grounded_rows[i] for i in ROWS]
    worker = dict(
        model=str(gemma3_dir), dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=8, spec_method="draft",
        draft_model=str(gemma3_dir), num_spec_tokens=3,
    )  # fmt: skip
    stats = _check_greedy(gemma3_dir, rows, worker, max_inflight_steps=2)
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"], stats


def _check_greedy(
    model_dir: Path, rows: list[dict[str, Any]], worker: dict[str, Any], **scheduler: Any
) -> dict[str, Any]:
    """Every row's greedy output through a worker and a scheduler equals Hugging Face's; the
    server's stats."""
    reference = hf_reference(model_dir, rows, MAX_TOKENS)
    with serving(worker, **scheduler) as service:
        report = run_workload(service.target, bench_rows(rows, max_tokens=MAX_TOKENS), concurrency=len(rows))
    assert_matches_reference(report, reference, model_dir, rows, min_identical=len(rows))
    stats: dict[str, Any] = report["server_stats"]
    return stats
