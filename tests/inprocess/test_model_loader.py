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

from zerobubble.worker_svc import server
from zerobubble.worker_svc.model_loader import (
    EMBEDDED_MODEL_NAME,
    ModelLoadError,
    _embedded_gguf_path,
    load_model,
    resolve_model,
)
from zerobubble.worker_svc.server import resolve_dtype

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def test_mxfp4_is_read_only_as_gpt_oss_s_experts(tmp_path: Path, smollm2_dir: Path) -> None:
    """MXFP4 is gpt-oss's experts' storage (tests/inprocess/test_mxfp4.py); another family
    claiming it is refused in one line, naming the method, before any weight is read."""
    model_dir = _tiny_hf_dir(tmp_path, smollm2_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"unsupported quantized checkpoint \(quantization_config.quant_method 'mxfp4'\)"
    ) as raised:
        load_model(str(model_dir))
    assert "\n" not in str(raised.value)


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


def test_an_mxfp4_gguf_is_refused_naming_the_tensor_type(tmp_path: Path) -> None:
    """llama.cpp's gpt-oss files store the experts as MXFP4, which the GGUF conversion does not
    read correctly: refused in one line before any conversion, pointing to the checkpoint we read."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    path = tmp_path / "gpt-oss.gguf"
    writer = GGUFWriter(str(path), "gpt-oss")
    weights = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", quantize(weights, GGMLQuantizationType.MXFP4),
                      raw_dtype=GGMLQuantizationType.MXFP4)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.ffn_gate_exps.weight' is MXFP4 .* gpt-oss") as raised:
        resolve_model(str(path))
    assert "\n" not in str(raised.value)


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
    code = "from zerobubble.worker_svc.model_loader import resolve_model; print(resolve_model('smollm2-135m'))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = [proc.communicate(timeout=600)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert paths[0] == paths[1] == str(tmp_path / "models" / EMBEDDED_MODEL_NAME)
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


# Hand-written config.json files that leave each family's defaults to transformers: the cached
# read must apply the same defaults (head_dim, windows, RoPE base, tied embeddings, EOS ids).
SPARSE_CONFIGS = {
    "llama": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
    "mistral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2),
    # Old Qwen2 configs name a window that is off unless use_sliding_window says otherwise.
    "qwen2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=32, use_sliding_window=False, rope_theta=1e6,
                  eos_token_id=[3, 9]),
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen3-windowed": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=2),
    # Mixtures of experts: Qwen3-MoE's and Mixtral's configs keep num_experts as num_local_experts.
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=8, moe_intermediate_size=32, mlp_only_layers=[1]),
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=16),
    # Gemma 3 as its checkpoints write it: a global and a local RoPE base, a layer pattern.
    "gemma3_text": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, sliding_window=16, sliding_window_pattern=3,
                        rope_theta=1e6, rope_local_base_freq=1e4),
    "phi3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 partial_rotary_factor=0.5, sliding_window=24),
}  # fmt: skip
# Per family with windows other than none or Mistral's default: each layer's.
WINDOWS = {"qwen3-windowed": [0, 0, 16, 16], "gemma2": [16, 0, 16], "gemma3_text": [16, 16, 0], "phi3": [24, 24]}


@pytest.mark.parametrize("family", sorted(SPARSE_CONFIGS))
def test_the_cached_config_reads_as_transformers_resolves_it(tmp_path: Path, monkeypatch, family: str) -> None:
    """A second start reads the resolved config from the cache, without transformers, and builds
    the same model shape, RoPE tables, EOS ids and context length as AutoConfig does."""
    from transformers import AutoConfig

    from zerobubble.worker_svc.model import model_spec, rotary_tables
    from zerobubble.worker_svc.model_loader import _eos_token_ids, read_config

    monkeypatch.setenv("ZEROBUBBLE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / family
    model_dir.mkdir()
    fields = {"model_type": family.split("-")[0], "vocab_size": 128, **SPARSE_CONFIGS[family]}
    (model_dir / "config.json").write_text(json.dumps(fields))
    reference = AutoConfig.from_pretrained(model_dir)

    first = read_config(model_dir)  # resolves and caches
    second = read_config(model_dir)  # from the cache
    assert isinstance(first, type(reference)) and not isinstance(second, type(reference))
    for config in (first, second):
        spec = model_spec(config)
        assert spec == model_spec(reference)
        assert (spec.moe is not None) == family.endswith(("_moe", "mixtral"))
        for layer_type in ("sliding_attention", "full_attention") if spec.local_rope else (None,):
            tables, expected = rotary_tables(config, spec, layer_type), rotary_tables(reference, spec, layer_type)
            assert all(torch.equal(a, b) for a, b in zip(tables, expected))
        assert _eos_token_ids(model_dir, config) == _eos_token_ids(model_dir, reference)
        assert int(config.max_position_embeddings) == int(reference.max_position_embeddings)
    if family in WINDOWS:  # Qwen3: the layers from max_window_layers on
        assert model_spec(second).sliding_windows == WINDOWS[family]
    else:
        assert set(model_spec(second).sliding_windows) == ({4096} if family == "mistral" else {0})
    # A changed config.json is a different key: no stale read.
    (model_dir / "config.json").write_text(json.dumps({**fields, "num_hidden_layers": 5}))
    assert model_spec(read_config(model_dir)).num_layers == 5


def test_a_scaled_rope_config_is_resolved_by_transformers_every_time(tmp_path: Path, monkeypatch) -> None:
    """Non-default RoPE is computed by transformers' functions on the real config object."""
    from transformers import LlamaConfig as Reference

    from zerobubble.worker_svc.model_loader import read_config

    monkeypatch.setenv("ZEROBUBBLE_CACHE_DIR", str(tmp_path / "cache"))
    scaling = {"rope_type": "linear", "factor": 2.0}
    fields = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps({**fields, "num_attention_heads": 4, "rope_scaling": scaling}))
    for _ in range(2):
        assert isinstance(read_config(tmp_path), Reference)
    assert not (tmp_path / "cache" / "configs").exists() or not any((tmp_path / "cache" / "configs").iterdir())


def test_dtype_auto_follows_the_device_and_refuses_emulated_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    # A CPU with native bfloat16 computes in it.
    for native in (True, False):
        monkeypatch.setattr(server, "cpu_has_native_bf16", lambda native=native: native)
        assert resolve_dtype("auto", cpu) is (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("float16", cpu) is torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # Ampere
    assert resolve_dtype("auto", cuda) is torch.bfloat16
    assert resolve_dtype("bfloat16", cuda) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # Turing (T4)
    assert resolve_dtype("auto", cuda) is torch.float16
    assert resolve_dtype("float32", cuda) is torch.float32
    with pytest.raises(ValueError, match=r"compute capability 8\.0 or later, this one is 7\.5: use --dtype float16"):
        resolve_dtype("bfloat16", cuda)


LLAMA_CPP_CONVERTER = Path.home() / ".cache" / "zerobubble" / "llama.cpp" / "src" / "convert_hf_to_gguf.py"


@pytest.mark.slow
@pytest.mark.skipif(
    not LLAMA_CPP_CONVERTER.is_file(), reason="llama.cpp's converter (scripts/bench_llamacpp.sh fetches it)"
)
def test_a_qwen3_moe_gguf_converts_to_its_hugging_face_model(tmp_path: Path, monkeypatch, smollm2_dir: Path) -> None:
    """A Qwen3-MoE converted to GGUF by llama.cpp loads back with its experts' size and renormalized
    routing, which transformers' GGUF config reader leaves at the class defaults (768, off): the
    converted directory's logits are the original's, and our model's spec is the original's."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model
    from zerobubble.worker_svc.model import model_spec

    monkeypatch.setenv("ZEROBUBBLE_CACHE_DIR", str(tmp_path / "cache"))
    config = Qwen3MoeConfig(
        vocab_size=tokenizer_vocab_size(smollm2_dir), hidden_size=64, intermediate_size=96, head_dim=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=False,
    )  # fmt: skip
    hf_dir = write_tiny_model(tmp_path / "hf", config, smollm2_dir, init_std=0.15)
    gguf = tmp_path / "qwen3-moe.gguf"
    command = [sys.executable, str(LLAMA_CPP_CONVERTER), str(hf_dir), "--outtype", "f32", "--outfile", str(gguf)]
    subprocess.run(command, check=True, capture_output=True)
    converted = load_model(str(gguf), "float32", "cpu")
    original = model_spec(load_model(str(hf_dir), weights=False).hf_config)
    assert model_spec(converted.hf_config).moe == original.moe and original.moe is not None
    tokens = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(d).eval()(tokens).logits for d in (hf_dir, converted.path)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
