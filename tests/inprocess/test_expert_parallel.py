"""Mixtures of experts over tensor-parallel ranks: each expert's rows split over the ranks (the
default), or whole experts per rank (``--enable-expert-parallel``), against the whole model.

Each size runs as that many spawned processes on gloo (`tests/support/tp_ranks.py`), loading
their parts from the model directory. The oracle is the size-1 model over the same schedule
(itself Hugging Face's logits, tests/inprocess/test_model_families.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model
from tests.support.tp_ranks import sharded_logits, whole_logits
from zerobubble.config import ConfigError, WorkerConfig
from zerobubble.worker_svc.model import build_model, model_spec
from zerobubble.worker_svc.model_loader import load_model
from zerobubble.worker_svc.parallel import ShardedStateDict, TensorParallel, shard_model, shard_spec

# Sums split over ranks add in another order than one product: float32 rounding apart.
TOLERANCE = dict(atol=2e-4, rtol=1e-5)
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
# 8 experts: 4 per rank of two, 2 per rank of four; every size divides each expert's rows.
MOE = {
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    # A shared expert with its gate, top-4 not renormalized, a dense layer after the sparse one.
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                      shared_expert_intermediate_size=80, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    # Biased router and experts, experts stored interleaved, a SwiGLU limit these weights reach.
    "gpt_oss": dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.5),
}  # fmt: skip
FAMILIES = list(MOE)


def moe_config(family: str, vocab_size: int, **overrides: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, vocab_size=vocab_size, **SHAPE, **{**MOE[family], **overrides})


def changed_weights(model_dir: Path, change: Callable[[str, torch.Tensor], torch.Tensor]) -> Path:
    """``model_dir`` with each weight ``change(name, tensor)`` (rewritten in place)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = {name: change(name, tensor) for name, tensor in load_file(path).items()}
    save_file(weights, path, metadata={"format": "pt"})
    return model_dir


def random_biases(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Hugging Face initializes biases to zero: random ones make every bias count."""
    return torch.randn_like(tensor) * 0.15 if name.endswith("bias") else tensor


@pytest.fixture(scope="module")
def moe_dirs(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep-models")
    vocab = tokenizer_vocab_size(smollm2_dir)
    dirs = {
        family: write_tiny_model(root / family, moe_config(family, vocab), smollm2_dir, init_std=0.15)
        for family in FAMILIES
    }
    torch.manual_seed(0)
    changed_weights(dirs["gpt_oss"], random_biases)
    return dirs


def assert_ranks_match_one(model_dir: Path, size: int, tmp_path: Path, expert_parallel: bool) -> None:
    sharded = sharded_logits(model_dir, size, tmp_path, expert_parallel=expert_parallel)
    for r, (got, expected) in enumerate(zip(sharded, whole_logits(model_dir), strict=True)):
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=f"request {r}")


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-experts", "expert-parallel"])
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_one(
    moe_dirs: dict[str, Path], tmp_path: Path, family: str, expert_parallel: bool
) -> None:
    assert_ranks_match_one(moe_dirs[family], 2, tmp_path, expert_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-experts", "expert-parallel"])
def test_four_ranks_match_one(moe_dirs: dict[str, Path], tmp_path: Path, expert_parallel: bool) -> None:
    """Qwen2-MoE over four ranks: two experts each, or a quarter of every expert's rows."""
    assert_ranks_match_one(moe_dirs["qwen2_moe"], 4, tmp_path, expert_parallel)


def routed_to_one_rank(model_dir: Path, out_dir: Path, rank: int) -> Path:
    """A copy of gpt-oss's directory with every router biased to the experts of ``rank`` of two
    (ids ``4 rank`` to ``4 rank + 3``): the other rank's experts see no token."""
    shutil.copytree(model_dir, out_dir)

    def biased(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not name.endswith("mlp.router.bias"):
            return tensor
        away = torch.full_like(tensor, -1e3)
        away[4 * rank : 4 * rank + 4] = 0.0
        return tensor + away

    return changed_weights(out_dir, biased)


@pytest.mark.parametrize("rank", [0, 1], ids=["all-on-the-leader", "all-on-the-other"])
def test_tokens_all_routed_to_one_ranks_experts(moe_dirs: dict[str, Path], tmp_path: Path, rank: int) -> None:
    model_dir = routed_to_one_rank(moe_dirs["gpt_oss"], tmp_path / "routed", rank)
    loaded = load_model(str(model_dir), "float32", "cpu")
    assert loaded.model is not None
    layer = loaded.model.layers[0].moe
    assert layer is not None and layer.router_bias is not None
    assert layer.router_bias[4 * rank : 4 * rank + 4].min() > layer.router_bias.max() - 100
    assert_ranks_match_one(model_dir, 2, tmp_path, expert_parallel=True)


def loaded_shard(config: Any, tp: TensorParallel, state_dict: dict[str, torch.Tensor], quantization: str) -> Any:
    """``tp.rank``'s model of ``config`` loaded from ``state_dict`` (no group needed to load), and
    every ``(name, dim, start, stop)`` it read."""
    reads: list[tuple[str, int, int, int]] = []

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        reads.append((name, dim, start, stop))
        tensor = state_dict[name]
        return tensor if stop < 0 else tensor.narrow(dim, start, stop - start).contiguous()

    model = build_model(config, torch.float32, "cpu", quantization=quantization)
    full = shard_model(model, tp)
    model.load_weights(ShardedStateDict(list(state_dict), read, full, tp))
    return model, reads


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_rank_reads_and_holds_only_its_experts(moe_dirs: dict[str, Path], quantization: str) -> None:
    """Expert parallel: rank 1 of two reads experts 4-7 only and holds them whole (quantized as
    the model's); tensor parallel: every expert's second half of rows, the down bias (gpt-oss) on
    rank 0 only."""
    from safetensors.torch import load_file

    for family in ("qwen2_moe", "gpt_oss"):
        config = moe_config(family, 1)
        config.vocab_size = load_file(moe_dirs[family] / "model.safetensors")["model.embed_tokens.weight"].shape[0]
        state_dict = load_file(moe_dirs[family] / "model.safetensors")
        model, reads = loaded_shard(config, TensorParallel(1, 2, expert_parallel=True), state_dict, quantization)
        experts = model.layers[0].moe.experts
        assert experts.first == 4 and experts.num_experts == 4
        assert len(experts.gate_up_each) == 4 and experts.gate_up_each[0].num_outputs == 2 * model.spec.moe.intermediate_size
        assert (experts.gate_up_each[0].int8 is not None) == (quantization == "int8")
        per_expert = {int(n.split("experts.")[1].split(".")[0]) for n, *_ in reads if ".experts." in n and n.split("experts.")[1][0].isdigit()}
        stacked = {(dim, start, stop) for n, dim, start, stop in reads if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        assert per_expert <= {4, 5, 6, 7} and (stacked <= {(0, 4, 8)}) and (per_expert or stacked)
        model, _ = loaded_shard(config, TensorParallel(1, 2), state_dict, quantization)
        experts = model.layers[0].moe.experts
        assert experts.num_experts == 8 and experts.down_bias is None
