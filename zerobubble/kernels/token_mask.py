"""Grammar masks on the logits: every token a grammar forbids set to -inf, read straight from
llguidance's packed bitmask (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed).

On CUDA one Triton kernel does it in place, a program per (masked row, block of the
vocabulary), reading 4 bytes of mask per 32 logits; unpacked with torch ops instead, a step of
a thousand masked slots over a 150k vocabulary would hold gigabytes of temporaries. The torch
twin unpacks with shifts and adds a 0 / -inf bias (an addition is one vectorised pass, much
faster on a CPU than a masked fill).
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, tl, triton, use_triton

BITS = 32  # tokens per bitmask word


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """``[M, words]`` int32 bitmask -> ``[M, vocab_size]`` bool, True where allowed (tokens past
    the bitmask are forbidden)."""
    shifts = torch.arange(BITS, device=bitmask.device, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)


def forbidden_bias(forbidden: Tensor) -> Tensor:
    """0/1 -> 0/-inf float32, in two multiplications: 1 overflows to -inf while 0 stays 0
    (multiplying by -inf at once would turn the zeros into NaN)."""
    return forbidden.to(torch.float32).mul_(-3e38).mul_(2.0)


def apply_token_bitmask_twin(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """In place: ``logits[rows[i], t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is clear."""
    bias = forbidden_bias(~unpack_bitmask(bitmask, logits.shape[1]))
    logits.index_add_(0, rows, bias.to(logits.dtype))


if HAS_TRITON:

    @triton.jit
    def _token_bitmask_kernel(
        logits_ptr, rows_ptr, bitmask_ptr, stride_logits, stride_mask, vocab_size, BLOCK: tl.constexpr
    ):
        """Grid (masked rows, vocabulary blocks): clear bit -> -inf, set bit -> untouched."""
        i = tl.program_id(0).to(tl.int64)
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab_size
        row = tl.load(rows_ptr + i).to(tl.int64)
        words = tl.load(bitmask_ptr + i * stride_mask + tokens // 32, mask=inside, other=0)
        forbidden = ((words >> (tokens % 32)) & 1) == 0
        tl.store(
            logits_ptr + row * stride_logits + tokens,
            tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
            mask=inside & forbidden,
        )


@torch.library.custom_op("zerobubble::apply_token_bitmask", mutates_args=("logits",))
def _apply_token_bitmask_op(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    vocab_size = logits.shape[1]
    block = 1024
    if rows.numel():
        _token_bitmask_kernel[(rows.numel(), triton.cdiv(vocab_size, block))](
            logits, rows, bitmask, logits.stride(0), bitmask.stride(0), vocab_size, BLOCK=block
        )


@_apply_token_bitmask_op.register_fake
def _(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    return None


def apply_token_bitmask(logits: Tensor, rows: Tensor, bitmask: Tensor, impl: KernelImpl = None) -> None:
    """In place: every token of logits row ``rows[i]`` whose bit in ``bitmask[i]`` is clear
    becomes -inf (``bitmask``: ``[M, ceil(vocab / 32)]`` int32, ``rows``: ``[M]`` int64, distinct;
    ``logits`` contiguous in its last dimension)."""
    if use_triton(logits, impl, _token_bitmask_kernel if HAS_TRITON else None):
        torch.ops.zerobubble.apply_token_bitmask(logits, rows, bitmask)
        return
    apply_token_bitmask_twin(logits, rows, bitmask)
