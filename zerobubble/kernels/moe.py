"""Routed experts of a mixture-of-experts layer: top-k routing, tokens grouped by expert, one
grouped product per projection.

One forward serves every family (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss); what differs between
them is data (`route`'s ``renormalize``, the experts' biases and activation: gpt-oss's clamped
SwiGLU; the shared expert is the caller's). A token's ``k`` choices
become ``k`` rows, sorted by expert id (`Routing`): each expert's rows are contiguous, so a
projection of all experts is one grouped product over ``[E, out, in]`` weights:

- on CUDA the Triton kernel (`grouped_linear`, a custom op with a fake implementation): one
  program per (block of one expert's rows, output tile), found from the expert offsets on the
  device, so a step never reads the expert loads back to the host (CUDA graphs, async steps);
- on the CPU the chosen experts only: a decode row reads its top-k experts' weights and never
  the others'. Where every expert is the compiled block product's (bfloat16 models on AVX-512
  BF16, int8 codes too) the whole layer is one compiled op (``zerobubble_cpu.moe_experts``,
  ``csrc/moe.cpp``): the experts' blocks are stacked at load time and one thread team shares
  the work items (48 outputs of one expert with rows) of gate/up, the activation (SwiGLU or
  gpt-oss's clamped one) and down, then the weighted sum per token, rounded and added where
  the per-expert path rounds and adds (the same bits), where a product per expert and
  projection would fork its own threads and pay its own dispatch. Elsewhere (oneDNN's
  bfloat16 product, int8 codes by another product, int4, float32) each expert runs its own
  products from :mod:`zerobubble.kernels.linear` (`ExpertWeights.gate_up_each`);
- elsewhere the torch twin (`grouped_linear_twin`), the reference of all.

Under expert parallelism a rank holds some of the router's experts (`ExpertWeights.first`): it
computes the pairs of those alone (`local_routing`), every other pair contributing zero.

The routing weights stay float32 and the ``k`` weighted outputs of a token are summed in float32
(Hugging Face rounds Qwen's weights to the model dtype first and sums in it: the same in float32,
one rounding less in 16-bit dtypes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, is_interpreted, next_power_of_2, tl, triton, use_triton
from zerobubble.kernels.fused import clamped_swiglu_mul, silu_mul
from zerobubble.kernels.linear import LinearWeight, linear


@dataclass(frozen=True, slots=True)
class Routing:
    """A batch's ``T * k`` (token, expert) pairs sorted by expert.

    ``tokens[j]`` is the token row of sorted pair ``j`` and ``weights[j]`` its routing weight
    (float32); expert ``e``'s pairs are ``offsets[e]:offsets[e + 1]`` (``[E + 1]``, int64, on the
    tokens' device), and ``experts[j]`` is pair ``j``'s expert (what picks its biases).
    """

    tokens: Tensor
    weights: Tensor
    offsets: Tensor
    experts: Tensor


ActMul = Callable[[Tensor, KernelImpl], Tensor]  # gate·up [N, 2 I] -> [N, I]


@dataclass(slots=True, eq=False)
class ExpertWeights:
    """Every expert's gated-MLP projections, in one of two forms: stacked (``gate_up [E, 2 I, H]``,
    gate rows first, and ``down [E, H, I]``) for the grouped kernel and its twin, or one
    `LinearWeight` per expert (``gate_up_each``, ``down_each``) for the CPU products; optional
    biases ``[E, 2 I]`` and ``[E, H]`` (gpt-oss), never quantized; the activation (SwiGLU unless
    the family says otherwise). Under expert parallelism they are the experts
    ``[first, first + num_experts)`` of the router's.

    Where every expert's products are the compiled block product (bfloat16 models on AVX-512
    BF16), their blocks are also stacked, ``gate_up_blocks [E, blocks, H / 2, 16, 2]`` and
    ``down_blocks`` (int8 codes: with ``gate_up_scale [E, 2 I]``, ``down_scale [E, H]``), for
    the compiled experts op; each expert's `LinearWeight` reads a view of them (one copy)."""

    num_experts: int
    gate_up: Tensor | None = None
    down: Tensor | None = None
    gate_up_each: list[LinearWeight] | None = None
    down_each: list[LinearWeight] | None = None
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    act_mul: ActMul = field(default=silu_mul)
    first: int = 0
    gate_up_blocks: Tensor | None = None
    down_blocks: Tensor | None = None
    gate_up_scale: Tensor | None = None
    down_scale: Tensor | None = None


def expert_weights(
    gate_up: Tensor,
    down: Tensor,
    make: Callable[[Tensor], LinearWeight] | None = None,
    biases: tuple[Tensor, Tensor | None] | None = None,
    act_mul: ActMul = silu_mul,
    first: int = 0,
) -> ExpertWeights:
    """Experts from stacked ``gate_up [E, 2 I, H]`` and ``down [E, H, I]``: kept stacked, or with
    ``make`` (e.g. `zerobubble.kernels.linear.prepare_linear`) one `LinearWeight` per expert
    (their blocks stacked where all are the block product's); ``biases``: ``(gate_up [E, 2 I],
    down [E, H] or None)``; ``first``: the router's id of the first of them (expert parallel: a
    rank's share)."""
    num_experts = gate_up.shape[0]
    if make is None:
        experts = ExpertWeights(num_experts, gate_up=gate_up.contiguous(), down=down.contiguous())
    else:
        gate_up_each, gate_up_blocks, gate_up_scale = _made_experts(gate_up, make)
        down_each, down_blocks, down_scale = _made_experts(down, make)
        experts = ExpertWeights(num_experts, gate_up_each=gate_up_each, down_each=down_each)
        if gate_up_blocks is not None and down_blocks is not None and gate_up_blocks.dtype == down_blocks.dtype:
            experts.gate_up_blocks, experts.down_blocks = gate_up_blocks, down_blocks
            experts.gate_up_scale, experts.down_scale = gate_up_scale, down_scale
    if biases is not None:
        experts.gate_up_bias, experts.down_bias = biases
    experts.act_mul, experts.first = act_mul, first
    return experts


def _made_experts(
    stack: Tensor, make: Callable[[Tensor], LinearWeight]
) -> tuple[list[LinearWeight], Tensor | None, Tensor | None]:
    """One `LinearWeight` per expert of ``stack [E, out, in]``, and, where every one is run by
    the block product alone, their blocks ``[E, ...]`` (and int8 codes' scales ``[E, out]``):
    each expert's blocks are copied in as it is made and it keeps a view, so the layer's weights
    are never held twice."""
    num_experts = stack.shape[0]
    weights: list[LinearWeight] = []
    blocks: Tensor | None = None
    for e in range(num_experts):
        weight = make(stack[e].contiguous())
        if weight.blocks is not None and set(weight.plan) == {"blocks"} and (e == 0 or blocks is not None):
            if blocks is None:
                blocks = weight.blocks.new_empty((num_experts, *weight.blocks.shape))
            blocks[e].copy_(weight.blocks)
            weight.blocks = blocks[e]
        else:
            blocks = None  # an expert another product runs: the per-expert loop serves the layer
        weights.append(weight)
    if blocks is None or blocks.dtype != torch.int8:
        return weights, blocks, None
    scales = torch.stack([weight.int8_scale for weight in weights if weight.int8_scale is not None])
    for e, weight in enumerate(weights):
        weight.int8_scale = scales[e]
    return weights, blocks, scales


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts (float32), the ``top_k`` largest per token, renormalized to sum
    to one when ``renormalize`` (Qwen's ``norm_topk_prob``; Mixtral always, which equals its
    softmax over the top-k logits); pairs sorted by expert."""
    num_tokens, num_experts = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_weights, top_experts = probs.topk(top_k, dim=-1)
    if renormalize:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    # Stable: a token's pairs keep their order within an expert, as in Hugging Face's loop.
    sorted_experts, order = top_experts.flatten().sort(stable=True)
    bounds = torch.arange(num_experts + 1, device=router_logits.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, bounds)
    return Routing(
        tokens=order // top_k,
        weights=top_weights.flatten().index_select(0, order),
        offsets=offsets,
        experts=sorted_experts,
    )


def routed_experts(x: Tensor, routing: Routing, experts: ExpertWeights, impl: KernelImpl = None) -> Tensor:
    """``sum_k weight_k * expert_k(x)`` per token of ``x [T, H]``: float32 ``[T, H]``; with some of
    the router's experts (expert parallel), the sum over the pairs of those only."""
    local = None
    if experts.num_experts < routing.offsets.shape[0] - 1:
        routing, local = local_routing(routing, experts.first, experts.num_experts)
    rows = x.index_select(0, routing.tokens)
    activation = _compiled_activation(rows, experts)
    if activation is not None:  # the weighted sum in the same call (other ranks' rows add nothing)
        return _compiled_mlps(rows, routing.offsets, experts, activation, (routing, x.shape[0]))
    out = expert_mlps(rows, routing.offsets, experts, impl, routing.experts).float()
    if local is not None:  # the other experts' rows: never written
        out = torch.where(local.unsqueeze(-1), out, 0.0)
    weighted = out * routing.weights.unsqueeze(-1)
    summed = torch.zeros(x.shape[0], out.shape[1], dtype=torch.float32, device=x.device)
    return summed.index_add_(0, routing.tokens, weighted)


def local_routing(routing: Routing, first: int, count: int) -> tuple[Routing, Tensor]:
    """``routing`` over experts ``[first, first + count)`` only, and which pairs are theirs
    (``[T k]`` bool). The pairs stay where they are (their number is the device's to know: a
    step never reads it back): the offsets are the slice of those experts, absolute, so products
    write their rows only, and the expert ids are local, clamped, for their biases."""
    experts = routing.experts - first
    local = (experts >= 0) & (experts < count)
    offsets = routing.offsets.narrow(0, first, count + 1)
    return Routing(routing.tokens, routing.weights, offsets, experts.clamp(0, count - 1)), local


def expert_mlps(
    rows: Tensor, offsets: Tensor, experts: ExpertWeights, impl: KernelImpl = None, expert_ids: Tensor | None = None
) -> Tensor:
    """Each expert's gated MLP over its rows ``offsets[e]:offsets[e + 1]`` of ``rows [N, H]``;
    ``expert_ids [N]``: each row's expert (`Routing.experts`), needed with biases."""
    activation = _compiled_activation(rows, experts)
    if activation is not None:
        return _compiled_mlps(rows, offsets, experts, activation)
    if experts.gate_up_each is not None:
        return _per_expert_mlps(rows, offsets, experts, impl)
    assert experts.gate_up is not None and experts.down is not None
    gate_up = _add_bias(grouped_linear(rows, experts.gate_up, offsets, impl), experts.gate_up_bias, expert_ids)
    out = grouped_linear(experts.act_mul(gate_up, impl), experts.down, offsets, impl)
    return _add_bias(out, experts.down_bias, expert_ids)


def _add_bias(out: Tensor, bias: Tensor | None, index: Tensor | int | None) -> Tensor:
    """``out`` plus the bias row of each row's expert (``index``: the rows' experts, or one
    expert for all): a separate add after the product, as Hugging Face's ``x @ W + b``."""
    if bias is None:
        return out
    assert index is not None, "biased experts need the rows' expert ids"
    return out + (bias[index] if isinstance(index, int) else bias.index_select(0, index))


def _per_expert_mlps(rows: Tensor, offsets: Tensor, experts: ExpertWeights, impl: KernelImpl) -> Tensor:
    # The CPU path: the offsets are host memory, and only experts with rows are read.
    assert experts.gate_up_each is not None and experts.down_each is not None
    bounds = offsets.tolist()
    out = rows.new_empty(rows.shape[0], experts.down_each[0].num_outputs)
    for e in range(experts.num_experts):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            gate_up = _add_bias(linear(rows[start:end], experts.gate_up_each[e]), experts.gate_up_bias, e)
            down = linear(experts.act_mul(gate_up, impl), experts.down_each[e])
            out[start:end] = _add_bias(down, experts.down_bias, e)
    return out


# The activations of the compiled experts op (csrc/moe.cpp's `activation`).
_SWIGLU, _CLAMPED_SWIGLU = 0, 1


def _compiled_activation(rows: Tensor, experts: ExpertWeights) -> tuple[int, float, float] | None:
    """``(activation, alpha, limit)`` for the compiled experts op where it runs these experts over
    bfloat16 ``rows`` (their blocks stacked, an activation it has, biases in the model dtype);
    None where the per-expert loop serves."""
    if experts.gate_up_blocks is None or rows.dtype != torch.bfloat16:
        return None
    if any(bias is not None and bias.dtype != torch.bfloat16 for bias in (experts.gate_up_bias, experts.down_bias)):
        return None
    act = experts.act_mul
    if act is silu_mul:
        return _SWIGLU, 1.0, 0.0
    if isinstance(act, functools.partial) and act.func is clamped_swiglu_mul and not act.args:
        return _CLAMPED_SWIGLU, float(act.keywords["alpha"]), float(act.keywords["limit"])
    return None


def _compiled_mlps(
    rows: Tensor,
    offsets: Tensor,
    experts: ExpertWeights,
    activation: tuple[int, float, float],
    summed_for: tuple[Routing, int] | None = None,
) -> Tensor:
    """The experts' down outputs of ``rows`` by the compiled op (bfloat16 ``[N, H]``); with
    ``summed_for`` (the routing, the token count) their weighted sum per token instead, float32
    ``[T, H]``, added in `routed_experts`' order (the same sums)."""
    # One call for the layer's routed experts: one thread team over (output group, expert)
    # items instead of a forked product per expert and projection (csrc/moe.cpp).
    assert experts.gate_up_each is not None and experts.down_each is not None
    kind, alpha, limit = activation
    tokens, weights, num_tokens = None, None, 0
    if summed_for is not None:
        tokens, weights, num_tokens = summed_for[0].tokens, summed_for[0].weights, summed_for[1]
    out: Tensor = torch.ops.zerobubble_cpu.moe_experts(
        rows.contiguous(), offsets, experts.gate_up_blocks, experts.gate_up_each[0].num_outputs,
        experts.gate_up_scale, experts.gate_up_bias, experts.down_blocks, experts.down_each[0].num_outputs,
        experts.down_scale, experts.down_bias, kind, alpha, limit, tokens, weights, num_tokens,
    )  # fmt: skip
    return out


def grouped_linear_twin(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """``x[offsets[e]:offsets[e+1]] @ weight[e].T`` for every expert ``e``: ``[N, out]`` (reads the
    offsets on the host)."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    bounds = offsets.tolist()
    for e in range(weight.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[e])
    return out


# ---------------------------------------------------------------------------------------------
# Triton grouped product

if HAS_TRITON:

    @triton.jit
    def _grouped_linear_kernel(
        x_ptr, w_ptr, offsets_ptr, out_ptr,
        num_outputs, num_inputs, num_experts, stride_x, stride_we, stride_wn, stride_o,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        """Grid (row blocks, output tiles): each expert's rows split in blocks of BLOCK_M, the
        blocks of all experts numbered in expert order; a program past the last one exits. The
        upper bound of the grid (rows / BLOCK_M + experts) needs no count from the host."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e_idx = tl.arange(0, BLOCK_E)
        in_range = e_idx < num_experts
        starts = tl.load(offsets_ptr + e_idx, mask=in_range, other=0)
        ends = tl.load(offsets_ptr + e_idx + 1, mask=in_range, other=0)
        blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
        past = tl.cumsum(blocks, 0)  # one past each expert's last block
        expert = tl.sum((past <= pid_m).to(tl.int32), 0)
        if expert < num_experts:
            mine = e_idx == expert
            first_block = tl.sum(tl.where(mine, past - blocks, 0), 0)
            row_end = tl.sum(tl.where(mine, ends, 0), 0)
            rows = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
            rows = rows.to(tl.int64)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, num_inputs, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                a_mask = (rows[:, None] < row_end) & (ks[None, :] < num_inputs)
                a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=a_mask, other=0.0)
                b_mask = (cols[None, :] < num_outputs) & (ks[:, None] < num_inputs)
                b = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=b_mask, other=0.0)
                if IEEE:  # float32 inputs, or 16-bit ones widened under the interpreter
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            out_mask = (rows[:, None] < row_end) & (cols[None, :] < num_outputs)
            tl.store(
                out_ptr + rows[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask
            )


def _block_rows(num_rows: int, num_experts: int) -> int:
    # Decode: a few rows per expert, where a wide block would mostly compute padding.
    return 16 if num_rows <= 8 * num_experts else 64


@torch.library.custom_op("zerobubble::grouped_linear", mutates_args=())
def _grouped_linear_op(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    num_rows, num_inputs = x.shape
    num_experts, num_outputs = weight.shape[0], weight.shape[1]
    out = x.new_empty(num_rows, num_outputs)
    if num_rows:
        block_m = _block_rows(num_rows, num_experts)
        # A 64-row block with 64-wide steps spills registers (scripts/compile_kernels.py): 32 does not.
        block_n, block_k = 64, 64 if block_m == 16 else 32
        grid = (triton.cdiv(num_rows, block_m) + num_experts, triton.cdiv(num_outputs, block_n))
        _grouped_linear_kernel[grid](
            x, weight, offsets, out, num_outputs, num_inputs, num_experts,
            x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=next_power_of_2(num_experts),
            # The interpreter's 16-bit dot is wrong (numpy has no bfloat16): it widens them.
            IEEE=x.dtype == torch.float32 or is_interpreted(_grouped_linear_kernel),
        )  # fmt: skip
    return out


@_grouped_linear_op.register_fake
def _(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor, impl: KernelImpl = None) -> Tensor:
    """``x [N, in]`` (rows sorted by expert) times each row's expert's ``weight [E, out, in]``,
    expert ``e``'s rows being ``offsets[e]:offsets[e + 1]``: ``[N, out]``."""
    if use_triton(x, impl, _grouped_linear_kernel if HAS_TRITON else None):
        x, weight = x.contiguous(), weight.contiguous()
        result: Tensor = torch.ops.zerobubble.grouped_linear(x, weight, offsets)
        return result
    return grouped_linear_twin(x, weight, offsets)
