"""Linear layers over prepacked CPU weights (kernels/linear.py) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerobubble.kernels.linear import (
    BUCKET_ROWS,
    candidates,
    dequantize_int4,
    lay_out,
    linear,
    pack_blocks,
    prepare_linear,
    quantize_int4,
    quantize_int8,
    unpack_blocks,
)

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

# Per dtype: the largest |ours - F.linear| relative to the output's scale. Both sum the same
# products in a different order, so float32 agrees to rounding and bfloat16 to its 8 bits.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_rows", [0, 1, 3, 4, 16, 77, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, num_rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(num_rows, 80, generator=gen).to(dtype)
    prepared = prepare_linear(weight)
    if dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert prepared.packed is not None, "oneDNN supports this dtype here, so the weight must be packed"
    ours = linear(x, prepared, bias)
    expected = F.linear(x, weight, bias)
    assert ours.shape == expected.shape == (num_rows, 96) and ours.dtype == dtype
    if num_rows:
        scale = expected.float().abs().max()
        assert float((ours.float() - expected.float()).abs().max()) <= TOLERANCE[dtype] * float(scale)


@needs_onednn
def test_float32_keeps_the_plain_weight_for_few_rows() -> None:
    """1-4 float32 rows go through MKL's gemv on the plain weight: bit-identical to F.linear."""
    weight = torch.randn(64, 48)
    prepared = prepare_linear(weight)
    assert prepared.dense is weight and prepared.plan == ("dense", "dense", "onednn", "onednn", "onednn")
    for num_rows in (1, 2, 3, 4):
        x = torch.randn(num_rows, 48)
        assert torch.equal(linear(x, prepared), F.linear(x, weight))
    # bfloat16 is faster packed at every size, so it keeps only the packed copy (where the CPU has
    # bfloat16 instructions; otherwise only the plain one).
    bf16 = prepare_linear(weight.bfloat16())
    assert (bf16.dense is None) == torch.ops.mkldnn._is_mkldnn_bf16_supported() == (bf16.packed is not None)


def test_prepack_off_or_another_device_is_plain_f_linear() -> None:
    weight = torch.randn(32, 16)
    x = torch.randn(8, 16)
    prepared = prepare_linear(weight, prepack=False)
    assert prepared.packed is None and prepared.dense is weight
    assert torch.equal(linear(x, prepared), F.linear(x, weight))
    assert prepare_linear(weight.double()).packed is None  # a dtype oneDNN is not used for


def test_int8_weights_quantize_per_channel_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=g) * torch.linspace(0.01, 3.0, 48)[:, None]  # channels of every scale
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.all((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6)


def _dequantized_int8(weight: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8(weight)
    return q.float() * scale[:, None]


# scheme -> (inputs per weight row, its twin: the dequantized weight, tolerance)
DEQUANTIZED = {
    "int8": (64, _dequantized_int8, 1e-5),
    "int4": (128, lambda weight: dequantize_int4(*quantize_int4(weight)), 1e-4),
}


@pytest.mark.parametrize("scheme", list(DEQUANTIZED))
@pytest.mark.parametrize("num_rows", [1, 5, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_quantized_linear_is_the_dequantized_product(scheme: str, num_rows: int, with_bias: bool) -> None:
    """Each weight-only product (torch's int8 one, its packed int4 one) equals its twin, the
    product of the dequantized weight."""
    in_features, dequantized, tolerance = DEQUANTIZED[scheme]
    g = torch.Generator().manual_seed(num_rows)
    weight, x = torch.randn(96, in_features, generator=g), torch.randn(num_rows, in_features, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    got = linear(x, prepare_linear(weight, quantization=scheme), bias)
    want = F.linear(x, dequantized(weight), bias)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "in_features"), [(1, 192), (3, 200), (4, 192), (6, 192), (20, 200)])
@pytest.mark.parametrize("product", ["int8-rows", "int8-torch", "int8-widened"])
def test_every_int8_product_is_the_dequantized_product(
    cpu_kernels: None, dtype: torch.dtype, num_rows: int, in_features: int, product: str
) -> None:
    """Each product over plain int8 codes, over 97 outputs (not a multiple of the compiled
    kernel's four-row blocks) and inputs that are or are not a multiple of its 16-wide steps:
    the dequantized weight's product, rounded once to the activations' dtype. torch's own
    product is offered only for a multiple of 64 inputs."""
    g = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(97, in_features, generator=g)
    x = torch.randn(num_rows, in_features, generator=g).to(dtype)
    bias = torch.randn(97, generator=g).to(dtype)
    names = candidates(weight.to(dtype), "int8", impl="cpp")
    if product not in names:
        assert product == "int8-torch" and in_features % 64
        return
    got = linear(x, lay_out(weight.to(dtype), "int8", (product,) * len(BUCKET_ROWS)), bias)
    q, scale = quantize_int8(weight.to(dtype))
    want = (F.linear(x.float(), q.float()) * scale.to(dtype).float() + bias.float()).to(dtype)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of the product, one of the bias sum
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * float(want.abs().max()))


def test_bf16_blocks_hold_every_weight_once_and_pad_with_zeros() -> None:
    weight = torch.randn(40, 70).bfloat16()
    blocks = pack_blocks(weight)
    assert blocks.shape == (3, 35, 16, 2) and blocks.is_contiguous()
    assert pack_blocks(torch.randn(49, 70)).shape == (6, 35, 16, 2)  # 4 blocks, padded to 2 groups of 3
    # Block 1, input pair 4: outputs 16..31 at inputs 8 and 9.
    assert torch.equal(blocks[1, 4], weight[16:32, 8:10])
    assert torch.equal(unpack_blocks(blocks, 40), weight)
    assert int(torch.count_nonzero(blocks[2, :, 8:])) == 0  # outputs 40..47 do not exist
    with pytest.raises(ValueError, match="even number of inputs; got 7"):
        pack_blocks(torch.randn(4, 7))


@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 12, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_outputs", [40, 60, 72])
def test_compiled_bf16_product_is_the_float32_product_rounded_once(
    cpu_kernels: None, num_rows: int, with_bias: bool, num_outputs: int
) -> None:
    """The compiled bfloat16 product over its block layout: 40, 60 and 72 outputs (3, 4 and 5
    blocks of 16, read three at a time: padded with zero outputs to 3, 6 and 6)
    and 150 inputs (75 pairs), row counts that fill its tiles of up to 8 rows exactly, unevenly
    and not at all: the exact products summed in float32, the bias added, rounded once (so within
    one bfloat16 step of the float64 product)."""
    g = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(num_outputs, 150, generator=g).bfloat16()
    bias = torch.randn(num_outputs, generator=g).bfloat16() if with_bias else None
    x = torch.randn(num_rows, 150, generator=g).bfloat16()
    prepared = prepare_linear(weight, impl="cpp")
    if not torch.ops.zerobubble_cpu.block_linear_is_native():
        pytest.skip("this CPU has no AVX-512 BF16: bfloat16 weights stay oneDNN's")
    assert prepared.blocks is not None and prepared.dense is None and prepared.packed is None
    got = linear(x, prepared, bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, num_outputs)
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)
    # Rows are independent: the product of one row alone is the same row of the batch's.
    assert torch.equal(linear(x[-1:], prepared, bias), got[-1:])


@pytest.mark.parametrize("num_rows", [1, 4, 9, 20])
def test_compiled_int8_block_product_is_the_dequantized_product(cpu_kernels: None, num_rows: int) -> None:
    """int8 weights of a bfloat16 model in the compiled product's blocks (60 outputs: 4 blocks
    padded to 6), widened to bfloat16 as read: the int8 codes' exact product summed in float32,
    scaled per output, the bias added, rounded once."""
    if not torch.ops.zerobubble_cpu.block_linear_is_native():
        pytest.skip("this CPU has no AVX-512 BF16: int8 weights keep their plain codes")
    g = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(60, 150, generator=g).bfloat16()
    bias = torch.randn(60, generator=g).bfloat16()
    x = torch.randn(num_rows, 150, generator=g).bfloat16()
    prepared = prepare_linear(weight, quantization="int8", impl="cpp")
    assert prepared.blocks is not None and prepared.blocks.dtype == torch.int8 and prepared.int8 is None
    q, scale = quantize_int8(weight)
    assert torch.equal(unpack_blocks(prepared.blocks, 60), q)
    got = linear(x, prepared, bias)
    exact = F.linear(x.double(), q.double()) * scale.bfloat16().double() + bias.double()
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)


def test_compiled_bf16_product_only_where_it_applies(cpu_kernels: None) -> None:
    """The block layout is for bfloat16 weights with an even number of inputs, when the compiled
    kernels are asked for and weights are laid out at all; the product names a bad weight."""
    weight = torch.randn(32, 48)
    assert prepare_linear(weight.bfloat16()).blocks is None  # impl=None: oneDNN's layout
    assert prepare_linear(weight.bfloat16(), prepack=False, impl="cpp").blocks is None
    assert prepare_linear(weight, impl="cpp").blocks is None  # float32 stays HF-exact
    assert prepare_linear(torch.randn(32, 47).bfloat16(), impl="cpp").blocks is None
    x = torch.randn(2, 48).bfloat16()
    with pytest.raises(RuntimeError, match="blocks must be"):
        torch.ops.zerobubble_cpu.block_linear(x, weight.bfloat16(), 32, None, None)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        torch.ops.zerobubble_cpu.block_linear(x.float(), pack_blocks(weight.bfloat16()), 32, None, None)
    with pytest.raises(RuntimeError, match="scale must be given for int8 blocks"):
        torch.ops.zerobubble_cpu.block_linear(x, pack_blocks(quantize_int8(weight)[0]), 32, None, None)


def test_int4_codes_are_within_half_a_step_of_each_group() -> None:
    """Every group of 32 inputs gets its own scale and minimum: a group of tiny weights beside a
    group of large ones keeps its precision."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(8, 64, generator=g) * torch.tensor([0.01] * 32 + [5.0] * 32)
    q, scales_and_zeros = quantize_int4(weight)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scales_and_zeros.shape == (2, 8, 2)
    step = scales_and_zeros[..., 0].transpose(0, 1).repeat_interleave(32, dim=1)  # [out, in]
    assert torch.all((dequantize_int4(q, scales_and_zeros) - weight).abs() <= step / 2 + 1e-6)
    assert float(step[:, :32].max()) < 0.01  # the small group's step is its own


def test_quantization_is_refused_off_the_cpu_and_unknown_schemes_by_name() -> None:
    with pytest.raises(ValueError, match="int2"):
        prepare_linear(torch.randn(4, 4), quantization="int2")
    for scheme in ("int8", "int4"):
        with pytest.raises(ValueError, match="CPU"):
            prepare_linear(torch.randn(4, 32, device="meta"), quantization=scheme)
    with pytest.raises(ValueError, match=r"groups of 32; got a \[4, 48\] one"):
        prepare_linear(torch.randn(4, 48), quantization="int4")
