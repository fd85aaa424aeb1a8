"""Linear layers over weights laid out once, at load time, for the device that runs them.

On CPU, ``F.linear`` hands a plain ``[out, in]`` weight to MKL, which repacks it on every call;
for the few-row inputs of decoding that repacking costs more than the product itself. oneDNN's
inner product over a weight reordered once into its blocked layout is 25-40% faster for float32
inputs of 4 to ~64 rows (decode batches, verification rows) and for bfloat16 inputs of any size
(``scripts/bench_model.py --no-prepack`` measures the difference). For 1-3 float32 rows MKL's gemv
over the plain weight is still the faster one, so float32 weights keep both copies and pick per
call; bfloat16 weights keep only the packed one.

With the compiled CPU kernels (``impl="cpp"``, `zerobubble.kernels.cpu`) on a CPU with AVX-512
BF16, bfloat16 weights are laid out in their own blocks instead (:func:`pack_blocks`: 16 outputs
by 2 inputs per vector) and multiplied by the compiled product at every row count: 1.4-1.7x
oneDNN's product at 1-4 rows, where a decode step is bound by reading the weights, and level
with it from 64 rows on (docs/benchmarks/cpu-llamacpp.md). int8 weights of a bfloat16 model
take the same blocks and product, widened to bfloat16 as they are read.

On CUDA, or where oneDNN is missing, a weight is just the plain tensor for ``F.linear``.

``quantization="int8"`` (CPU): weight-only int8. Each weight is stored as int8 with one scale
per output channel (symmetric, ``max |w| / 127``) and widened as it is read; the activations keep
the model dtype. Half the weight memory of bfloat16. A bfloat16 model with the compiled kernels
keeps the codes in the block layout above, for every row count. Otherwise, for up to
``CPP_INT8_MAX_ROWS`` rows (a decode step of a few requests) the compiled CPU kernel
(`zerobubble.kernels.cpu`, ``impl="cpp"``) streams the plain codes, prefetching the next rows,
where torch 2.13's weight-only product reaches about two thirds of its speed; below
``INT8_MIN_WIDENED_ROWS`` torch's product; from there on (prefill) the weight widened to the
model dtype, a dense product, then the scales. Quantizing the activations too (fbgemm's dynamic
int8 product) is faster, but its single scale over a whole prefill costs too much accuracy.

``quantization="int4"`` (CPU): weight-only 4-bit in groups of 32 inputs along each output row,
asymmetric (a scale and a minimum per group: llama.cpp's Q4_1 layout, the peer's), multiplied by
torch's int4 weight-only CPU product, which reads a quarter of bfloat16's bytes. For one row
(a single decode stream, bound by reading the weights) it is about 3× faster than oneDNN's
bfloat16 product here; from about 8 rows on, its unpacking makes it slower
(docs/benchmarks/cpu-llamacpp.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerobubble.kernels._triton import KernelImpl

logger = logging.getLogger(__name__)

# The row count oneDNN chooses its blocked layout for: a decode batch. The layout serves any row count.
_PACK_ROWS_HINT = 16
# Below this many float32 rows MKL's gemv over the plain weight beats the packed product.
_F32_MIN_PACKED_ROWS = 4
# Up to this many rows the compiled int8 product (zerobubble.kernels.cpu), which streams the
# weight once, beats torch's; with more rows torch's, which widens the weights in blocks, wins.
CPP_INT8_MAX_ROWS = 4
# From this many rows (a prefill chunk, a large batch) widening an int8 weight to the activations'
# dtype and taking the dense product beats torch's weight-only product, which is bound by its
# per-row widening there (a 3072 x 576 weight, 260 rows, bfloat16: 4.8 ms against 11.9).
INT8_MIN_WIDENED_ROWS = 16
# Outputs per block of the compiled block product's weight layout (pack_blocks).
BLOCK_OUTPUTS = 16
# Blocks the compiled product reads together; a weight's blocks are padded to a multiple of it.
BLOCK_GROUP = 3


@dataclass(slots=True, eq=False)
class LinearWeight:
    """One ``[out, in]`` linear weight: the plain tensor and/or a oneDNN-packed copy, or its
    quantized codes, or its blocks for the compiled CPU product.

    ``packed`` is used for inputs of at least ``min_packed_rows`` rows, ``dense`` otherwise;
    ``blocks`` (with ``num_outputs``), where present, for every input.
    """

    dense: torch.Tensor | None
    packed: torch.Tensor | None = None
    min_packed_rows: int = 0
    int8: torch.Tensor | None = None  # [out, in] int8 weight-only
    int8_scale: torch.Tensor | None = None  # [out] in the activations' dtype
    int4: torch.Tensor | None = None  # torch's packed int4 layout of [out, in]
    int4_scales_zeros: torch.Tensor | None = None  # [in / INT4_GROUP, out, 2] in the activations' dtype
    # [out / 16 (padded), in / 2, 16, 2] bfloat16, or int8 with int8_scale: see pack_blocks
    blocks: torch.Tensor | None = None
    num_outputs: int = 0  # out, for blocks (the blocks past it hold zeros)


QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32  # inputs sharing one scale and minimum, as in llama.cpp's Q4_0/Q4_1 blocks


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q [out, in] int8, scale [out] float32)``, ``w ≈ q * scale``."""
    w32 = weight.float()
    scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _prepare_int8(weight: torch.Tensor, blocks: bool) -> LinearWeight:
    if weight.device.type != "cpu":
        raise ValueError("int8 quantization runs on the CPU only")
    q, scale = quantize_int8(weight)
    if blocks:
        return LinearWeight(None, int8_scale=scale.to(weight.dtype), blocks=pack_blocks(q), num_outputs=q.shape[0])
    return LinearWeight(None, int8=q.contiguous(), int8_scale=scale.to(weight.dtype))


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per ``group`` inputs: ``(q [out, in] int32 in 0..15, scales_and_zeros
    [in / group, out, 2] float32)``, ``w ≈ (q - 8) * scale + zero`` (torch's int4 convention, with
    ``zero = minimum + 8 * scale``), see :func:`dequantize_int4`."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(
            f"int4 needs a weight's inputs in groups of {group}; got a [{out_features}, {in_features}] one"
        )
    w = weight.float().reshape(out_features, in_features // group, group)
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.round((w - low) / scale).clamp_(0, 15).to(torch.int32).reshape(out_features, in_features)
    scales_and_zeros = torch.cat((scale, low + 8 * scale), dim=-1).transpose(0, 1).contiguous()
    return q, scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The float32 ``[out, in]`` weight the int4 codes stand for (the product's torch twin)."""
    out_features, in_features = q.shape
    groups = scales_and_zeros.shape[0]
    scale, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [out, groups] each
    codes = q.float().reshape(out_features, groups, in_features // groups)
    return ((codes - 8) * scale[..., None] + zero[..., None]).reshape(out_features, in_features)


def _prepare_int4(weight: torch.Tensor) -> LinearWeight:
    if weight.device.type != "cpu":
        raise ValueError("int4 quantization runs on the CPU only")
    q, scales_and_zeros = quantize_int4(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return LinearWeight(None, int4=packed, int4_scales_zeros=scales_and_zeros.to(weight.dtype))


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (``in`` even; bfloat16, or int8 codes) in the compiled product's
    layout ``[num_blocks, in / 2, 16, 2]``: for each block of 16 outputs and each pair of inputs,
    the 32 values one AVX-512 BF16 instruction takes. ``num_blocks`` is ``ceil(out / 16)`` rounded
    up to a multiple of ``BLOCK_GROUP`` (the blocks the product reads together); outputs past
    ``out`` are zero."""
    out_features, in_features = weight.shape
    if in_features % 2:
        raise ValueError(f"the block layout needs an even number of inputs; got {in_features}")
    num_blocks = -(-out_features // (BLOCK_OUTPUTS * BLOCK_GROUP)) * BLOCK_GROUP
    padded = torch.zeros(num_blocks * BLOCK_OUTPUTS, in_features, dtype=weight.dtype, device=weight.device)
    padded[:out_features] = weight
    blocks = padded.reshape(num_blocks, BLOCK_OUTPUTS, in_features // 2, 2).permute(0, 2, 1, 3)
    return blocks.contiguous()


def unpack_blocks(blocks: torch.Tensor, num_outputs: int) -> torch.Tensor:
    """The ``[num_outputs, in]`` weight :func:`pack_blocks` laid out (the product's torch twin)."""
    num_blocks, pairs = blocks.shape[:2]
    return blocks.permute(0, 2, 1, 3).reshape(num_blocks * BLOCK_OUTPUTS, 2 * pairs)[:num_outputs]


def _uses_blocks(weight: torch.Tensor, impl: KernelImpl) -> bool:
    """Whether ``weight`` (in the model's dtype) goes to the compiled block product."""
    # impl="cpp": the caller has loaded the compiled kernels (zerobubble.kernels.cpu).
    if impl != "cpp" or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.shape[1] % 2:
        return False
    return bool(torch.ops.zerobubble_cpu.block_linear_is_native())


def prepare_linear(
    weight: torch.Tensor, prepack: bool = True, quantization: str = "none", impl: KernelImpl = None
) -> LinearWeight:
    """Wrap ``weight`` ``[out, in]`` for :func:`linear`: laid out for the compiled block product
    (``impl="cpp"``) or for oneDNN when that helps here, or quantized (``quantization="int8"`` or
    ``"int4"``). ``prepack=False`` keeps the plain weight (or int8 codes)."""
    blocks = prepack and _uses_blocks(weight, impl)
    if quantization == "int8":
        return _prepare_int8(weight, blocks)
    if quantization == "int4":
        return _prepare_int4(weight)
    if quantization != "none":
        raise ValueError(f"unknown quantization {quantization!r} (known: {', '.join(QUANTIZATIONS)})")
    if blocks:
        return LinearWeight(None, blocks=pack_blocks(weight), num_outputs=weight.shape[0])
    if not (prepack and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()):  # fmt: skip
        return LinearWeight(weight)
    try:
        # Without native bfloat16 instructions oneDNN would emulate them; plain F.linear is no worse.
        if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return LinearWeight(weight)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
    except (AttributeError, RuntimeError) as exc:  # a torch build without this oneDNN op or ISA
        logger.warning("oneDNN weight packing unavailable, using plain F.linear: %s", exc)
        return LinearWeight(weight)
    if weight.dtype == torch.float32:
        return LinearWeight(weight, packed, _F32_MIN_PACKED_ROWS)
    return LinearWeight(None, packed, 0)


def linear(
    x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None, impl: KernelImpl = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[N, in]``, through the packed weight when ``N`` is large
    enough; ``impl="cpp"``: an int8 weight's product for a few rows by the compiled CPU kernel.
    A weight in blocks is always multiplied by the compiled product."""
    if weight.blocks is not None:
        scale = weight.int8_scale if weight.blocks.dtype == torch.int8 else None
        product: torch.Tensor = torch.ops.zerobubble_cpu.block_linear(x, weight.blocks, weight.num_outputs, scale, bias)
        return product
    if weight.int8 is not None:
        assert weight.int8_scale is not None
        if impl == "cpp" and x.shape[0] <= CPP_INT8_MAX_ROWS:
            out: torch.Tensor = torch.ops.zerobubble_cpu.int8_linear(x, weight.int8, weight.int8_scale)
        elif x.shape[0] >= INT8_MIN_WIDENED_ROWS:
            # int8 codes are exact in any float dtype: the product is the dense one, scaled after.
            out = F.linear(x, weight.int8.to(x.dtype)) * weight.int8_scale
        else:
            out = torch.ops.aten._weight_int8pack_mm(x, weight.int8, weight.int8_scale)
        return out if bias is None else out + bias
    if weight.int4 is not None:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight.int4, INT4_GROUP, weight.int4_scales_zeros)
        return out if bias is None else out + bias
    if weight.packed is not None and x.shape[0] >= weight.min_packed_rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    assert weight.dense is not None, "a weight without its plain copy is always packed"
    return F.linear(x, weight.dense, bias)
