"""Linear layers over weights laid out once, at load time, for the products that run them.

A weight is multiplied by one of several products (`PRODUCTS`), chosen per row bucket
(`ROW_BUCKETS`: 1, 2-4, 5-16, 17-64, 65+ rows) when it is loaded; `LinearWeight` keeps the
layouts its plan reads and nothing else. Which products can run a weight here is `candidates`;
which one runs each bucket is measured on the machine (`zerobubble.kernels.linear_choice`) or,
without measuring, `default_plan`:

- ``blocks``: the compiled CPU product (`zerobubble.kernels.cpu`, AVX-512 BF16) over the weight in
  its own blocks (:func:`pack_blocks`: 16 outputs by 2 inputs per vector), bfloat16 or int8 codes
  widened as read. It reads a weight at the memory's speed for a few rows, where a decode step
  is bound by reading the weights (1.4-1.7x oneDNN's product at 1-4 rows on an AMD EPYC).
- ``onednn``: oneDNN's inner product over the weight reordered once into its blocked layout (MKL
  would repack a plain weight on every call); it uses AMX tiles where the CPU has them.
- ``dense``: ``F.linear`` over the plain weight (for 1-4 float32 rows MKL's gemv, bit-identical to
  Hugging Face's forward; on CUDA every weight).
- ``int8-rows``, ``int8-torch``, ``int8-widened``: weight-only int8 (one scale per output channel,
  symmetric, ``max |w| / 127``; the activations keep the model dtype; half bfloat16's memory) by the
  compiled kernel that streams the codes for a few rows, torch's weight-only product, or the codes
  widened to the activations' dtype and a dense product (prefill). Quantizing the activations too
  (fbgemm's dynamic int8 product) is faster, but its single scale over a whole prefill costs too
  much accuracy.
- ``int4``: weight-only 4-bit in groups of 32 inputs along each output row, asymmetric (a scale and
  a minimum per group: llama.cpp's Q4_1 layout, the peer's), by torch's int4 weight-only CPU
  product, which reads a quarter of bfloat16's bytes: about 3x oneDNN's bfloat16 product for one
  row, slower from about 8 rows on (docs/benchmarks/cpu-llamacpp.md).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerobubble.kernels._triton import KernelImpl

logger = logging.getLogger(__name__)

# The row count oneDNN chooses its blocked layout for: a decode batch. The layout serves any row count.
_PACK_ROWS_HINT = 16
# Outputs per block of the compiled block product's weight layout (pack_blocks).
BLOCK_OUTPUTS = 16
# Blocks the compiled product reads together; a weight's blocks are padded to a multiple of it.
BLOCK_GROUP = 3
# Row buckets a weight's plan names one product for: 1, 2-4, 5-16, 17-64 and 65 or more rows
# (one decode stream, a few, a decode batch or verification, a wide batch, prefill).
ROW_BUCKETS = (1, 4, 16, 64)
# The row count each bucket is timed at (zerobubble.kernels.linear_choice).
BUCKET_ROWS = (1, 4, 16, 64, 256)


@dataclass(slots=True, eq=False)
class LinearWeight:
    """One ``[out, in]`` linear weight in the layouts its products read, and which product runs
    each row bucket (``plan[row_bucket(rows)]``, a name in `PRODUCTS`).

    The layouts: the plain tensor (``dense``), oneDNN's packed copy (``packed``), int8 codes
    (``int8``, ``int8_scale``), torch's int4 layout, or blocks for the compiled CPU product
    (``blocks``: bfloat16, or int8 codes with ``int8_scale``). Only those the plan uses are kept.
    """

    num_outputs: int
    plan: tuple[str, ...]
    dense: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    int8: torch.Tensor | None = None  # [out, in] int8 weight-only
    int8_scale: torch.Tensor | None = None  # [out] in the activations' dtype
    int4: torch.Tensor | None = None  # torch's packed int4 layout of [out, in]
    int4_scales_zeros: torch.Tensor | None = None  # [in / INT4_GROUP, out, 2] in the activations' dtype
    # [out / 16 (padded), in / 2, 16, 2] bfloat16, or int8 with int8_scale: see pack_blocks
    blocks: torch.Tensor | None = None


def row_bucket(num_rows: int) -> int:
    """The index of the bucket ``num_rows`` falls in (``len(ROW_BUCKETS)``: more than the last bound)."""
    return bisect.bisect_left(ROW_BUCKETS, num_rows)


QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32  # inputs sharing one scale and minimum, as in llama.cpp's Q4_0/Q4_1 blocks


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q [out, in] int8, scale [out] float32)``, ``w ≈ q * scale``."""
    w32 = weight.float()
    scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


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


def _runs_blocks(dtype: torch.dtype, in_features: int, impl: KernelImpl) -> bool:
    """Whether the compiled block product can serve a weight whose activations are ``dtype``."""
    # impl="cpp": the caller has loaded the compiled kernels (zerobubble.kernels.cpu).
    if impl != "cpp" or dtype != torch.bfloat16 or in_features % 2:
        return False
    from zerobubble.kernels import cpu

    return cpu.native_bf16()


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed product is offered for ``dtype`` weights on this CPU (without native
    bfloat16 instructions oneDNN would emulate them; plain F.linear is no worse)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# The products, by name: what each reads and how it multiplies. A weight's plan names one per
# row bucket; `candidates` says which can run a given weight here.
Product = Callable[[torch.Tensor, LinearWeight, "torch.Tensor | None"], torch.Tensor]


def _plus(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


def _block_product(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    assert w.blocks is not None
    scale = w.int8_scale if w.blocks.dtype == torch.int8 else None
    out: torch.Tensor = torch.ops.zerobubble_cpu.block_linear(x, w.blocks, w.num_outputs, scale, bias)
    return out


def _onednn_product(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w.packed, bias, "none", [], "")
    return out


def _dense_product(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    assert w.dense is not None
    return F.linear(x, w.dense, bias)


def _int8_rows_product(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    # The compiled kernel streams the codes once, prefetching ahead: made for a few rows.
    return _plus(torch.ops.zerobubble_cpu.int8_linear(x, w.int8, w.int8_scale), bias)


def _int8_torch_product(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return _plus(torch.ops.aten._weight_int8pack_mm(x, w.int8, w.int8_scale), bias)


def _int8_widened_product(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    # int8 codes are exact in any float dtype: the product is the dense one, scaled after. For
    # many rows the widening is a small share of the product.
    assert w.int8 is not None and w.int8_scale is not None
    return _plus(F.linear(x, w.int8.to(x.dtype)) * w.int8_scale, bias)


def _int4_product(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return _plus(torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.int4, INT4_GROUP, w.int4_scales_zeros), bias)


@dataclass(frozen=True, slots=True)
class ProductKind:
    """A linear product: the layout it reads (a `LinearWeight` field) and its function."""

    layout: str
    run: Product


PRODUCTS: dict[str, ProductKind] = {
    "blocks": ProductKind("blocks", _block_product),
    "onednn": ProductKind("packed", _onednn_product),
    "dense": ProductKind("dense", _dense_product),
    "int8-rows": ProductKind("int8", _int8_rows_product),
    "int8-torch": ProductKind("int8", _int8_torch_product),
    "int8-widened": ProductKind("int8", _int8_widened_product),
    "int4": ProductKind("int4", _int4_product),
}


def candidates(
    weight: torch.Tensor, quantization: str = "none", prepack: bool = True, impl: KernelImpl = None
) -> tuple[str, ...]:
    """The products that can run ``weight`` (in the model's dtype) here, in `PRODUCTS`' order;
    ``prepack=False`` leaves only those over the plain weight or codes."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r} (known: {', '.join(QUANTIZATIONS)})")
    if quantization != "none" and weight.device.type != "cpu":
        raise ValueError(f"{quantization} quantization runs on the CPU only")
    if quantization == "int4":
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP:
            raise ValueError(
                f"int4 needs a weight's inputs in groups of {INT4_GROUP}; got a [{out_features}, {in_features}] one"
            )
        return ("int4",)
    on_cpu = weight.device.type == "cpu"
    blocks = prepack and on_cpu and _runs_blocks(weight.dtype, weight.shape[1], impl)
    if quantization == "int8":
        rows = ("int8-rows",) if impl == "cpp" else ()
        # torch 2.13's weight-only int8 product reads past a row of inputs that is not a
        # multiple of 64 for more than a few rows (it crashes).
        torch_int8 = ("int8-torch",) if weight.shape[1] % 64 == 0 else ()
        return ("blocks",) * blocks + rows + torch_int8 + ("int8-widened",)
    onednn = prepack and on_cpu and _onednn_packs(weight.dtype)
    return ("blocks",) * blocks + ("onednn",) * onednn + ("dense",)


def default_plan(names: tuple[str, ...], dtype: torch.dtype) -> tuple[str, ...]:
    """The plan measured on the machine the kernels were tuned on (AMD EPYC, AVX-512 BF16, no
    AMX), used where no measurement is asked for: the block product at every row count where it
    runs; else oneDNN's packed product (float32: MKL's gemv over the plain weight for 1-4 rows,
    bit-identical to ``F.linear``); int8 codes: the compiled kernel for 1-4 rows, torch's
    weight-only product up to 16, the widened dense product beyond (a 3072 x 576 weight, 260
    rows, bfloat16: 4.8 ms against torch's 11.9)."""
    num_buckets = len(BUCKET_ROWS)
    if "blocks" in names or len(names) == 1:
        return (names[0],) * num_buckets
    if "onednn" in names:
        few = "dense" if dtype == torch.float32 else "onednn"
        return (few, few) + ("onednn",) * (num_buckets - 2)
    if "int8-widened" in names:
        middle = "int8-torch" if "int8-torch" in names else "int8-widened"
        few = "int8-rows" if "int8-rows" in names else middle
        return (few, few, middle, "int8-widened", "int8-widened")
    return ("dense",) * num_buckets


def lay_out(
    weight: torch.Tensor, quantization: str, plan: tuple[str, ...], num_outputs: int | None = None
) -> LinearWeight:
    """``weight`` ``[out, in]`` in the layouts ``plan``'s products read."""
    layouts = {PRODUCTS[name].layout for name in plan}
    out = LinearWeight(weight.shape[0] if num_outputs is None else num_outputs, plan)
    if quantization == "int8":
        q, scale = quantize_int8(weight)
        out.int8_scale = scale.to(weight.dtype)
        out.int8 = q.contiguous() if "int8" in layouts else None
        out.blocks = pack_blocks(q) if "blocks" in layouts else None
        return out
    if quantization == "int4":
        q, scales_and_zeros = quantize_int4(weight)
        out.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        out.int4_scales_zeros = scales_and_zeros.to(weight.dtype)
        return out
    out.dense = weight if "dense" in layouts else None
    out.blocks = pack_blocks(weight) if "blocks" in layouts else None
    if "packed" in layouts:
        out.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
    return out


# What picks a weight's plan: given the weight (in the model's dtype), its quantization, the
# candidates and the default plan (zerobubble.kernels.linear_choice.LinearChooser).
PlanChooser = Callable[[torch.Tensor, str, tuple[str, ...], tuple[str, ...]], tuple[str, ...]]


def prepare_linear(
    weight: torch.Tensor,
    prepack: bool = True,
    quantization: str = "none",
    impl: KernelImpl = None,
    choose: PlanChooser | None = None,
) -> LinearWeight:
    """Wrap ``weight`` ``[out, in]`` for :func:`linear`: quantized (``quantization="int8"`` or
    ``"int4"``) or not, laid out for the products that run it here: those ``choose`` picks per
    row bucket among the candidates, else the default plan. ``prepack=False`` keeps the plain
    weight (or int8 codes)."""
    names = candidates(weight, quantization, prepack, impl)
    plan = default_plan(names, weight.dtype)
    if choose is not None and len(names) > 1:
        plan = choose(weight, quantization, names, plan)
    return lay_out(weight, quantization, plan)


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[N, in]`` by the product ``weight``'s plan names for ``N`` rows."""
    return PRODUCTS[weight.plan[row_bucket(x.shape[0])]].run(x, weight, bias)
