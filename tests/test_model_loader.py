"""``--model`` resolution: clear errors for bad specs, the embedded model's conversion cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from worker_svc.model_loader import (
    EMBEDDED_MODEL_NAME,
    ModelLoadError,
    _embedded_gguf_path,
    load_model,
    resolve_model,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def _tiny_hf_dir(path: Path, smollm2_dir: Path) -> Path:
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=[5, 7])  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    shutil.copy(smollm2_dir / "tokenizer.json", path / "tokenizer.json")
    return path


def test_missing_path() -> None:
    with pytest.raises(ModelLoadError, match=r"/no/such/model.*no such file or directory"):
        resolve_model("/no/such/model")


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}.*no config\.json"):
        resolve_model(str(tmp_path))


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt2'.*llama"):
        resolve_model(str(tmp_path))


def test_malformed_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json.*not valid JSON"):
        resolve_model(str(tmp_path))


def test_dir_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_truncated_gguf(tmp_path: Path) -> None:
    truncated = tmp_path / "model.gguf"
    with _embedded_gguf_path().open("rb") as f:
        truncated.write_bytes(f.read(300_000))
    with pytest.raises(ModelLoadError, match=rf"{truncated}.*corrupt or truncated GGUF"):
        resolve_model(str(truncated))


def test_not_a_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match=r"not a GGUF file"):
        resolve_model(str(fake))


def test_hf_dir_loads_and_mismatched_weights_fail(tmp_path: Path, smollm2_dir: Path) -> None:
    model_dir = _tiny_hf_dir(tmp_path / "tiny", smollm2_dir)
    loaded = load_model(str(model_dir), "float32", "cpu")
    assert loaded.path == model_dir and loaded.eos_token_ids == [5, 7] and loaded.max_model_len == 64
    assert loaded.tokenizer_file.is_file()
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ModelLoadError, match=r"weights do not match config\.json.*mlp"):
        load_model(str(model_dir), "float32", "cpu")


def test_embedded_model_resolves_from_cache(smollm2_dir: Path) -> None:
    assert (smollm2_dir / "config.json").is_file() and (smollm2_dir / "tokenizer.json").is_file()
    started = time.perf_counter()
    assert resolve_model(EMBEDDED_MODEL_NAME) == smollm2_dir
    assert time.perf_counter() - started < 0.5


def test_embedded_model_loads(smollm2_dir: Path) -> None:
    started = time.perf_counter()
    loaded = load_model(EMBEDDED_MODEL_NAME, "float32", "cpu")
    elapsed = time.perf_counter() - started
    assert loaded.name == EMBEDDED_MODEL_NAME and loaded.path == smollm2_dir
    assert loaded.eos_token_ids == [2] and loaded.max_model_len == 8192
    assert loaded.model.spec.num_layers == 30 and loaded.model.lm_head.dense is loaded.model.embed
    assert elapsed < 10, f"loading the cached model took {elapsed:.1f}s"


@pytest.mark.slow
def test_concurrent_conversion_is_atomic(tmp_path: Path) -> None:
    """Two processes converting into an empty cache at once both get the one complete copy."""
    env = {**os.environ, "ZEROBUBBLE_CACHE_DIR": str(tmp_path)}
    code = "from worker_svc.model_loader import resolve_model; print(resolve_model('smollm2-135m'))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = [proc.communicate(timeout=600)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert paths[0] == paths[1] == str(tmp_path / "models" / EMBEDDED_MODEL_NAME)
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name]
    assert leftovers == []
