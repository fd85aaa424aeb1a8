"""Linear layers over prepacked CPU weights (kernels/linear.py) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import linear, prepare_linear

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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_rows", [2, 16])
def test_fused_residual_is_the_same_sum(dtype: torch.dtype, num_rows: int) -> None:
    """``linear(..., residual=r)`` equals ``r + linear(...)`` bit for bit, packed or plain."""
    weight, bias = torch.randn(40, 24).to(dtype), torch.randn(40).to(dtype)
    x, residual = torch.randn(num_rows, 24).to(dtype), torch.randn(num_rows, 40).to(dtype)
    prepared = prepare_linear(weight)
    assert torch.equal(linear(x, prepared, bias, residual=residual), residual + linear(x, prepared, bias))


@needs_onednn
def test_float32_keeps_the_plain_weight_for_few_rows() -> None:
    """1-3 float32 rows go through MKL's gemv on the plain weight: bit-identical to F.linear."""
    weight = torch.randn(64, 48)
    prepared = prepare_linear(weight)
    assert prepared.dense is weight and prepared.min_packed_rows == 4
    for num_rows in (1, 2, 3):
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
