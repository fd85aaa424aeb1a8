"""Kernels per decode step on the CUDA path, counted without a GPU.

A decode step of a 1-2B model on a large GPU is bound by how many kernels it launches, not by
arithmetic: inside a CUDA graph each still costs a few microseconds. The forward and sampling run
here under ``FakeTensorMode`` on ``device="cuda"`` (no storage, no device), at the shape of
Qwen3-1.7B in bfloat16, and every dispatched op that would launch a kernel is counted: aten
compute ops and our Triton custom ops; views, reshapes and bare allocations launch nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from zerobubble.kernels._triton import HAS_TRITON
from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.worker_svc.model import CausalLM, allocate_kv_cache, build_model
from zerobubble.worker_svc.sampler import SamplingTensors, sample

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the CUDA path needs triton installed")

MAX_PER_LAYER = 10
# With an index: a bare "cuda" would ask this CUDA-less build for its current device.
DEVICE = "cuda:0"
# Embedding, RoPE table rows, final norm, logits rows, lm_head, sampling; and a 16-bit model's
# leading logits recomputed in float32 (top-k, their weight rows, one batched product, the scatter).
MAX_OUTSIDE_LAYERS = 12
_NO_LAUNCH = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.prim.device.default,
}


@dataclass
class KernelCounter(TorchDispatchMode):
    """Counts kernel-launching ops, in segments split by :meth:`mark` (one per decoder layer)."""

    segments: list[Counter[str]] = field(default_factory=lambda: [Counter()])

    def __post_init__(self) -> None:
        super().__init__()

    def mark(self) -> bool:
        self.segments.append(Counter())
        return False  # as CausalLM.interrupt: never stop the forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not (func.is_view or func in _NO_LAUNCH):
            self.segments[-1][str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _qwen3_1p7b():  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip


def _qwen3_30b_a3b(num_layers: int = 4):  # type: ignore[no-untyped-def]
    """Qwen3-30B-A3B's shape (128 experts, 8 per token), fewer layers: every layer is the same."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=num_layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip


def _gpt_oss_20b(num_layers: int = 4):  # type: ignore[no-untyped-def]
    """gpt-oss-20b's shape (32 experts, 4 per token, sinks, a 128-token window on alternate
    layers, YaRN by default), fewer layers."""
    from transformers import GptOssConfig

    return GptOssConfig(num_hidden_layers=num_layers, num_local_experts=32, max_position_embeddings=4096)


def _weight_shapes(hf_config) -> dict[str, torch.Size]:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return {name: t.shape for name, t in AutoModelForCausalLM.from_config(hf_config).state_dict().items()}


def _fake_model(hf_config, mode: FakeTensorMode, device: str) -> CausalLM:  # type: ignore[no-untyped-def]
    """The model with fake weights and RoPE tables on ``device`` (a real tensor's copy to a device
    this build lacks would really run, so the tables computed on the CPU are replaced)."""
    shapes = _weight_shapes(hf_config)
    model = build_model(hf_config, torch.bfloat16, "cpu")
    with mode:
        model.device = torch.device(device)
        model.rope.cos = torch.empty(model.rope.cos.shape, dtype=torch.bfloat16, device=device)
        model.rope.sin = torch.empty(model.rope.sin.shape, dtype=torch.bfloat16, device=device)
        model.load_weights({n: torch.empty(shape, dtype=torch.bfloat16, device=device) for n, shape in shapes.items()})
    return model


def _decode_batch(num_rows: int, context: int, block_size: int, device: str) -> tuple[torch.Tensor, ...]:
    blocks_per_row = -(-(context + 1) // block_size)
    return (
        torch.zeros(num_rows, dtype=torch.long, device=device),  # input ids
        torch.full((num_rows,), context, dtype=torch.long, device=device),  # positions
        torch.arange(num_rows + 1, dtype=torch.int32, device=device),  # query_start_loc
        torch.full((num_rows,), context + 1, dtype=torch.int32, device=device),  # seq_lens
        torch.zeros(num_rows, blocks_per_row, dtype=torch.int32, device=device),  # block tables
    )


def _count_step(temperatures: list[float], top_ks: list[int], hf_config=None) -> KernelCounter:  # type: ignore[no-untyped-def]
    """One decode step of ``len(temperatures)`` rows: forward, logits, sampling (Qwen3-1.7B's
    shape unless ``hf_config`` says otherwise)."""
    num_rows, context, block_size = len(temperatures), 100, 16
    random = [i for i, t in enumerate(temperatures) if t > 0]
    hf_config = hf_config or _qwen3_1p7b()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fake_model(hf_config, mode, DEVICE)
    with mode, torch.inference_mode():
        kv_caches = allocate_kv_cache(hf_config, num_rows * 8, block_size, torch.bfloat16, DEVICE)
        input_ids, positions, qsl, seq_lens, tables = _decode_batch(num_rows, context, block_size, DEVICE)
        meta = AttentionMetadata(qsl, seq_lens, tables, 1, context + 1, positions.clone())
        logits_rows = torch.arange(num_rows, device=DEVICE)
        params = SamplingTensors(
            temperature=torch.tensor(temperatures, device=DEVICE),
            top_k=torch.tensor(top_ks, dtype=torch.int32, device=DEVICE),
            top_p=torch.ones(num_rows, device=DEVICE),
            seeds=torch.zeros(num_rows, dtype=torch.long, device=DEVICE),
            positions=positions,
            all_greedy=all(t <= 0 for t in temperatures),
            any_filter=any(k > 0 for k in top_ks),
            random_rows=torch.tensor(random, device=DEVICE) if 0 < len(random) < num_rows else None,
        )
        counter = KernelCounter()
        model.interrupt = counter.mark
        with counter:
            hidden = model(input_ids, positions, meta, kv_caches)
            counter.mark()  # after the last layer
            sample(model.compute_logits(hidden.index_select(0, logits_rows)), params)
    return counter


def test_a_greedy_decode_step_launches_at_most_ten_kernels_a_layer() -> None:
    counter = _count_step([0.0] * 16, [0] * 16)
    # Segments: before the first layer, one per layer (the last one ends with the final norm),
    # then the logits and sampling.
    first, *layers, last_layer, after = counter.segments
    assert len(layers) == 27
    worst = max(layers, key=lambda c: sum(c.values()))
    assert sum(worst.values()) <= MAX_PER_LAYER, dict(worst)
    # Every layer's kernels are our fused ops and the matmuls, nothing left over elementwise.
    fused = ("add_rms_norm", "qk_norm_rope", "silu_mul", "write_kv_cache", "paged_attention")
    assert set(worst) <= {"aten.linear", "aten.mm", *(f"zerobubble.{op}" for op in fused)}, dict(worst)
    outside = first + (last_layer - worst) + after
    assert sum(outside.values()) <= MAX_OUTSIDE_LAYERS, dict(outside)
    # A greedy row needs neither noise nor a sort.
    assert "zerobubble.keyed_uniform" not in outside and "aten.sort" not in outside, dict(outside)


def test_sampled_rows_pay_only_for_what_they_use() -> None:
    """Random rows without top-k/top-p take noise but no sort; the count does not grow with rows."""
    few = _count_step([0.0] * 12 + [0.8] * 4, [0] * 16)
    many = _count_step([0.0] * 4 + [0.8] * 60, [0] * 64)
    last_few, last_many = few.segments[-1], many.segments[-1]
    assert "aten.sort" not in last_few, dict(last_few)
    assert last_few["zerobubble.keyed_uniform"] == 1, dict(last_few)
    assert last_few == last_many  # no per-row Python loop anywhere in sampling


# An MoE layer adds to the attention's kernels the router's product, the top-k routing and its
# sort by expert (softmax, top-k, renormalizing, sort, offsets, token rows), the rows' gather,
# the two grouped products with SiLU between them, and the weighted sum back to token order.
MAX_PER_MOE_LAYER = 24


def test_an_moe_decode_step_runs_grouped_products_without_reading_the_device() -> None:
    """A Qwen3-30B-A3B-shaped decode step on fake CUDA tensors (where a read of the expert loads
    back to the host would raise): each layer's experts are two grouped products, not a loop
    over experts, and the count per layer is bounded."""
    counter = _count_step([0.0] * 16, [0] * 16, _qwen3_30b_a3b())
    first, *layers, last_layer, after = counter.segments
    assert len(layers) == 3
    worst = max(layers, key=lambda c: sum(c.values()))
    assert worst["zerobubble.grouped_linear"] == 2, dict(worst)
    assert sum(worst.values()) <= MAX_PER_MOE_LAYER, dict(worst)


def test_a_gpt_oss_decode_step_takes_its_sinks_biases_and_clamped_swiglu_in_the_fused_kernels() -> None:
    """gpt-oss's differences add no kernels but its biases: the sinks ride in the attention
    kernel, the clamped SwiGLU is one kernel, each expert bias one gather-and-add."""
    counter = _count_step([0.0] * 16, [0] * 16, _gpt_oss_20b())
    first, *layers, last_layer, after = counter.segments
    assert len(layers) == 3
    worst = max(layers, key=lambda c: sum(c.values()))
    assert worst["zerobubble.grouped_linear"] == 2 and worst["zerobubble.clamped_swiglu_mul"] == 1, dict(worst)
    assert worst["zerobubble.paged_attention"] == 1, dict(worst)
    assert sum(worst.values()) <= MAX_PER_MOE_LAYER + 4, dict(worst)  # two bias rows gathered and added
