"""gpt-oss checkpoints as OpenAI ships them: the routed experts in MXFP4, dequantized at load.

A released gpt-oss checkpoint (``quantization_config.quant_method "mxfp4"``) stores each layer's
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` as ``<name>_blocks`` ``[E, rows, G, 16]``
uint8 (FP4 E2M1 codes, two per byte, low nibble first: G blocks of 32 values per row) and
``<name>_scales`` ``[E, rows, G]`` uint8 (one E8M0 exponent per block, bias 127); the biases and
every other weight are bfloat16. Without MXFP4 kernels we serve the experts in the model's dtype:
`Mxfp4StateDict` presents each pair under the unquantized name, dequantized only when read, so
one layer at a time exists in both forms and everything downstream (the interleaved-expert
conversion, ``--quantization``, tensor and expert parallelism) sees the bfloat16 checkpoint's
tensors. The values are Hugging Face's (``transformers.integrations.mxfp4.convert_moe_packed_tensors``)
bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

# FP4 E2M1: sign, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``blocks [E, rows, G, 16]`` and ``scales [E, rows, G]`` as ``[E, 32 G, rows]`` in ``dtype``
    on their device (the unquantized checkpoint's layout: Hugging Face's final transpose), a
    transposed view of a contiguous ``[E, rows, 32 G]``. One expert at a time: the float32
    products of the scaling would otherwise take twice a 16-bit layer's size at once."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != BLOCK:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    # Both values of every byte, low nibble first (value 2 i is byte i's low four bits), doubled
    # for `_half_scales`: one lookup per byte.
    doubled = [(2 * FP4_VALUES[b & 15], 2 * FP4_VALUES[b >> 4]) for b in range(256)]
    pairs = torch.tensor(doubled, dtype=dtype, device=blocks.device)
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, rows, groups, BLOCK, dtype=dtype, device=blocks.device)
    for e in range(experts):
        values = pairs[blocks[e].int()].flatten(-2)  # [rows, G, 32]
        # As Hugging Face's ldexp: the exact product in float32, rounded once to ``dtype``.
        torch.mul(values, _half_scales(scales[e]).unsqueeze(-1), out=out[e])
    return out.reshape(experts, rows, groups * BLOCK).transpose(1, 2)


def _half_scales(scales: Tensor) -> Tensor:
    """``2 ** (scale - 128)`` of E8M0 bytes in float32, from its bits (no pow, whose rounding
    could differ by device): exact for every byte, 0 and 1 as subnormals, where ``2 ** (scale - 127)``
    would overflow at 255. Doubled codes times these are Hugging Face's ``ldexp`` products to the
    bit (0 stays 0 at 255, not NaN)."""
    exponent = scales.to(torch.int32)
    normal = (exponent - 1).clamp(min=0) << 23  # bytes from 2: the float32 exponent field byte - 1
    subnormal = torch.full_like(exponent, 0x00200000) << exponent.clamp(max=1)  # 0, 1: 2^-128, 2^-127
    return torch.where(exponent < 2, subnormal, normal).view(torch.float32)


class Mxfp4StateDict(Mapping[str, Tensor]):
    """A state dict whose MXFP4 tensors read as their unquantized names, dequantized to ``dtype``
    on ``device`` on each read (a GPU's dequantization is much the faster, and it moves a quarter
    of the bytes). A tensor-parallel rank reads the blocks covering its intermediate rows
    (`zerobubble.worker_svc.parallel.ShardedStateDict`): ``down_proj``'s intermediate dimension,
    packed in blocks of 32, is then cut to ``down_rows`` (``(start, count)`` within them)."""

    def __init__(
        self, state_dict: Mapping[str, Tensor], dtype: torch.dtype, device: torch.device, down_rows: tuple[int, int]
    ) -> None:
        self.inner, self.dtype, self.device, self.down_rows = state_dict, dtype, device, down_rows
        quantized = {name.removesuffix(SUFFIXES[0]) for name in state_dict if name.endswith(SUFFIXES[0])}
        packed = {base + suffix for base in quantized for suffix in SUFFIXES}
        self.quantized, self.packed = frozenset(quantized), frozenset(packed)
        self.names = [name for name in state_dict if name not in packed] + sorted(quantized)

    def __contains__(self, name: object) -> bool:
        return name in self.quantized or (name in self.inner and name not in self.packed)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.quantized:
            if name not in self:
                raise KeyError(name)
            return self.inner[name]
        blocks, scales = (self.inner[name + suffix].to(self.device) for suffix in SUFFIXES)
        weight = dequantize_mxfp4(blocks, scales, self.dtype)
        if name.endswith("down_proj"):  # [E, I, H]: the rank's intermediate rows
            start, count = self.down_rows
            weight = weight.narrow(1, start, count)
        return weight

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def dequantized(
    state_dict: Mapping[str, Tensor], dtype: torch.dtype, device: torch.device, down_rows: tuple[int, int]
) -> Mapping[str, Tensor]:
    """``state_dict`` itself, or `Mxfp4StateDict` over it where it holds MXFP4 tensors."""
    if not any(name.endswith(SUFFIXES[0]) for name in state_dict):
        return state_dict
    return Mxfp4StateDict(state_dict, dtype, device, down_rows)


def block_range(start: int, count: int) -> tuple[int, int]:
    """``(first block, block count)`` covering rows ``[start, start + count)`` of a packed dimension."""
    first = start // BLOCK
    return first, -(-(start + count) // BLOCK) - first
