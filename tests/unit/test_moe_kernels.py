"""The routed-expert kernels (zerobubble.kernels.moe): the Triton grouped product (CPU
interpreter) and the CPU per-expert path against their torch twin, over ragged expert loads."""

from __future__ import annotations

import os

# Triton decides interpreted vs compiled when a kernel is defined, i.e. at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

from functools import partial  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from zerobubble.kernels import fused, moe  # noqa: E402
from zerobubble.kernels._triton import HAS_TRITON, KernelImpl  # noqa: E402
from zerobubble.kernels.linear import dequantize_int4, prepare_linear, quantize_int4, quantize_int8  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
NUM_EXPERTS, HIDDEN, INTER = 8, 64, 32

# Rows per expert: some experts idle, one expert with every row, and a load past one row block.
LOADS = {
    "ragged": [3, 0, 1, 0, 5, 0, 0, 2],
    "one-expert": [0, 0, 0, 0, 0, 11, 0, 0],
    "wide": [40, 1, 0, 0, 17, 0, 0, 3],
    "prefill": [70, 0, 0, 5, 0, 0, 0, 30],  # past 8 rows an expert: the kernel's 64-row blocks
    "empty": [0] * NUM_EXPERTS,
}


def _offsets(load: list[int]) -> torch.Tensor:
    return torch.tensor([0, *load]).cumsum(0)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = max(1.0, want.float().abs().amax().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * scale)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("load", list(LOADS))
def test_grouped_kernel_matches_twin(dtype: torch.dtype, load: str) -> None:
    g = torch.Generator().manual_seed(len(load))
    offsets = _offsets(LOADS[load])
    # 80 inputs and 72 outputs: neither a multiple of the kernel's 64-wide tiles.
    x = torch.randn(int(offsets[-1]), 80, generator=g).to(dtype)
    weight = torch.randn(NUM_EXPERTS, 72, 80, generator=g).to(dtype)
    got = moe.grouped_linear(x, weight, offsets, impl="triton")
    want = moe.grouped_linear(x, weight, offsets, impl="torch")
    _close(got, want, 1e-5 if dtype == torch.float32 else 2**-7)


def test_grouped_twin_is_each_experts_product() -> None:
    g = torch.Generator().manual_seed(0)
    load = LOADS["ragged"]
    x, weight = torch.randn(sum(load), 16, generator=g), torch.randn(NUM_EXPERTS, 8, 16, generator=g)
    experts = torch.repeat_interleave(torch.arange(NUM_EXPERTS), torch.tensor(load))
    want = torch.stack([weight[e] @ row for e, row in zip(experts.tolist(), x)])
    torch.testing.assert_close(moe.grouped_linear_twin(x, weight, _offsets(load)), want)


def test_routing_sorts_pairs_by_expert_with_renormalized_weights() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 4.0, 0.0], [1.0, 1.5, 0.0, 3.0]])
    for renormalize in (False, True):
        routing = moe.route(logits, 2, renormalize)
        assert routing.offsets.tolist() == [0, 1, 3, 4, 6]
        assert routing.tokens.tolist() == [1, 0, 2, 1, 0, 2]  # expert 0: token 1; 1: 0, 2; 2: 1; 3: 0, 2
        probs = logits.softmax(-1)
        top = probs.topk(2, -1).values
        want = top / top.sum(-1, keepdim=True) if renormalize else top
        per_token = torch.zeros(3).index_add_(0, routing.tokens, routing.weights)
        torch.testing.assert_close(per_token, want.sum(-1))


def _stacked(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) * 0.2
    return gate_up.to(dtype), down.to(dtype)


def _routing(num_tokens: int, seed: int, top_k: int = 2) -> tuple[torch.Tensor, moe.Routing]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    return x, moe.route(torch.randn(num_tokens, NUM_EXPERTS, generator=g) * 2, top_k, True)


def _dequantized_int8(weight: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8(weight)
    return (q.float() * scale[:, None]).to(weight.dtype)


def _dequantized_int4(weight: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(weight)).to(weight.dtype)


# quantization -> (each expert's weight as its twin reads it, tolerance relative to the output's scale)
QUANTIZED = {"none": (lambda w: w, 1e-5), "int8": (_dequantized_int8, 1e-5), "int4": (_dequantized_int4, 1e-4)}


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
@pytest.mark.parametrize("quantization", list(QUANTIZED))
def test_cpu_experts_match_the_twin(num_tokens: int, quantization: str) -> None:
    """float32 per-expert products (plain, int8, int4 codes) against the stacked twin over the
    dequantized weights; one token reads two experts only."""
    dequantized, tolerance = QUANTIZED[quantization]
    gate_up, down = _stacked(torch.float32, num_tokens)
    x, routing = _routing(num_tokens, num_tokens)
    cpu = moe.expert_weights(gate_up, down, partial(prepare_linear, quantization=quantization))
    twin_gate_up, twin_down = (torch.stack([dequantized(w[e]) for e in range(NUM_EXPERTS)]) for w in (gate_up, down))
    twin = moe.expert_weights(twin_gate_up, twin_down)
    got = moe.routed_experts(x, routing, cpu)
    want = moe.routed_experts(x, routing, twin, impl="torch")
    _close(got, want, tolerance)


@pytest.mark.parametrize("impl", [None, "cpp"])
def test_bfloat16_cpu_experts_are_close_to_float32(request: pytest.FixtureRequest, impl: KernelImpl) -> None:
    """bfloat16 experts (oneDNN's product, or the compiled block product with the compiled
    SiLU) against the float32 twin of the same rounded weights."""
    if impl == "cpp":
        request.getfixturevalue("cpu_kernels")
    gate_up, down = _stacked(torch.bfloat16, 7)
    x, routing = _routing(24, 7)
    cpu = moe.expert_weights(gate_up, down, partial(prepare_linear, impl=impl))
    got = moe.routed_experts(x.bfloat16(), routing, cpu, impl=impl)
    want = moe.routed_experts(x.bfloat16().float(), routing, moe.expert_weights(gate_up.float(), down.float()))
    _close(got, want, 3e-2)


def test_routed_experts_is_the_weighted_sum_of_each_tokens_experts() -> None:
    """The oracle written out: per token, its top-k experts' SwiGLU MLPs times their weights."""
    gate_up, down = _stacked(torch.float32, 3)
    x, routing = _routing(5, 3, top_k=3)
    got = moe.routed_experts(x, routing, moe.expert_weights(gate_up, down))
    want = torch.zeros_like(x)
    experts = torch.repeat_interleave(torch.arange(NUM_EXPERTS), routing.offsets.diff())
    for token, expert, weight in zip(routing.tokens.tolist(), experts.tolist(), routing.weights.tolist()):
        gate, up = (gate_up[expert] @ x[token]).chunk(2)
        want[token] += weight * (down[expert] @ (F.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["per-expert", "torch", pytest.param("triton", marks=needs_triton)])
def test_biased_experts_with_the_clamped_swiglu(impl: str) -> None:
    """gpt-oss's experts (biases on both projections, the clamped SwiGLU) on each path against
    the oracle written out as Hugging Face's ``x @ W + b``."""
    gate_up, down = (w * 5 for w in _stacked(torch.float32, 4))  # gate·up values past the limit
    g = torch.Generator().manual_seed(5)
    biases = (torch.randn(NUM_EXPERTS, 2 * INTER, generator=g), torch.randn(NUM_EXPERTS, HIDDEN, generator=g))
    act = partial(fused.clamped_swiglu_mul, alpha=1.702, limit=2.0)
    x, routing = _routing(9, 4)
    make, kernels = (prepare_linear, None) if impl == "per-expert" else (None, impl)
    got = moe.routed_experts(x, routing, moe.expert_weights(gate_up, down, make, biases, act), kernels)  # type: ignore[arg-type]
    want = torch.zeros_like(x)
    for token, expert, weight in zip(routing.tokens.tolist(), routing.experts.tolist(), routing.weights.tolist()):
        gate, up = (gate_up[expert] @ x[token] + biases[0][expert]).chunk(2)
        gate, up = gate.clamp(max=2.0), up.clamp(-2.0, 2.0)
        want[token] += weight * (down[expert] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + biases[1][expert])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["per-expert", "torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("num_tokens", [1, 12])
def test_each_ranks_experts_sum_to_all_of_them(impl: str, num_tokens: int) -> None:
    """Expert parallel: the experts split over four ranks, each rank's output from the pairs
    routed to its two experts (the others' contribute zero, whatever their rows hold), summed,
    is the output of all eight; a rank none of the tokens chose gives zeros (one token: at
    least two of the four)."""
    gate_up, down = _stacked(torch.float32, 6)
    g = torch.Generator().manual_seed(6)
    biases = (torch.randn(NUM_EXPERTS, 2 * INTER, generator=g), torch.randn(NUM_EXPERTS, HIDDEN, generator=g))
    x, routing = _routing(num_tokens, 6)
    make = prepare_linear if impl == "per-expert" else None
    kernels: KernelImpl = None if impl == "per-expert" else impl

    def experts(first: int, count: int) -> moe.ExpertWeights:
        held = slice(first, first + count)
        part = (biases[0][held], biases[1][held])
        return moe.expert_weights(gate_up[held], down[held], make, part, first=first)

    firsts = range(0, NUM_EXPERTS, 2)
    parts = [moe.routed_experts(x, routing, experts(first, 2), kernels) for first in firsts]
    whole = moe.routed_experts(x, routing, experts(0, NUM_EXPERTS), kernels)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
    chosen = set(routing.experts.tolist())
    for first, part in zip(firsts, parts):
        assert part.isfinite().all() and (part.abs().sum() == 0) == (not chosen & {first, first + 1})
