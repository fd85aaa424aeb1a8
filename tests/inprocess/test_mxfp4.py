"""gpt-oss as OpenAI ships it: MXFP4 experts dequantized at load (zerobubble.worker_svc.mxfp4).

The oracles are Hugging Face's: its dequantization (``convert_moe_packed_tensors``) bit for
bit, and its forward over a copy of the checkpoint holding those dequantized weights unquantized.
The tiny checkpoints pick their FP4 codes and scales at random, so the reference weights are
exactly what the codes mean rather than a rounding of some float weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tests.support.tiny_models import mxfp4_checkpoint, random_mxfp4, tokenizer_vocab_size, write_tiny_model
from tests.support.tp_ranks import SEQ_LENS, sharded_logits, whole_logits
from zerobubble.worker_svc.model import CausalLM, build_model
from zerobubble.worker_svc.model_loader import ModelLoadError, load_model
from zerobubble.worker_svc.mxfp4 import dequantize_mxfp4
from zerobubble.worker_svc.parallel import ShardedStateDict, TensorParallel, shard_model

# Each expert's intermediate size 96: three blocks of 32, so four ranks' 24 rows each start
# inside a block (rank 1: rows 24-47 of blocks 0 and 1).
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
             sliding_window=8, swiglu_limit=1.5, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 64, 2), (5, 96, 3), (7, 10, 4)], ids=str)
def test_dequantization_is_hugging_faces_bit_for_bit(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Every code and every scale: the same bits as Hugging Face's, subnormals, signed zeros and
    infinities where a dtype overflows included."""
    packed = random_mxfp4(shape, torch.Generator().manual_seed(sum(shape)), (0, 256))
    flat = packed["scales"].view(-1)
    flat[0], flat[-1] = 0, 255  # the smallest and largest scales
    ours = dequantize_mxfp4(packed["blocks"], packed["scales"], dtype)
    theirs = convert_moe_packed_tensors(packed["blocks"], packed["scales"], dtype=dtype)
    assert ours.shape == theirs.shape == (shape[0], 32 * shape[2], shape[1]) and ours.dtype == dtype
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(ours.contiguous().view(bits), theirs.view(bits))


@pytest.fixture(scope="module")
def gpt_oss_dirs(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(mxfp4, reference)``: a tiny gpt-oss checkpoint as released, and its dequantized copy."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("mxfp4")
    config = AutoConfig.for_model("gpt_oss", vocab_size=tokenizer_vocab_size(smollm2_dir), **SHAPE)
    reference = write_tiny_model(root / "reference", config, smollm2_dir, init_std=0.15)
    torch.manual_seed(0)
    biased = {n: torch.randn_like(t) * 0.15 if n.endswith("bias") else t
              for n, t in load_file(reference / "model.safetensors").items()}  # fmt: skip
    save_file(biased, reference / "model.safetensors", metadata={"format": "pt"})
    return mxfp4_checkpoint(reference, root / "mxfp4"), reference


def test_an_mxfp4_checkpoint_serves_hugging_faces_logits(gpt_oss_dirs: tuple[Path, Path]) -> None:
    """Loaded in float32, the MXFP4 checkpoint is its dequantized copy to the bit, and gives
    Hugging Face's float32 logits over that copy."""
    from transformers import GptOssForCausalLM

    mxfp4, reference = gpt_oss_dirs
    ours = whole_logits(mxfp4)
    assert all(torch.equal(a, b) for a, b in zip(ours, whole_logits(reference), strict=True))
    hf = GptOssForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)  # schedule_logits's prompts
    for r, n in enumerate(SEQ_LENS):
        tokens = torch.randint(0, 1000, (n,), generator=generator)
        with torch.no_grad():
            expected = hf(tokens[None]).logits[0].float()
        torch.testing.assert_close(ours[r], expected, atol=2e-4, rtol=1e-4, msg=f"request {r}")


def expert_tensors(model: CausalLM) -> list[torch.Tensor]:
    """Every expert weight and bias a (plain, not prepacked) model holds, layer by layer."""
    tensors: list[torch.Tensor] = []
    for layer in model.layers:
        assert layer.moe is not None
        experts = layer.moe.experts
        assert experts.gate_up_each is not None and experts.down_each is not None
        tensors += [w.dense for w in experts.gate_up_each + experts.down_each if w.dense is not None]
        tensors += [b for b in (experts.gate_up_bias, experts.down_bias) if b is not None]
    return tensors


def shard(model_dir: Path, tp: TensorParallel, dtype: torch.dtype) -> tuple[CausalLM, list[tuple[str, int, int, int]]]:
    """``tp.rank``'s model of ``model_dir`` loaded through `ShardedStateDict`, and its reads."""
    state_dict, reads = load_file(model_dir / "model.safetensors"), []

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        reads.append((name, dim, start, stop))
        return state_dict[name] if stop < 0 else state_dict[name].narrow(dim, start, stop - start)

    model = build_model(load_model(str(model_dir), weights=False).hf_config, dtype, "cpu", prepack=False)
    full = shard_model(model, tp)
    model.load_weights(ShardedStateDict(list(state_dict), read, full, tp))
    return model, reads


@pytest.mark.parametrize(
    ("tp", "down_cut"),
    [
        (TensorParallel(1, 4), (2, 0, 2)),
        (TensorParallel(3, 4), (2, 2, 3)),
        (TensorParallel(1, 2, expert_parallel=True), (0, 4, 8)),
    ],
    ids=["tp4-rank1", "tp4-rank3", "ep2-rank1"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rank_dequantizes_only_its_slice(
    gpt_oss_dirs: tuple[Path, Path], tp: TensorParallel, down_cut: tuple[int, int, int], dtype: torch.dtype
) -> None:
    """A tensor-parallel rank reads only the blocks covering its rows (four ranks' 24 rows start
    inside a block: cut to them once dequantized), an expert-parallel one only its experts; the
    rank holds what it holds loading the dequantized copy."""
    mxfp4, reference = gpt_oss_dirs
    ours, reads = shard(mxfp4, tp, dtype)
    expected, _ = shard(reference, tp, dtype)
    assert all(torch.equal(a, b) for a, b in zip(expert_tensors(ours), expert_tensors(expected), strict=True))
    cuts = {
        (dim, start, stop)
        for name, dim, start, stop in reads
        if name.endswith(("down_proj_blocks", "down_proj_scales"))
    }
    assert cuts == {down_cut}


@pytest.mark.slow
def test_four_ranks_of_an_mxfp4_checkpoint_match_its_dequantized_copy(
    gpt_oss_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Four spawned ranks reading their blocks from the files (`safe_open` slices, 24 rows each
    starting inside a block) give the dequantized copy's logits on one rank."""
    mxfp4, reference = gpt_oss_dirs
    for r, (got, expected) in enumerate(zip(sharded_logits(mxfp4, 4, tmp_path), whole_logits(reference), strict=True)):
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-5, msg=f"request {r}")


def test_int8_of_an_mxfp4_checkpoint_is_int8_of_its_dequantized_copy(gpt_oss_dirs: tuple[Path, Path]) -> None:
    mxfp4, reference = gpt_oss_dirs
    ours = whole_logits(mxfp4, quantization="int8")
    assert all(torch.equal(a, b) for a, b in zip(ours, whole_logits(reference, quantization="int8"), strict=True))


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "bitsandbytes"])
def test_other_quantized_checkpoints_are_refused_naming_the_method(
    gpt_oss_dirs: tuple[Path, Path], tmp_path: Path, method: str
) -> None:
    model_dir = shutil.copytree(gpt_oss_dirs[1], tmp_path / method)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": method}}))
    with pytest.raises(ModelLoadError, match=rf"quant_method '{method}'\): only gpt-oss's mxfp4 experts") as raised:
        load_model(str(model_dir))
    assert "\n" not in str(raised.value)


def test_each_layer_s_experts_are_dequantized_once_when_read(
    gpt_oss_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing the state dict dequantizes nothing, and loading dequantizes each projection of
    each layer once, when its layer reads it: no pass over the whole model in both forms."""
    from zerobubble.worker_svc import mxfp4

    calls: list[tuple[int, ...]] = []

    def counted(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        calls.append(tuple(blocks.shape))
        return dequantize_mxfp4(blocks, scales, dtype)

    monkeypatch.setattr(mxfp4, "dequantize_mxfp4", counted)
    state_dict = mxfp4.Mxfp4StateDict(
        load_file(gpt_oss_dirs[0] / "model.safetensors"), torch.float32, torch.device("cpu"), (0, 96)
    )
    names = list(state_dict)
    assert "model.layers.1.mlp.experts.down_proj" in names and "model.layers.1.mlp.experts.down_proj" in state_dict
    assert not any(name.endswith(mxfp4.SUFFIXES) for name in names) and calls == []
    load_model(str(gpt_oss_dirs[0]))
    assert sorted(calls) == sorted([(8, 192, 2, 16), (8, 64, 3, 16)] * SHAPE["num_hidden_layers"])
