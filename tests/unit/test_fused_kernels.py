"""The fused layer kernels: Triton (CPU interpreter) and C++ (zerobubble.kernels.cpu) vs their torch
twins, and the twins vs Hugging Face."""

from __future__ import annotations

import os

# Triton decides interpreted vs compiled when a kernel is defined, i.e. at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from zerobubble.kernels import fused  # noqa: E402
from zerobubble.kernels._triton import HAS_TRITON  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DTYPES = [torch.float32, torch.bfloat16]
IMPLS = [pytest.param("triton", marks=needs_triton), "cpp"]


@pytest.fixture
def impl(request: pytest.FixtureRequest) -> str:
    """The kernel implementation under test; "cpp" needs the compiled kernels loaded."""
    if request.param == "cpp":
        request.getfixturevalue("cpu_kernels")
    return str(request.param)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: a few ulps; 16-bit: a couple of rounding steps at the tensor's scale (the
    interpreter truncates where torch rounds to nearest, a compiled reduction sums in another
    order, and a rotation's two rounded products may cancel, so a 16-bit result may sit a step
    or two away)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        scale = max(1.0, want.float().abs().max().item())
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * scale)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64])
@pytest.mark.parametrize("residual_dtype", [None, "model", torch.float32])
def test_add_rms_norm_matches_twin(
    impl: str, dtype: torch.dtype, hidden: int, residual_dtype: torch.dtype | str | None
) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=g) * 3).to(dtype)
    residual = None
    if residual_dtype is not None:  # the stream in the model dtype (a first sum) or float32 (later ones)
        residual = torch.randn(7, hidden, generator=g).to(dtype if residual_dtype == "model" else residual_dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-5, impl=impl)
    want_normed, want_summed = fused.add_rms_norm(x, residual, weight, 1e-5, impl="torch")
    _close(summed, want_summed)
    _close(normed, want_normed)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "head_dim"), [(12, 64), (5, 128)])
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_matches_twin(
    impl: str, dtype: torch.dtype, num_heads: int, head_dim: int, with_norm: bool
) -> None:
    g = torch.Generator().manual_seed(num_heads)
    num_tokens = 6
    # A fused qkv row: the q and k heads first, then v heads the kernel must not read.
    qkv = torch.randn(num_tokens, (num_heads + 3) * head_dim, generator=g).to(dtype)
    angles = torch.rand(num_tokens, head_dim // 2, generator=g) * 6.28
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    weight = torch.randn(num_heads, head_dim, generator=g).to(dtype) if with_norm else None
    got = fused.qk_norm_rope(qkv, cos, sin, weight, num_heads, head_dim, 1e-6, impl=impl)
    want = fused.qk_norm_rope(qkv, cos, sin, weight, num_heads, head_dim, 1e-6, impl="torch")
    _close(got, want)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40, 3000])
def test_silu_mul_matches_twin(impl: str, dtype: torch.dtype, inter: int) -> None:
    # Gates near the ends of float32's exponential on both sides, and zeros.
    gate_up = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([86.0, -86.0, 0.0, -0.0])
    _close(fused.silu_mul(gate_up, impl=impl), fused.silu_mul(gate_up, impl="torch"))


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "cpp"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_matches_twin(impl: str, dtype: torch.dtype) -> None:
    """Gemma's GeGLU; "cpp" runs the twin itself (the compiled kernels have no GELU)."""
    inter = 1500
    gate_up = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([86.0, -86.0, 0.0, -0.0])
    _close(fused.gelu_tanh_mul(gate_up, impl=impl), fused.gelu_tanh_mul_twin(gate_up))  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "cpp"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_swiglu_mul_matches_twin(impl: str, dtype: torch.dtype) -> None:
    """gpt-oss's clamped SwiGLU, gates and ups on both sides of the limit; "cpp" runs the twin."""
    inter = 1500
    gate_up = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([86.0, -86.0, 0.0, -0.0])
    got = fused.clamped_swiglu_mul(gate_up, impl, alpha=1.702, limit=7.0)  # type: ignore[arg-type]
    _close(got, fused.clamped_swiglu_mul_twin(gate_up, 1.702, 7.0))


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_kernels_accept_an_empty_batch(impl: str) -> None:
    x = torch.empty(0, 64)
    normed, summed = fused.add_rms_norm(x, x, torch.ones(64), 1e-5, impl=impl)
    assert normed.shape == summed.shape == (0, 64)
    assert fused.silu_mul(torch.empty(0, 80), impl=impl).shape == (0, 40)
    qk = fused.qk_norm_rope(torch.empty(0, 256), torch.empty(0, 32), torch.empty(0, 32), None, 4, 32, 1e-6, impl)
    assert qk.shape == (0, 4, 32)


def test_cpp_kernels_name_a_misshapen_input(cpu_kernels: None) -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        fused.add_rms_norm(torch.ones(2, 64), None, torch.ones(32), 1e-5, impl="cpp")
    with pytest.raises(RuntimeError, match="gate_up must be"):
        fused.silu_mul(torch.ones(2, 7), impl="cpp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_twins_are_hugging_face_bit_for_bit(dtype: torch.dtype) -> None:
    """The twins are the model's reference: Hugging Face's Qwen3 norm, rotation and MLP activation."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    hidden, num_heads, head_dim, num_tokens = 96, 4, 32, 5
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    norm = Qwen3RMSNorm(hidden, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    normed, summed = fused.add_rms_norm_twin(x, residual, norm.weight.data, 1e-6)
    if dtype == torch.float32:
        assert torch.equal(summed, residual + x)
        assert torch.equal(normed, norm(residual + x))
    else:
        # The residual stream stays float32 (Hugging Face rounds it to the dtype); the norm is
        # Hugging Face's over that sum, rounded and scaled in the dtype as its norm does.
        assert summed.dtype == torch.float32 and torch.equal(summed, residual.float() + x.float())
        unit = Qwen3RMSNorm(hidden, eps=1e-6)  # float32, weight 1: the normalization alone
        assert torch.equal(normed, norm.weight.data * unit(summed).to(dtype))
        _, from_first = fused.add_rms_norm_twin(x, None, norm.weight.data, 1e-6)
        assert torch.equal(from_first, x.float())

    head_norm = Qwen3RMSNorm(head_dim, eps=1e-6).to(dtype)
    head_norm.weight.data = torch.randn(head_dim, generator=g).to(dtype)
    qk = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    angles = torch.rand(num_tokens, head_dim // 2, generator=g) * 6.28
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    # HF: [B, H, T, D] with cos/sin [B, T, D]; the query and key get the same treatment.
    want, _ = apply_rotary_pos_emb(head_norm(qk).transpose(0, 1)[None], head_norm(qk).transpose(0, 1)[None],
                                   cos[None], sin[None])  # fmt: skip
    half = head_dim // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), -1)
    weight = head_norm.weight.data.expand(num_heads, head_dim)
    got = fused.qk_norm_rope_twin(qk, cos, signed_sin, weight, 1e-6)
    assert torch.equal(got, want[0].transpose(0, 1))

    gate_up = torch.randn(num_tokens, 2 * hidden, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    assert torch.equal(fused.silu_mul_twin(gate_up), torch.nn.functional.silu(gate) * up)
    from transformers.activations import ACT2FN

    assert torch.equal(fused.gelu_tanh_mul_twin(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)
    # gpt-oss's experts interleave gate and up columns; ours are halves (converted at load).
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    interleaved = torch.stack((gate, up), dim=-1).flatten(-2) * 8  # past the limit both ways
    experts = SimpleNamespace(alpha=1.702, limit=7.0)
    want = GptOssExperts._apply_gate(experts, interleaved)  # type: ignore[arg-type]
    assert torch.equal(fused.clamped_swiglu_mul_twin(gate_up * 8, 1.702, 7.0), want)
