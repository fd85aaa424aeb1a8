"""Mixture-of-experts layers of Qwen2-MoE, Qwen3-MoE, Mixtral and gpt-oss: what a config says
about them, their weights under the names checkpoints use, and their forward.

The families differ only in data (`MoeSpec`): whether the top-k weights are renormalized
(Qwen's ``norm_topk_prob``; Mixtral's and gpt-oss's softmax over the top-k logits is the same
thing), whether a shared expert with a sigmoid gate runs beside the routed ones (Qwen2-MoE),
which layers are sparse (Qwen's ``decoder_sparse_step`` and ``mlp_only_layers``), and gpt-oss's
biases (router and experts), clamped SwiGLU and expert layout (``gate_up_proj [E, H, 2 I]`` with
gate and up columns interleaved, converted once at load). The routed experts run through
:mod:`zerobubble.kernels.moe`. Over tensor-parallel ranks a layer holds the rank's part of the
experts (`MoeSpec.held_experts`, its intermediate size; `zerobubble.worker_svc.parallel.expert_shard`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from zerobubble.kernels._triton import KernelImpl
from zerobubble.kernels.fused import clamped_swiglu_mul, silu_mul
from zerobubble.kernels.linear import LinearWeight, linear, prepare_linear
from zerobubble.kernels.moe import ActMul, ExpertWeights, expert_weights, route, routed_experts
from zerobubble.worker_svc.parallel import SINGLE, TensorParallel, row_linear

MOE_MODEL_TYPES = frozenset({"qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"})

Taker = Callable[[str, tuple[int, ...]], Tensor]
WeightMaker = Callable[[Tensor], LinearWeight]


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts config's facts: experts, their size, routing, which layers are sparse."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    renormalize: bool
    shared_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]
    # Where checkpoints keep a sparse layer's weights: the block, and each expert's (gate, up, down).
    block: str = "mlp."
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router: str = "gate"  # the router's name in the block
    # gpt-oss: biases on the router and the experts, whose fused projections are stored [E, in, out]
    # with gate and up columns interleaved, and the clamped SwiGLU (limit 0: plain SwiGLU).
    biases: bool = False
    interleaved: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    # A tensor-parallel rank's part (`zerobubble.worker_svc.parallel.shard_spec`): its experts
    # ``[first_expert, + num_local_experts)`` (0: all; expert parallel), and whether it adds the
    # experts' down biases (tensor parallel: the first rank only, the sum over ranks adding them once).
    first_expert: int = 0
    num_local_experts: int = 0
    first_row: int = 0  # tensor parallel: the rank's first intermediate row of each expert
    adds_down_bias: bool = True

    @property
    def held_experts(self) -> range:
        """The global ids of the experts whose weights this rank holds."""
        return range(self.first_expert, self.first_expert + (self.num_local_experts or self.num_experts))


def moe_spec(hf_config: Any, num_layers: int) -> MoeSpec | None:
    """The mixture-of-experts facts of a Qwen2-MoE, Qwen3-MoE, Mixtral or gpt-oss config; None for others."""
    model_type = getattr(hf_config, "model_type", None)
    # Qwen3-MoE's and Mixtral's configs store `num_experts` as `num_local_experts` (an attribute
    # map), which is all a cached config's plain attributes have (model_loader.read_config).
    num_experts = int(getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", 0) or 0)
    if model_type in ("mixtral", "gpt_oss"):
        # Every layer sparse, no shared expert, the chosen experts' weights renormalized.
        every_layer = MoeSpec(
            num_experts=num_experts,
            top_k=int(hf_config.num_experts_per_tok),
            intermediate_size=int(hf_config.intermediate_size),
            renormalize=True,
            shared_intermediate_size=0,
            sparse_layers=(True,) * num_layers,
        )
        if model_type == "mixtral":
            return replace(every_layer, block="block_sparse_moe.", expert_names=("w1", "w3", "w2"))
        return replace(
            every_layer,
            router="router",
            biases=True,
            interleaved=True,
            swiglu_alpha=float(hf_config.swiglu_alpha),
            swiglu_limit=float(hf_config.swiglu_limit),
        )
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return None
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return MoeSpec(
        num_experts=num_experts,
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.moe_intermediate_size),
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_intermediate_size=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
        if model_type == "qwen2_moe"
        else 0,
        sparse_layers=tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)),
    )


@dataclass(slots=True, eq=False)
class MoeLayer:
    """A sparse layer's feed-forward weights: the router ``[E, hidden]``, the routed experts and,
    for Qwen2-MoE, the shared expert and its gate ``[1, hidden]``."""

    router: LinearWeight
    experts: ExpertWeights
    top_k: int
    renormalize: bool
    router_bias: Tensor | None = None  # [E] (gpt-oss)
    shared_gate_up: LinearWeight | None = None  # [2 I_shared, hidden]
    shared_down: LinearWeight | None = None  # [hidden, I_shared]
    shared_gate: LinearWeight | None = None  # [1, hidden]


def gated_mlp(
    x: Tensor,
    gate_up: LinearWeight,
    down: LinearWeight,
    impl: KernelImpl = None,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    act_mul: Callable[[Tensor, KernelImpl], Tensor] = silu_mul,
    tp: TensorParallel = SINGLE,
) -> Tensor:
    """A gated MLP ``down(act(gate x) * up x)`` over fused gate/up rows (SwiGLU by default): a
    dense layer's, a shared expert's; ``down`` row-parallel over ``tp`` (a rank's gate/up rows
    and down columns: the sum over ranks is the whole MLP's output)."""
    return row_linear(act_mul(linear(x, gate_up, gate_up_bias), impl), down, down_bias, tp)


def moe_forward(x: Tensor, layer: MoeLayer, impl: KernelImpl = None, tp: TensorParallel = SINGLE) -> Tensor:
    """A sparse layer's feed-forward output for its normed input ``x [T, hidden]``, in ``x.dtype``.

    Over ``tp`` every rank routes every token with the whole router and computes its part: its
    experts' pairs (expert parallel) or every pair over its share of the rows (tensor parallel),
    and its rows of the shared expert, whose gate scales a sum as well as its terms; the
    routed and shared parts add up locally, and one all-reduce sums the ranks' (the dense MLP's one)."""
    routing = route(linear(x, layer.router, layer.router_bias), layer.top_k, layer.renormalize)
    out = routed_experts(x, routing, layer.experts, impl)  # float32
    if layer.shared_gate_up is not None:
        assert layer.shared_down is not None and layer.shared_gate is not None
        shared = gated_mlp(x, layer.shared_gate_up, layer.shared_down, impl)
        out = out + torch.sigmoid(linear(x, layer.shared_gate)) * shared
    out = out.to(x.dtype)
    return out if tp.size == 1 else tp.all_reduce(out)


def moe_layer_weights(spec: MoeSpec, hidden: int, take: Taker, weight: WeightMaker, prefix: str) -> MoeLayer:
    """A sparse layer's weights under ``prefix``: transformers 5's names (``mlp.experts.gate_up_proj``
    ``[E, 2 I, H]``, ``mlp.experts.down_proj``, ``mlp.gate.weight``) or the checkpoints' per-expert
    ones (``mlp.experts.{e}.gate_proj.weight`` ..., Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``),
    or gpt-oss's (`_interleaved_experts`). On the CPU each expert becomes its own linear weight
    (quantized as the model's), elsewhere they stay stacked for the grouped kernel; the router
    and the biases are never quantized (a routing choice moved by rounding changes the whole
    output)."""
    names = [f"{prefix}{block}{spec.router}.weight" for block in ("mlp.", spec.block)]
    router = _take_any(take, names, (spec.num_experts, hidden))
    if spec.interleaved:
        gate_up, down, biases = _interleaved_experts(spec, hidden, take, prefix + spec.block)
    else:
        (gate_up, down), biases = _stacked_experts(spec, hidden, take, prefix), None
    make = weight if gate_up.device.type == "cpu" else None
    layer = MoeLayer(
        router=prepare_linear(router, prepack=False),
        experts=expert_weights(gate_up, down, make, biases, expert_activation(spec), spec.first_expert),
        top_k=spec.top_k,
        renormalize=spec.renormalize,
        router_bias=take(f"{prefix}{spec.block}{spec.router}.bias", (spec.num_experts,)) if spec.biases else None,
    )
    if spec.shared_intermediate_size:
        shared, size = prefix + "mlp.shared_expert.", spec.shared_intermediate_size
        parts = [take(f"{shared}{name}_proj.weight", (size, hidden)) for name in ("gate", "up")]
        layer.shared_gate_up = weight(torch.cat(parts).contiguous())
        layer.shared_down = weight(take(shared + "down_proj.weight", (hidden, size)))
        layer.shared_gate = prepare_linear(take(prefix + "mlp.shared_expert_gate.weight", (1, hidden)), prepack=False)
    return layer


def expert_activation(spec: MoeSpec) -> ActMul:
    """The experts' gate·up activation: SwiGLU, or gpt-oss's clamped one."""
    if spec.swiglu_limit > 0:
        return functools.partial(clamped_swiglu_mul, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
    return silu_mul


def _interleaved_experts(
    spec: MoeSpec, hidden: int, take: Taker, block: str
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor | None]]:
    """gpt-oss's experts in our stacked layout: ``gate_up_proj [E, H, 2 I]`` (gate and up columns
    interleaved) becomes ``[E, 2 I, H]`` with the gate rows first, ``down_proj [E, I, H]`` becomes
    ``[E, H, I]``, and the biases follow (E and I: this rank's)."""
    num, inter = len(spec.held_experts), spec.intermediate_size
    # Copies by reshape and torch.clone: `Tensor.contiguous` and indexing take a device guard,
    # which a CUDA-less build cannot give even to fake CUDA tensors (tests/inprocess/test_kernel_count.py).
    gate_up = take(block + "experts.gate_up_proj", (num, hidden, 2 * inter)).unflatten(2, (inter, 2))
    gate_up = gate_up.permute(0, 3, 2, 1).reshape(num, 2 * inter, hidden)  # [E, (gate, up), I, H]
    gate_up_bias = take(block + "experts.gate_up_proj_bias", (num, 2 * inter)).unflatten(1, (inter, 2))
    gate_up_bias = gate_up_bias.transpose(1, 2).reshape(num, 2 * inter)
    down = take(block + "experts.down_proj", (num, inter, hidden)).transpose(1, 2)
    down = torch.clone(down, memory_format=torch.contiguous_format)
    down_bias = take(block + "experts.down_proj_bias", (num, hidden)) if spec.adds_down_bias else None
    return gate_up, down, (gate_up_bias, down_bias)


def _take_any(take: Taker, names: list[str], shape: tuple[int, ...]) -> Tensor:
    """The first of ``names`` present; the last one's ``KeyError`` when none is."""
    for name in names[:-1]:
        try:
            return take(name, shape)
        except KeyError:
            pass
    return take(names[-1], shape)


def _stacked_experts(spec: MoeSpec, hidden: int, take: Taker, prefix: str) -> tuple[Tensor, Tensor]:
    """``gate_up [E, 2 I, H]`` and ``down [E, H, I]`` of this rank's experts and rows from the
    fused names or the per-expert ones (only its own experts' read)."""
    num, inter = len(spec.held_experts), spec.intermediate_size
    try:
        fused = prefix + "mlp.experts."
        return take(fused + "gate_up_proj", (num, 2 * inter, hidden)), take(fused + "down_proj", (num, hidden, inter))
    except KeyError:
        pass
    gate, up, down = (f"{prefix}{spec.block}experts.{{}}.{name}.weight" for name in spec.expert_names)
    held = spec.held_experts
    gate_up = torch.stack(
        [torch.cat((take(gate.format(e), (inter, hidden)), take(up.format(e), (inter, hidden)))) for e in held]
    )
    return gate_up, torch.stack([take(down.format(e), (hidden, inter)) for e in held])


# What a GGUF file's metadata says of a mixture of experts that transformers' GGUF config reader
# (5.25) leaves at the config class's defaults: the experts' sizes (under "<arch>.<field>"), and
# whether the top-k weights are renormalized, which llama.cpp's graph fixes per architecture
# (qwen3moe renormalizes, qwen2moe does not) rather than storing it.
GGUF_MOE_FIELDS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
GGUF_NORM_TOPK_PROB = {"qwen3moe": True, "qwen2moe": False}


def gguf_moe_config(fields: dict[str, Any]) -> dict[str, Any]:
    """Config attributes of a Qwen2-MoE or Qwen3-MoE GGUF file from its metadata ``fields`` (name ->
    value); empty for other architectures."""
    arch = fields.get("general.architecture")
    if arch not in GGUF_NORM_TOPK_PROB:
        return {}
    sizes = {attr: int(fields[f"{arch}.{key}"]) for key, attr in GGUF_MOE_FIELDS.items() if f"{arch}.{key}" in fields}
    return {**sizes, "norm_topk_prob": GGUF_NORM_TOPK_PROB[arch]}
