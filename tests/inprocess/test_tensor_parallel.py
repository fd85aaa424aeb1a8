"""Tensor-parallel shards against the whole model: the same logits over a mixed batch.

Each size runs as that many spawned processes on gloo (`tests/support/tp_ranks.py`), every
rank on one torch thread, loading its slices from the model directory; a model with fewer KV
heads than ranks replicates them. The oracle is the size-1 model over the same schedule
(itself Hugging Face's logits, tests/inprocess/test_model_families.py).
"""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support import tp_ranks
from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model
from tests.support.tp_ranks import sharded_logits, whole_logits
from zerobubble.worker_svc.model import model_spec
from zerobubble.worker_svc.parallel import PLAN, STOP, PlanChannel, RankLost, TensorParallel, head_shard
from zerobubble.worker_svc.ranks import plan_pipe

# Sums split over ranks add in another order than one product: float32 rounding apart.
TOLERANCE = dict(atol=2e-4, rtol=1e-5)
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def tiny_config(family: str, vocab_size: int):
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config

    if family == "llama":  # an odd vocabulary: the ranks' lm_head shares differ, the last one padded to gather
        return LlamaConfig(**SHAPE, vocab_size=vocab_size + 1)

    if family == "llama-bias":  # biases on every product: column- and row-parallel ones
        return LlamaConfig(**SHAPE, vocab_size=vocab_size, attention_bias=True, mlp_bias=True)
    if family == "qwen3":  # q/k norms; head_dim unlike hidden / heads
        return Qwen3Config(**SHAPE, vocab_size=vocab_size, head_dim=32, tie_word_embeddings=False)
    if family == "gpt-oss":  # attention sinks cut with their query heads; each expert's rows over the ranks
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 8}
        return GptOssConfig(**SHAPE, vocab_size=vocab_size, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=8, rope_parameters=rope)  # fmt: skip
    raise ValueError(family)


@pytest.fixture(scope="module")
def tiny_dirs(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    vocab = tokenizer_vocab_size(smollm2_dir)
    return {
        family: write_tiny_model(root / family, tiny_config(family, vocab), smollm2_dir, init_std=0.15)
        for family in ("llama", "llama-bias", "qwen3", "gpt-oss")
    }


def assert_sharded_matches_whole(model_dir: Path, size: int, tmp_path: Path, expert_parallel: bool = False) -> None:
    sharded = sharded_logits(model_dir, size, tmp_path, expert_parallel=expert_parallel)
    for r, (got, expected) in enumerate(zip(sharded, whole_logits(model_dir))):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=f"request {r}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_two_ranks_match_one(tiny_dirs: dict[str, Path], tmp_path: Path, family: str) -> None:
    assert_sharded_matches_whole(tiny_dirs[family], 2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "size"), [("llama-bias", 4), ("qwen3", 4)])
def test_sharded_families_match_one(tiny_dirs: dict[str, Path], tmp_path: Path, family: str, size: int) -> None:
    """At size 4 the 2 KV heads are replicated, each on the two ranks of its query heads."""
    assert_sharded_matches_whole(tiny_dirs[family], size, tmp_path)


@pytest.mark.slow
def test_gpt_oss_two_ranks_match_one(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    assert_sharded_matches_whole(tiny_dirs["gpt-oss"], 2, tmp_path)


@pytest.mark.slow
def test_int8_shards_are_as_close_to_float32_as_the_whole_int8_model(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A shard is a smaller weight handed to the same quantization: a column-parallel slice
    keeps its rows' int8 scales, a row-parallel one gets scales of its own columns, so the
    sharded model is no farther from float32 than the whole int8 model."""
    model_dir = tiny_dirs["qwen3"]
    sharded = sharded_logits(model_dir, 2, tmp_path, quantization="int8")
    for got, whole, exact in zip(sharded, whole_logits(model_dir, "int8"), whole_logits(model_dir)):
        whole_error = (whole - exact).abs().max()
        assert (got - exact).abs().max() <= 1.25 * whole_error
        assert (got - whole).abs().max() <= whole_error


@pytest.mark.slow
def test_smollm2_three_ranks_match_one(smollm2_dir: Path, tmp_path: Path) -> None:
    """9 query heads and 3 KV heads over 3 ranks."""
    assert_sharded_matches_whole(smollm2_dir, 3, tmp_path)


def test_heads_and_rows_per_rank() -> None:
    spec = model_spec(tiny_config("qwen3", 256))  # 4 query heads, 2 KV heads, intermediate 96
    shards = [head_shard(spec, TensorParallel(rank, 4)) for rank in range(4)]
    assert [(s.q_start, s.q_count) for s in shards] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    # Query heads 0-1 read KV head 0, 2-3 KV head 1: each KV head on the ranks of its queries.
    assert [(s.kv_start, s.kv_count) for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [(s.inter_start, s.inter_count) for s in shards] == [(0, 24), (24, 24), (48, 24), (72, 24)]
    halves = [head_shard(spec, TensorParallel(rank, 2)) for rank in range(2)]
    assert [(s.q_start, s.q_count, s.kv_start, s.kv_count) for s in halves] == [(0, 2, 0, 1), (2, 2, 1, 1)]


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (3, "tensor-parallel size 3 does not divide the model's 4 attention heads"),
        (8, "tensor-parallel size 8 does not divide the model's 4 attention heads"),
    ],
)
def test_sizes_that_do_not_divide_are_refused(size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        head_shard(model_spec(tiny_config("qwen3", 256)), TensorParallel(0, size))


def test_the_leaders_messages_reach_every_rank_whole(tmp_path: Path) -> None:
    """Short plans inline in one broadcast, a long one (prompt tokens) in a second."""
    out = tmp_path / "received.pt"
    mp.spawn(tp_ranks.channel_echo, args=(3, tmp_path / "rendezvous", out), nprocs=3, join=True)
    assert pickle.loads(out.read_bytes()) == tp_ranks.CHANNEL_MESSAGES


def test_the_leaders_messages_reach_a_rank_through_its_pipe_whole() -> None:
    """The channel of ranks on one machine: each message whole and in order, one larger than the
    pipe's buffer included (the reader drains it while the leader writes)."""
    read_fd, write_fd = plan_pipe()
    messages = [*tp_ranks.CHANNEL_MESSAGES[:2], (PLAN, bytes(range(256)) * 8000), *tp_ranks.CHANNEL_MESSAGES[2:]]
    received: list[tuple[int, bytes]] = []

    def follow() -> None:
        channel = PlanChannel(TensorParallel(1, 2, plan_fds=(read_fd,)))
        while not received or received[-1][0] != STOP:
            received.append(channel.receive())

    follower = threading.Thread(target=follow)
    follower.start()
    leader = PlanChannel(TensorParallel(0, 2, plan_fds=(write_fd,)))
    for kind, payload in messages:
        leader.send(kind, payload)
    follower.join(timeout=30)
    assert received == messages
    assert leader.messages == len(messages)
    os.close(read_fd)
    with pytest.raises(RankLost, match="rank exited"):  # the rank's end is gone
        leader.send(PLAN, b"p")
    os.close(write_fd)


def test_a_rank_whose_leader_is_gone_gets_rank_lost() -> None:
    read_fd, write_fd = plan_pipe()
    os.close(write_fd)
    with pytest.raises(RankLost, match="plan channel closed"):
        PlanChannel(TensorParallel(1, 2, plan_fds=(read_fd,))).receive()
    os.close(read_fd)
