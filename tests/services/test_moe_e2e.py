"""A mixture of experts through the real services: a random-weight Qwen3-MoE directory (built from
its own Hugging Face config, tests/support/tiny_models.py) served by a worker and a scheduler
process, async (two plans in flight) with n-gram drafts, greedy output identical to Hugging
Face's ``generate`` in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.e2e import assert_matches_reference, bench_rows, hf_reference, run_workload
from tests.support.servers import serving
from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model

pytestmark = pytest.mark.timeout(600)

ROWS = (24, 27, 40, 43)  # short prompts of the grounded workload
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    from transformers import Qwen3MoeConfig

    tokens = json.loads((smollm2_dir / "config.json").read_text())
    config = Qwen3MoeConfig(
        vocab_size=tokenizer_vocab_size(smollm2_dir), hidden_size=64, intermediate_size=96, head_dim=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        tie_word_embeddings=False, bos_token_id=tokens["bos_token_id"], eos_token_id=tokens["eos_token_id"],
    )  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("qwen3-moe"), config, smollm2_dir, init_std=0.15)


def test_qwen3_moe_greedy_matches_hf_async_with_ngram_drafts(qwen3_moe_dir: Path, grounded_rows: list) -> None:
    rows = [grounded_rows[i] for i in ROWS]
    worker = dict(model=str(qwen3_moe_dir), kv_cache_memory_gb=0.25, spec_method="ngram", num_spec_tokens=3)
    with serving(worker, max_inflight_steps=2) as scheduler:
        report = run_workload(scheduler.target, bench_rows(rows, max_tokens=MAX_TOKENS), concurrency=len(rows))
    reference = hf_reference(qwen3_moe_dir, rows, MAX_TOKENS)
    assert_matches_reference(report, reference, qwen3_moe_dir, rows, min_identical=len(rows))
    # Real continuations (no row stopped at once), and drafts were proposed and verified.
    assert all(len(r["token_ids"]) == MAX_TOKENS for r in report["requests"]), report["requests"]
    stats = report["server_stats"]
    assert stats["num_draft_tokens"] > 0, stats
