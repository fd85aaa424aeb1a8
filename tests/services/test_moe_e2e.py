"""Mixtures of experts through the real services: a random-weight directory of each family (built
from its own Hugging Face config, tests/support/tiny_models.py) served by a worker and a scheduler
process, greedy output identical to Hugging Face's ``generate`` in float32. The default run:
Qwen3-MoE and gpt-oss (attention sinks, a 16-token window on alternate layers, YaRN, the clamped
SwiGLU) async (two plans in flight) with n-gram drafts; the slow suite adds sync, Qwen2-MoE
(shared expert, a dense layer), Mixtral, and Qwen3-MoE over two expert-parallel ranks."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.e2e import assert_matches_reference, bench_rows, hf_reference, run_workload
from tests.support.servers import serving
from tests.support.tiny_models import mxfp4_checkpoint, tokenizer_vocab_size, write_tiny_model

pytestmark = pytest.mark.timeout(600)

ROWS = (24, 27, 40, 43)  # short prompts of the grounded workload
MAX_TOKENS = 24


# Each family's tiny config: 8 experts, so a decode step leaves some of them idle.
MOE_CONFIGS = {
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                      shared_expert_intermediate_size=80, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    # Sliding and full layers alternating, a window the prompts pass; YaRN's factor 32 as gpt-oss's
    # (over 64 original positions here); a SwiGLU limit these weights reach.
    "gpt_oss": dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=16, swiglu_limit=1.5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    """A family's random-weight directory, written on first use."""
    from transformers import AutoConfig

    tokens = json.loads((smollm2_dir / "config.json").read_text())

    @functools.cache
    def write(family: str) -> Path:
        config = AutoConfig.for_model(
            family, vocab_size=tokenizer_vocab_size(smollm2_dir), hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=False, bos_token_id=tokens["bos_token_id"], eos_token_id=tokens["eos_token_id"],
            **MOE_CONFIGS[family],
        )  # fmt: skip
        return write_tiny_model(tmp_path_factory.mktemp(family), config, smollm2_dir, init_std=0.15)

    return write


# (family, plans in flight, spec method): the default run serves Qwen3-MoE and gpt-oss async with
# n-gram drafts; sync, the other families and speculation off run in the slow suite.
CASES = [
    pytest.param("qwen3_moe", 2, "ngram", id="qwen3_moe-async-ngram"),
    pytest.param("gpt_oss", 2, "ngram", id="gpt_oss-async-ngram"),
    pytest.param("qwen3_moe", 1, "none", id="qwen3_moe-sync", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", 2, "ngram", id="qwen2_moe-async-ngram", marks=pytest.mark.slow),
    pytest.param("mixtral", 2, "ngram", id="mixtral-async-ngram", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family,inflight,spec", CASES)
def test_moe_greedy_matches_hf(
    moe_dir: Callable[[str], Path], grounded_rows: list, family: str, inflight: int, spec: str
) -> None:
    """Four rows at once (prefix caching on, as by default), every token identical to Hugging Face's."""
    model_dir = moe_dir(family)
    rows = [grounded_rows[i] for i in ROWS]
    worker = dict(model=str(model_dir), kv_cache_memory_gb=0.25, spec_method=spec, num_spec_tokens=3)
    with serving(worker, max_inflight_steps=inflight) as scheduler:
        report = run_workload(scheduler.target, bench_rows(rows, max_tokens=MAX_TOKENS), concurrency=len(rows))
    reference = hf_reference(model_dir, rows, MAX_TOKENS)
    assert_matches_reference(report, reference, model_dir, rows, min_identical=len(rows))
    # Real continuations (no row stopped at once); the Qwen3-MoE model's outputs repeat
    # themselves, so n-gram drafts were proposed and verified (the others' may not).
    assert all(len(r["token_ids"]) == MAX_TOKENS for r in report["requests"]), report["requests"]
    stats = report["server_stats"]
    if spec == "none" or family == "qwen3_moe":
        assert (stats["num_draft_tokens"] > 0) == (spec != "none"), stats


@pytest.mark.slow
def test_expert_parallel_two_ranks_greedy_matches_hf(moe_dir: Callable[[str], Path], grounded_rows: list) -> None:
    """Qwen3-MoE over two ranks with --enable-expert-parallel (four of the eight experts on each),
    async: every token identical to Hugging Face's."""
    model_dir = moe_dir("qwen3_moe")
    rows = [grounded_rows[i] for i in ROWS]
    worker = dict(model=str(model_dir), kv_cache_memory_gb=0.25, tensor_parallel_size=2, enable_expert_parallel=True)
    with serving(worker, max_inflight_steps=2) as scheduler:
        report = run_workload(scheduler.target, bench_rows(rows, max_tokens=MAX_TOKENS), concurrency=len(rows))
    reference = hf_reference(model_dir, rows, MAX_TOKENS)
    assert_matches_reference(report, reference, model_dir, rows, min_identical=len(rows))
    assert all(len(r["token_ids"]) == MAX_TOKENS for r in report["requests"]), report["requests"]


@pytest.mark.slow
def test_gpt_oss_as_released_in_mxfp4_greedy_matches_hf(
    moe_dir: Callable[[str], Path], grounded_rows: list, tmp_path: Path
) -> None:
    """gpt-oss with its experts in MXFP4 (a released checkpoint's form, experts dequantized at
    load): every token identical to Hugging Face's over the dequantized copy."""
    reference = shutil.copytree(moe_dir("gpt_oss"), tmp_path / "reference")
    model_dir = mxfp4_checkpoint(reference, tmp_path / "mxfp4")
    rows = [grounded_rows[i] for i in ROWS]
    with serving(dict(model=str(model_dir), kv_cache_memory_gb=0.25), max_inflight_steps=2) as scheduler:
        report = run_workload(scheduler.target, bench_rows(rows, max_tokens=MAX_TOKENS), concurrency=len(rows))
    reference_ids = hf_reference(reference, rows, MAX_TOKENS)
    assert_matches_reference(report, reference_ids, reference, rows, min_identical=len(rows))
