"""Counter-based randomness keyed by (seed, position, token id, stream).

Every random number the worker draws is a pure function of the request's seed, the absolute
sequence position of the token being decided, the vocabulary id and a stream number, never of the
batch slot or the step. A seeded request therefore produces the same tokens alone or batched,
sync or async, with or without speculation or preemption.

The hash works on 32-bit words. The torch reference keeps every word in an int64 tensor below
2**32 and multiplies only by constants below 2**31, so no product reaches 2**63 (signed overflow
would be undefined); masking to 32 bits then gives exactly what Triton's wrapping uint32
arithmetic gives, so both implementations are bit-identical.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, next_power_of_2, tl, triton, use_triton

STREAM_SAMPLE = 0
"""Gumbel / exponential-race noise for sampling a token (also the bonus token of verification)."""
STREAM_ACCEPT = 1
"""Acceptance uniforms of rejection sampling (one per draft position, token id 0)."""
STREAM_RESIDUAL = 2
"""Noise for resampling from the residual distribution after a rejection."""

_MASK32 = 0xFFFFFFFF
# Salts separate the two key lanes; streams are added to them (a stream is a small integer).
_SALT_A = 0x2545F491
_SALT_B = 0x6A09E667
# Odd multipliers below 2**31 so that the int64 products in the torch path cannot overflow.
_MUL_1 = 0x21F0AAAD
_MUL_2 = 0x735A2D97
# 2**-24: an odd 24-bit integer times this is exactly representable and strictly inside (0, 1).
_UNIT = 1.0 / 16777216.0


def _mix32(x: Tensor) -> Tensor:
    """A xorshift-multiply avalanche of 32-bit words held in int64 (bijective on [0, 2**32))."""
    x = x ^ (x >> 16)
    x = (x * _MUL_1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_2) & _MASK32
    return x ^ (x >> 15)


def _row_keys(seeds: Tensor, positions: Tensor, stream: int) -> tuple[Tensor, Tensor]:
    """Two independent-looking 32-bit lanes per row, so distinct rows collide with p ~ 2**-64."""
    s_lo, s_hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    p_lo, p_hi = positions & _MASK32, (positions >> 32) & _MASK32
    a = _mix32(s_lo ^ (_SALT_A + stream))
    a = _mix32(a ^ s_hi)
    a = _mix32(a ^ p_lo)
    a = _mix32(a ^ p_hi)
    b = _mix32(p_lo ^ (_SALT_B + stream))
    b = _mix32(b ^ s_lo)
    b = _mix32(b ^ p_hi)
    b = _mix32(b ^ s_hi)
    return a, b


def _keyed_uniform_torch(seeds: Tensor, positions: Tensor, vocab_size: int, stream: int) -> Tensor:
    a, b = _row_keys(seeds.to(torch.int64), positions.to(torch.int64), stream)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    x = _mix32(_mix32(a[:, None] ^ tokens[None, :]) ^ b[:, None])
    return (((x >> 9) << 1) | 1).to(torch.float32) * _UNIT


if HAS_TRITON:
    # The same constants as the torch path, visible inside jit code.
    _SALT_A_C: tl.constexpr = tl.constexpr(_SALT_A)
    _SALT_B_C: tl.constexpr = tl.constexpr(_SALT_B)
    _MUL_1_C: tl.constexpr = tl.constexpr(_MUL_1)
    _MUL_2_C: tl.constexpr = tl.constexpr(_MUL_2)
    _UNIT_C: tl.constexpr = tl.constexpr(_UNIT)

    @triton.jit
    def mix32(x):
        """Triton twin of `_mix32` on uint32 words (wrapping multiplication)."""
        x = x ^ (x >> 16)
        x = x * _MUL_1_C
        x = x ^ (x >> 15)
        x = x * _MUL_2_C
        return x ^ (x >> 15)

    @triton.jit
    def keyed_row_keys(seed, position, STREAM: tl.constexpr):
        """Triton twin of `_row_keys` for one scalar (seed, position)."""
        s_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        s_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        p_lo = (position & 0xFFFFFFFF).to(tl.uint32)
        p_hi = ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
        a = mix32(s_lo ^ (_SALT_A_C + STREAM))
        a = mix32(a ^ s_hi)
        a = mix32(a ^ p_lo)
        a = mix32(a ^ p_hi)
        b = mix32(p_lo ^ (_SALT_B_C + STREAM))
        b = mix32(b ^ s_lo)
        b = mix32(b ^ p_hi)
        b = mix32(b ^ s_hi)
        return a, b

    @triton.jit
    def keyed_unit(key_a, key_b, tokens):
        """Uniforms strictly inside (0, 1) for token ids under one row key (bit-exact twin)."""
        x = mix32(mix32(key_a ^ tokens.to(tl.uint32)) ^ key_b)
        return (((x >> 9) << 1) | 1).to(tl.float32) * _UNIT_C

    @triton.jit
    def _keyed_uniform_kernel(
        seeds_ptr, positions_ptr, out_ptr, vocab_size, STREAM: tl.constexpr, BLOCK_V: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        key_a, key_b = keyed_row_keys(
            tl.load(seeds_ptr + row).to(tl.int64), tl.load(positions_ptr + row).to(tl.int64), STREAM
        )
        u = keyed_unit(key_a, key_b, cols)
        tl.store(out_ptr + row.to(tl.int64) * vocab_size + cols, u, mask=cols < vocab_size)


# A custom op (with a fake implementation) so that sampling runs under FakeTensorMode, where the
# kernel-count test counts it, and torch.compile can trace it.
@torch.library.custom_op("zerobubble::keyed_uniform", mutates_args=())
def _keyed_uniform_triton(seeds: Tensor, positions: Tensor, vocab_size: int, stream: int) -> Tensor:
    num_rows = seeds.shape[0]
    out = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=seeds.device)
    if num_rows == 0 or vocab_size == 0:
        return out
    block_v = min(1024, next_power_of_2(vocab_size))
    grid = (num_rows, triton.cdiv(vocab_size, block_v))
    _keyed_uniform_kernel[grid](
        seeds.contiguous(), positions.contiguous(), out, vocab_size, STREAM=stream, BLOCK_V=block_v
    )
    return out


@_keyed_uniform_triton.register_fake
def _(seeds: Tensor, positions: Tensor, vocab_size: int, stream: int) -> Tensor:
    return seeds.new_empty((seeds.shape[0], vocab_size), dtype=torch.float32)


def keyed_uniform(
    seeds: Tensor,
    positions: Tensor,
    vocab_size: int,
    stream: int = STREAM_SAMPLE,
    impl: KernelImpl = None,
) -> Tensor:
    """Uniform noise ``[N, vocab_size]`` float32, strictly inside (0, 1).

    Element ``[i, v]`` is a hash of ``(seeds[i], positions[i], v, stream)`` only, so the same
    request position gets the same noise in any batch. ``seeds`` and ``positions`` are ``[N]``
    integer tensors (int64 for the full range). Values are odd multiples of 2**-24 (23 random
    bits). Triton and torch implementations are bit-identical.
    """
    if use_triton(seeds, impl, _keyed_uniform_kernel if HAS_TRITON else None):
        return _keyed_uniform_triton(seeds, positions, vocab_size, stream)
    return _keyed_uniform_torch(seeds, positions, vocab_size, stream)
