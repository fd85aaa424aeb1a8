"""What a worker tells its scheduler about sliding windows (`WorkerInfo.sliding_window`): the
window when every layer is windowed and nothing else reads the block table with full
attention, else 0 (the scheduler then frees no block of a running request)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model

WINDOW = 16


def _qwen2_dir(out_dir: Path, smollm2_dir: Path, max_window_layers: int) -> Path:
    """A 2-layer Qwen2 whose layers from ``max_window_layers`` on are windowed."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=tokenizer_vocab_size(smollm2_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=True,
        sliding_window=WINDOW, max_window_layers=max_window_layers, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return write_tiny_model(out_dir, config, smollm2_dir)


def _reported_window(model_dir: Path, spec_method: str, draft_model: str = "", simulate_device_ms: float = -1) -> int:
    from zerobubble.worker_svc.runner import worker_info
    from zerobubble.worker_svc.server import WorkerConfig, build_runner

    cfg = WorkerConfig(
        model=str(model_dir), dtype="float32", kv_cache_memory_gb=0.01, max_num_seqs=4, spec_method=spec_method,
        num_spec_tokens=2, draft_model=draft_model, simulate_device_ms=simulate_device_ms,
    )  # fmt: skip
    runner, _ = build_runner(cfg)
    return worker_info(runner).sliding_window


@pytest.mark.parametrize(
    ("max_window_layers", "spec_method", "expected"),
    [
        (0, "none", WINDOW),  # every layer windowed
        (0, "ngram", WINDOW),  # n-grams read token pages only
        (1, "none", 0),  # one full-attention layer keeps every block
        (0, "draft", 0),  # a draft model reads the whole table
    ],
)
def test_the_worker_reports_the_window_only_when_every_reader_is_windowed(
    smollm2_dir: Path, tmp_path: Path, max_window_layers: int, spec_method: str, expected: int
) -> None:
    model_dir = _qwen2_dir(tmp_path / "qwen2", smollm2_dir, max_window_layers)
    draft = str(_qwen2_dir(tmp_path / "draft", smollm2_dir, max_window_layers)) if spec_method == "draft" else ""
    assert _reported_window(model_dir, spec_method, draft) == expected


def test_a_simulated_device_reports_no_window(smollm2_dir: Path, tmp_path: Path) -> None:
    """Its tokens are a function of the whole sequence, read from the token pages."""
    model_dir = _qwen2_dir(tmp_path / "qwen2", smollm2_dir, 0)
    assert _reported_window(model_dir, "ngram", simulate_device_ms=0) == 0
