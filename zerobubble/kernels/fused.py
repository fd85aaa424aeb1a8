"""Fused elementwise kernels of the decoder layer: residual add + RMSNorm, q/k norm + RoPE, SiLU·up,
GELU(tanh)·up (Gemma's GeGLU) and gpt-oss's clamped SwiGLU.

Between two matmuls a decoder layer is a chain of small elementwise steps. Run one aten op at a
time, a bfloat16 RMSNorm alone is eight kernels (cast, square, mean, add, rsqrt, multiply, cast,
scale) and a layer some forty; each reads and writes the whole activation, and on a GPU each
costs a launch of a few microseconds even inside a CUDA graph. Each function here is one kernel
on CUDA (Triton) or, asked for with ``impl="cpp"``, on the CPU (`zerobubble.kernels.cpu`), and
its torch twin elsewhere. The twins are the model's reference semantics, rounding included:
every intermediate a Hugging Face layer rounds to the model dtype is rounded here too, but for
one: the residual stream is kept in float32 (Hugging Face rounds each sum to the
model dtype, and over a deep stack those roundings move the logits enough to change the argmax
now and then: with the stream in float32, bfloat16 SmolLM2 agrees with float32 on 99.14 % of next
tokens instead of 98.96 %, docs/benchmarks/cpu-llamacpp.md). The Triton kernels match the twins to
within one rounding step in 16-bit dtypes and exactly in float32, the C++ kernels to within one
rounding step (their reductions sum in another order), and the float32 twins are bit for bit
Hugging Face's computation.

Every Triton kernel is reached through a ``torch.library`` custom op with a fake implementation,
so a forward can run under ``FakeTensorMode`` (the kernel-count test) and be traced by
``torch.compile``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, next_power_of_2, tl, triton, use_triton

# ---------------------------------------------------------------------------------------------
# torch twins


def rms_norm_twin(x: Tensor, weight: Tensor, eps: float, dtype: torch.dtype | None = None) -> Tensor:
    """RMSNorm over the last dim, computed in float32 as Hugging Face does, rounded to and scaled
    in ``dtype`` (``x.dtype`` by default; a float32 residual sum is normed into the model dtype).

    ``weight`` is ``[D]``, or ``[H, D]`` for per-head norms of a ``[T, H, D]`` input.
    """
    dtype = dtype or x.dtype
    if dtype == torch.float32 == x.dtype:
        if weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x, weight.shape[-1:], None, eps) * weight
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm_twin(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + residual), x + residual)``; with no residual, ``(rms_norm(x), x)``.

    The sum (the residual stream) is float32 whatever ``x``'s dtype, and ``residual`` may be
    either; the normed activations are in ``x.dtype``, as Hugging Face's norm rounds them.
    """
    summed = x.float() if residual is None else residual.float() + x
    return rms_norm_twin(summed, weight, eps, x.dtype), summed


def qk_norm_rope_twin(qk: Tensor, cos: Tensor, sin: Tensor, norm_weight: Tensor | None, eps: float) -> Tensor:
    """Per-head RMSNorm (when ``norm_weight [H, D]`` is given) then RoPE of ``qk [T, H, D]``.

    ``cos [T, D]`` holds ``(cos, cos)`` and ``sin [T, D]`` holds ``(-sin, sin)`` of each token's
    position, in the half-split layout: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in four ops, bit
    for bit Hugging Face's ``q * cos + rotate_half(q) * sin``.
    """
    if norm_weight is not None:
        qk = rms_norm_twin(qk, norm_weight, eps)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return qk * cos + qk.roll(qk.shape[-1] // 2, -1) * sin


def silu_mul_twin(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 I]`` (gate first, as the fused projection stores them)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_twin(gate_up: Tensor) -> Tensor:
    """``gelu_tanh(gate) * up`` of ``gate_up [T, 2 I]``: Gemma's GeGLU (Hugging Face's
    ``gelu_pytorch_tanh``), the activation rounded to the dtype before the product, as there."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu_mul_twin(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's ``(clamp(up) + 1) * gate * sigmoid(alpha * gate)`` of ``gate_up [T, 2 I]``
    (gate first), the gate clamped above at ``limit`` and up to ``[-limit, limit]``: Hugging
    Face's ``GptOssExperts._apply_gate``, op for op."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# The activations of `_silu_mul_kernel` (its ACT).
_SILU, _GELU_TANH, _CLAMPED_SWIGLU = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# Triton kernels

if HAS_TRITON:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
        stride_x, stride_r, stride_o, stride_ro, hidden, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program per token: the residual sum (float32), then its norm."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x.to(tl.float32) + tl.load(residual_ptr + t * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x32 = x.to(tl.float32)
        tl.store(residual_out_ptr + t * stride_ro + cols, x32, mask=mask)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
        normed = (x32 * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr, cos_ptr, sin_ptr, weight_ptr, out_ptr,
        stride_qkv, stride_cos, stride_sin, stride_o, num_heads, eps,
        HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """One program per token, all its q and k heads: the per-head norm, then the rotation.

        Each element's rotation partner (``d ± D/2``) is loaded a second time from memory rather
        than permuted in registers; both loads hit the same cache lines.
        """
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        partner = (dims + HEAD_DIM // 2) % HEAD_DIM
        mask = (heads < num_heads) & (dims < HEAD_DIM)
        dtype = out_ptr.dtype.element_ty
        row = qkv_ptr + t * stride_qkv + heads * HEAD_DIM
        x = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
            w = tl.load(weight_ptr + heads * HEAD_DIM + dims, mask=mask, other=0.0).to(tl.float32)
            wp = tl.load(weight_ptr + heads * HEAD_DIM + partner, mask=mask, other=0.0).to(tl.float32)
            x = ((x * inv).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
            xp = ((xp * inv).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
        cos = tl.load(cos_ptr + t * stride_cos + dims).to(tl.float32)
        sin = tl.load(sin_ptr + t * stride_sin + dims).to(tl.float32)
        out = (x * cos).to(dtype).to(tl.float32) + (xp * sin).to(dtype).to(tl.float32)
        tl.store(out_ptr + t * stride_o + heads * HEAD_DIM + dims, out.to(dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(
        gate_up_ptr, out_ptr, stride_g, stride_o, inter, alpha, limit, BLOCK: tl.constexpr, ACT: tl.constexpr
    ):
        """Grid (tokens, column blocks): ``silu(gate)`` (ACT ``_GELU_TANH``: ``gelu_tanh(gate)``;
        ``_CLAMPED_SWIGLU``: gpt-oss's ``gate * sigmoid(alpha gate)`` and ``up + 1``, both clamped
        by ``limit``) rounded to the dtype, then times ``up``."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gate_up_ptr + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + t * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 2:  # _CLAMPED_SWIGLU
            gate = tl.minimum(gate, limit)
            up = (tl.minimum(tl.maximum(up, -limit), limit) + 1.0).to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-alpha * gate))).to(dtype).to(tl.float32)
        elif ACT == 1:  # _GELU_TANH
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 where exp over- or underflows.
            act = (0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))).to(dtype).to(tl.float32)
        else:
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + t * stride_o + cols, (act * up).to(dtype), mask=mask)


# ---------------------------------------------------------------------------------------------
# Custom ops around the Triton launches


@torch.library.custom_op("zerobubble::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    num_tokens, hidden = x.shape
    out, residual_out = torch.empty_like(x), torch.empty_like(x, dtype=torch.float32)
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), residual_out.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(hidden),
        )  # fmt: skip
    return out, residual_out


@_add_rms_norm_op.register_fake
def _(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op("zerobubble::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    qkv: Tensor, cos: Tensor, sin: Tensor, norm_weight: Tensor | None, num_heads: int, head_dim: int, eps: float
) -> Tensor:
    num_tokens = qkv.shape[0]
    out = qkv.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens,)](
            qkv, cos, sin, norm_weight if norm_weight is not None else cos, out,
            qkv.stride(0), cos.stride(0), sin.stride(0), out.stride(0), num_heads, eps,
            HEAD_DIM=head_dim, HAS_NORM=norm_weight is not None, BLOCK_H=next_power_of_2(num_heads),
        )  # fmt: skip
    return out


@_qk_norm_rope_op.register_fake
def _(
    qkv: Tensor, cos: Tensor, sin: Tensor, norm_weight: Tensor | None, num_heads: int, head_dim: int, eps: float
) -> Tensor:
    return qkv.new_empty(qkv.shape[0], num_heads, head_dim)


_SILU_BLOCK = 1024


def _launch_act_mul(gate_up: Tensor, act: int, alpha: float = 1.0, limit: float = 0.0) -> Tensor:
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_tokens, inter)
    if num_tokens:
        block = min(_SILU_BLOCK, next_power_of_2(inter))
        grid = (num_tokens, triton.cdiv(inter, block))
        _silu_mul_kernel[grid](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, alpha, limit, BLOCK=block, ACT=act
        )  # fmt: skip
    return out


@torch.library.custom_op("zerobubble::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: Tensor) -> Tensor:
    return _launch_act_mul(gate_up, _SILU)


@_silu_mul_op.register_fake
def _(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("zerobubble::gelu_tanh_mul", mutates_args=())
def _gelu_tanh_mul_op(gate_up: Tensor) -> Tensor:
    return _launch_act_mul(gate_up, _GELU_TANH)


@_gelu_tanh_mul_op.register_fake
def _(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("zerobubble::clamped_swiglu_mul", mutates_args=())
def _clamped_swiglu_mul_op(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    return _launch_act_mul(gate_up, _CLAMPED_SWIGLU, alpha, limit)


@_clamped_swiglu_mul_op.register_fake
def _(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


# ---------------------------------------------------------------------------------------------
# Public functions: Triton on CUDA, the twin elsewhere (``impl`` forces one)


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, impl: KernelImpl = None
) -> tuple[Tensor, Tensor]:
    """``(normed, new_residual)`` for ``x [T, hidden]``: the residual stream's sum (float32) and its
    RMSNorm (in ``x.dtype``)."""
    if impl == "cpp":
        normed, summed = torch.ops.zerobubble_cpu.add_rms_norm(x, residual, weight, eps)
        return normed, summed
    if use_triton(x, impl, _add_rms_norm_kernel if HAS_TRITON else None):
        normed, summed = torch.ops.zerobubble.add_rms_norm(x, residual, weight, eps)
        return normed, summed
    return add_rms_norm_twin(x, residual, weight, eps)


def qk_norm_rope(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    norm_weight: Tensor | None,
    num_heads: int,
    head_dim: int,
    eps: float,
    impl: KernelImpl = None,
) -> Tensor:
    """The first ``num_heads`` heads of ``qkv [T, >= num_heads * head_dim]`` (q then k), normed
    per head when ``norm_weight`` is given and rotated: ``[T, num_heads, head_dim]``."""
    if impl == "cpp":
        rotated: Tensor = torch.ops.zerobubble_cpu.qk_norm_rope(qkv, cos, sin, norm_weight, num_heads, head_dim, eps)
        return rotated
    if use_triton(qkv, impl, _qk_norm_rope_kernel if HAS_TRITON else None):
        result: Tensor = torch.ops.zerobubble.qk_norm_rope(qkv, cos, sin, norm_weight, num_heads, head_dim, eps)
        return result
    qk = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
    return qk_norm_rope_twin(qk, cos, sin, norm_weight, eps)


def silu_mul(gate_up: Tensor, impl: KernelImpl = None) -> Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 I]`` -> ``[T, I]``."""
    if impl == "cpp":
        product: Tensor = torch.ops.zerobubble_cpu.silu_mul(gate_up)
        return product
    if use_triton(gate_up, impl, _silu_mul_kernel if HAS_TRITON else None):
        result: Tensor = torch.ops.zerobubble.silu_mul(gate_up)
        return result
    return silu_mul_twin(gate_up)


def gelu_tanh_mul(gate_up: Tensor, impl: KernelImpl = None) -> Tensor:
    """``gelu_tanh(gate) * up`` of ``gate_up [T, 2 I]`` -> ``[T, I]``. The compiled CPU kernels
    have no GELU, so ``impl="cpp"`` runs the twin."""
    if use_triton(gate_up, impl, _silu_mul_kernel if HAS_TRITON else None):
        result: Tensor = torch.ops.zerobubble.gelu_tanh_mul(gate_up)
        return result
    return gelu_tanh_mul_twin(gate_up)


def clamped_swiglu_mul(gate_up: Tensor, impl: KernelImpl = None, *, alpha: float, limit: float) -> Tensor:
    """gpt-oss's clamped SwiGLU of ``gate_up [T, 2 I]`` -> ``[T, I]`` (`clamped_swiglu_mul_twin`).
    The compiled CPU kernels have none, so ``impl="cpp"`` runs the twin."""
    if use_triton(gate_up, impl, _silu_mul_kernel if HAS_TRITON else None):
        result: Tensor = torch.ops.zerobubble.clamped_swiglu_mul(gate_up, alpha, limit)
        return result
    return clamped_swiglu_mul_twin(gate_up, alpha, limit)
