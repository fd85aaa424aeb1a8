"""Mixtures of experts over tensor-parallel ranks: each expert's rows split over the ranks (the
default), or whole experts per rank (``--enable-expert-parallel``), against the whole model.

Each size runs as that many spawned processes on gloo (`tests/support/tp_ranks.py`), loading
their parts from the model directory. The oracle is the size-1 model over the same schedule
(itself Hugging Face's logits, tests/inprocess/test_model_families.py). The default run covers
gpt-oss (biases on both projections, interleaved experts) over two ranks in both placements and
Qwen2-MoE's shared expert with whole experts per rank; the slow suite adds the other placements of
Qwen2-MoE, Mixtral and Qwen3-MoE, four ranks, and every token routed to the leader's experts.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model
from tests.support.tp_ranks import sharded_logits, whole_logits
from zerobubble.config import ConfigError, WorkerConfig
from zerobubble.kernels.linear import linear
from zerobubble.kernels.moe import route
from zerobubble.worker_svc.model import CausalLM, build_model, model_spec
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
MOE_SIZES = {"qwen2_moe": 32, "gpt_oss": 96}  # each expert's intermediate size


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


def _in_default_run(family: str, expert_parallel: bool) -> bool:
    """gpt-oss in both placements and Qwen2-MoE's shared expert (each spawn takes seconds)."""
    return family == "gpt_oss" or (family == "qwen2_moe" and expert_parallel)


@pytest.mark.parametrize(
    ("family", "expert_parallel"),
    [
        pytest.param(
            f,
            ep,
            id=f"{f}-{'expert-parallel' if ep else 'tp-experts'}",
            marks=() if _in_default_run(f, ep) else pytest.mark.slow,
        )
        for f in FAMILIES
        for ep in (False, True)
    ],
)
def test_two_ranks_match_one(moe_dirs: dict[str, Path], tmp_path: Path, family: str, expert_parallel: bool) -> None:
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


@pytest.mark.parametrize(
    "rank", [pytest.param(0, id="all-on-the-leader", marks=pytest.mark.slow), pytest.param(1, id="all-on-the-other")]
)
def test_tokens_all_routed_to_one_ranks_experts(moe_dirs: dict[str, Path], tmp_path: Path, rank: int) -> None:
    model_dir = routed_to_one_rank(moe_dirs["gpt_oss"], tmp_path / "routed", rank)
    loaded = load_model(str(model_dir), "float32", "cpu")
    assert loaded.model is not None
    normed = torch.randn(1000, SHAPE["hidden_size"]) * 3  # thrice the scale of a layer's normed input
    for layer in loaded.model.layers:
        assert layer.moe is not None
        routing = route(linear(normed, layer.moe.router, layer.moe.router_bias), 2, True)
        assert set(routing.experts.tolist()) == set(range(4 * rank, 4 * rank + 4))
    assert_ranks_match_one(model_dir, 2, tmp_path, expert_parallel=True)


Read = tuple[str, int, int, int]  # name, dimension cut, start, stop (-1: whole)
STACKED = ("experts.gate_up_proj", "experts.down_proj")
EXPERT_ID = re.compile(r"experts\.(\d+)\.")


def loaded_shard(model_dir: Path, tp: TensorParallel, quantization: str = "none") -> tuple[CausalLM, list[Read]]:
    """``tp.rank``'s model of ``model_dir`` (loading needs no group), and every read it made."""
    from safetensors.torch import load_file

    state_dict = load_file(model_dir / "model.safetensors")
    reads: list[Read] = []

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        reads.append((name, dim, start, stop))
        tensor = state_dict[name]
        return tensor if stop < 0 else tensor.narrow(dim, start, stop - start)

    hf_config = load_model(str(model_dir), weights=False).hf_config
    model = build_model(hf_config, torch.float32, "cpu", quantization=quantization)
    full = shard_model(model, tp)
    model.load_weights(ShardedStateDict(list(state_dict), read, full, tp))
    return model, reads


def expert_reads(reads: list[Read]) -> tuple[set[int], set[tuple[int, int, int]]]:
    """The experts read under per-expert names, and the cuts of the stacked ones."""
    ids = {int(m.group(1)) for name, *_ in reads if (m := EXPERT_ID.search(name))}
    stacked = {(dim, start, stop) for name, dim, start, stop in reads if name.endswith(STACKED)}
    return ids, stacked


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_an_expert_parallel_rank_reads_and_holds_only_its_experts(
    moe_dirs: dict[str, Path], family: str, quantization: str
) -> None:
    """Rank 1 of two reads experts 4-7 alone (per-expert names, or a cut of the stacked ones)
    and holds them whole, quantized as the model's; the shared expert split by rows."""
    model, reads = loaded_shard(moe_dirs[family], TensorParallel(1, 2, expert_parallel=True), quantization)
    layer, moe = model.layers[0].moe, model.spec.moe
    assert layer is not None and moe is not None and layer.experts.gate_up_each is not None
    assert (layer.experts.first, layer.experts.num_experts, moe.intermediate_size) == (4, 4, MOE_SIZES[family])
    assert [w.num_outputs for w in layer.experts.gate_up_each] == [2 * MOE_SIZES[family]] * 4
    assert all((w.int8 is not None) == (quantization == "int8") for w in layer.experts.gate_up_each)
    ids, stacked = expert_reads(reads)
    assert (ids, stacked) == (({4, 5, 6, 7}, set()) if family == "qwen2_moe" else (set(), {(0, 4, 8)}))
    if family == "qwen2_moe":
        assert layer.shared_gate_up is not None and layer.shared_gate_up.num_outputs == 2 * 40


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_holds_every_expert_s_share_of_rows(
    moe_dirs: dict[str, Path], rank: int, quantization: str
) -> None:
    """gpt-oss, interleaved gate/up columns: rank ``r`` of two reads columns ``[96 r, 96 r + 96)``
    of ``gate_up_proj [E, H, 192]`` (intermediate rows 48 r to 48 r + 47, gate and up), each
    expert's slice quantized as the model's, and only rank 0 adds the experts' down bias (the sum
    over ranks adds it once)."""
    model, reads = loaded_shard(moe_dirs["gpt_oss"], TensorParallel(rank, 2), quantization)
    layer = model.layers[0].moe
    assert layer is not None and layer.experts.gate_up_each is not None and layer.experts.down_each is not None
    assert layer.experts.num_experts == 8 and layer.experts.gate_up_each[0].num_outputs == 96
    assert all((w.int8 is not None) == (quantization == "int8") for w in layer.experts.down_each)
    assert expert_reads(reads)[1] == {(2, 96 * rank, 96 * rank + 96), (1, 48 * rank, 48 * rank + 48)}
    assert (layer.experts.down_bias is not None) == (rank == 0) and layer.experts.gate_up_bias is not None


def test_expert_parallel_needs_tensor_parallel() -> None:
    with pytest.raises(ConfigError, match="--enable-expert-parallel .* needs --tensor-parallel-size > 1 \\(got 1\\)"):
        WorkerConfig(enable_expert_parallel=True).validate()
    WorkerConfig(enable_expert_parallel=True, tensor_parallel_size=2).validate()


@pytest.mark.parametrize(
    ("expert_parallel", "message"),
    [
        (True, "--enable-expert-parallel: tensor-parallel size 4 does not divide the model's 6 experts"),
        (False, "tensor-parallel size 4 does not divide the model's expert intermediate size 42"),
    ],
)
def test_experts_that_do_not_divide_are_refused(expert_parallel: bool, message: str) -> None:
    spec = model_spec(moe_config("qwen3_moe", 256, num_experts=6, moe_intermediate_size=42))
    with pytest.raises(ValueError, match=message):
        shard_spec(spec, TensorParallel(0, 4, expert_parallel=expert_parallel))
