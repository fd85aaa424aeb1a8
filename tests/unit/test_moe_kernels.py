"""The routed-expert kernels (zerobubble.kernels.moe): the Triton grouped product (CPU
interpreter), the CPU per-expert path and the compiled experts op against their torch twins,
over ragged expert loads."""

from __future__ import annotations

import os

# Triton decides interpreted vs compiled when a kernel is defined, i.e. at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402
from functools import partial  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from zerobubble.kernels import cpu, fused, moe  # noqa: E402
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


# The compiled experts op (csrc/moe.cpp): rows per expert, with idle experts, one expert holding
# every row, one row, a decode batch of 16 tokens' top-8 and a prefill of 300 tokens' top-8.
OP_LOADS = {
    "ragged": [3, 0, 1, 0, 5, 0, 0, 2],
    "one-expert": [0, 0, 0, 0, 0, 11, 0, 0],
    "one-row": [0, 0, 1, 0, 0, 0, 0, 0],
    "16x8": [30, 9, 0, 25, 17, 1, 40, 6],
    "300x8": [700, 13, 410, 0, 377, 500, 300, 100],
}
CLAMPED = partial(fused.clamped_swiglu_mul, alpha=1.702, limit=2.0)


def _compiled_experts(
    quantization: str, act: moe.ActMul, with_biases: bool, seed: int
) -> tuple[moe.ExpertWeights, moe.ExpertWeights]:
    """bfloat16 experts with their blocks stacked for the op, and the same weights (views) served
    by the per-expert loop; skips where the block product is not native."""
    if not torch.ops.zerobubble_cpu.block_linear_is_native():
        pytest.skip("this CPU has no AVX-512 BF16: the per-expert loop serves the experts")
    gate_up, down = (w * 5 for w in _stacked(torch.bfloat16, seed))  # gate·up values past the limit
    g = torch.Generator().manual_seed(seed)
    biases = (torch.randn(NUM_EXPERTS, 2 * INTER, generator=g), torch.randn(NUM_EXPERTS, HIDDEN, generator=g))
    make = partial(prepare_linear, quantization=quantization, impl="cpp")
    bf16_biases = (biases[0].bfloat16(), biases[1].bfloat16()) if with_biases else None
    experts = moe.expert_weights(gate_up, down, make, bf16_biases, act)
    assert experts.gate_up_blocks is not None and experts.down_blocks is not None
    loop = replace(experts, gate_up_blocks=None, down_blocks=None, gate_up_scale=None, down_scale=None)
    return experts, loop


@pytest.mark.parametrize("load", list(OP_LOADS))
@pytest.mark.parametrize("activation", ["swiglu", "clamped"])
@pytest.mark.parametrize("with_biases", [False, True], ids=["plain", "biases"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_compiled_experts_op_is_the_per_expert_loop(
    cpu_kernels: None, load: str, activation: str, with_biases: bool, quantization: str
) -> None:
    """One call for all experts against the per-expert loop of block products over the same
    blocks, rounded where the loop rounds: bit for bit with SwiGLU (the compiled SiLU both
    ways), within one bfloat16 step of the clamped SwiGLU's torch twin."""
    act = fused.silu_mul if activation == "swiglu" else CLAMPED
    experts, loop = _compiled_experts(quantization, act, with_biases, len(load))
    offsets = _offsets(OP_LOADS[load])
    rows = torch.randn(int(offsets[-1]), HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids = torch.repeat_interleave(torch.arange(NUM_EXPERTS), offsets.diff())
    got = moe.expert_mlps(rows, offsets, experts, "cpp", ids)
    want = moe.expert_mlps(rows, offsets, loop, "cpp", ids)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    if activation == "swiglu":
        assert torch.equal(got, want)
    else:
        _close(got, want, 2**-7)


def test_compiled_experts_op_matches_the_grouped_twin(cpu_kernels: None) -> None:
    """The op through `routed_experts` against the torch twin's grouped products of the same
    bfloat16 weights in float32: within bfloat16's roundings."""
    experts, _ = _compiled_experts("none", fused.silu_mul, False, 7)
    x, routing = _routing(24, 7, top_k=3)
    got = moe.routed_experts(x.bfloat16(), routing, experts, impl="cpp")
    gate_up, down = (w * 5 for w in _stacked(torch.bfloat16, 7))
    want = moe.routed_experts(x.bfloat16().float(), routing, moe.expert_weights(gate_up.float(), down.float()))
    _close(got, want, 3e-2)


def test_compiled_experts_op_writes_only_its_offsets_rows(cpu_kernels: None) -> None:
    """Offsets that start past row 0 and end before the last row (a rank's experts under expert
    parallelism): the rows between them are each expert's MLP, those outside are left alone."""
    experts, loop = _compiled_experts("none", fused.silu_mul, True, 3)
    offsets = torch.tensor([4, 6, 6, 7, 9, 9, 12, 12, 15])
    rows = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    # Both read each expert's biases by its offsets, not the rows' expert ids.
    got = moe.expert_mlps(rows, offsets, experts, "cpp")
    want = moe.expert_mlps(rows[4:15], offsets - 4, loop, "cpp")
    assert torch.equal(got[4:15], want)


def test_compiled_experts_op_only_where_it_applies(cpu_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks are stacked (one copy: each expert's weight is a view) only where every expert is
    the block product's: bfloat16 with the compiled kernels on AVX-512 BF16; elsewhere (oneDNN's
    layout, float32, a CPU without the instructions, an activation the op has not) the
    per-expert loop serves."""
    gate_up, down = _stacked(torch.bfloat16, 1)
    onednn = moe.expert_weights(gate_up, down, prepare_linear)
    assert onednn.gate_up_blocks is None and onednn.gate_up_each is not None
    assert moe.expert_weights(gate_up.float(), down.float(), partial(prepare_linear, impl="cpp")).down_blocks is None
    if torch.ops.zerobubble_cpu.block_linear_is_native():
        stacked = moe.expert_weights(gate_up, down, partial(prepare_linear, impl="cpp"))
        assert stacked.gate_up_blocks is not None and stacked.gate_up_each is not None
        each = stacked.gate_up_each[5].blocks
        assert each is not None and each.data_ptr() == stacked.gate_up_blocks[5].data_ptr()
        assert moe._compiled_activation(gate_up[0], stacked) is not None
        gelu = replace(stacked, act_mul=fused.gelu_tanh_mul)
        assert moe._compiled_activation(gate_up[0], gelu) is None
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    assert moe.expert_weights(gate_up, down, partial(prepare_linear, impl="cpp")).gate_up_blocks is None


def test_compiled_experts_op_names_what_it_refuses(cpu_kernels: None) -> None:
    """The op's checks: bfloat16 rows, blocks of every expert for the rows' width, a scale with
    int8 blocks only, offsets of every expert within the rows."""
    experts, _ = _compiled_experts("none", fused.silu_mul, False, 2)
    assert experts.gate_up_each is not None and experts.down_each is not None
    gate_up, down = experts.gate_up_blocks, experts.down_blocks
    rows, offsets = torch.randn(3, HIDDEN).bfloat16(), _offsets([1, 0, 2, 0, 0, 0, 0, 0])

    def run(rows: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, scale: torch.Tensor | None) -> None:
        torch.ops.zerobubble_cpu.moe_experts(
            rows, offsets, gate_up, 2 * INTER, scale, None, down, HIDDEN, None, None, 0, 1.0, 0.0, None, None, 0
        )

    with pytest.raises(RuntimeError, match="rows must be bfloat16"):
        run(rows.float(), offsets, gate_up, None)
    with pytest.raises(RuntimeError, match="gate_up must be contiguous"):
        run(rows[:, :32], offsets, gate_up, None)
    with pytest.raises(RuntimeError, match="a scale must be given for int8 blocks"):
        run(rows, offsets, gate_up, torch.ones(NUM_EXPERTS, 2 * INTER).bfloat16())
    with pytest.raises(RuntimeError, match="offsets must lie within the rows"):
        run(rows, offsets + 1, gate_up, None)
    with pytest.raises(RuntimeError, match="offsets must be int64"):
        run(rows, offsets[:-1], gate_up, None)


@pytest.mark.parametrize("num_tokens", [1, 12])
def test_compiled_experts_op_per_rank_sums_to_all_experts(cpu_kernels: None, num_tokens: int) -> None:
    """Expert parallel on the compiled op: four ranks of two experts each (their blocks stacked
    apart), each rank's output from its pairs only, summed, is the output of all eight."""
    if not torch.ops.zerobubble_cpu.block_linear_is_native():
        pytest.skip("this CPU has no AVX-512 BF16: the per-expert loop serves the experts")
    gate_up, down = _stacked(torch.bfloat16, 8)
    g = torch.Generator().manual_seed(8)
    biases = (
        torch.randn(NUM_EXPERTS, 2 * INTER, generator=g).bfloat16(),
        torch.randn(NUM_EXPERTS, HIDDEN, generator=g),
    )
    x, routing = _routing(num_tokens, 8)
    make = partial(prepare_linear, impl="cpp")

    def experts(first: int, count: int) -> moe.ExpertWeights:
        held = slice(first, first + count)
        part = (biases[0][held], biases[1][held].bfloat16())
        made = moe.expert_weights(gate_up[held], down[held], make, part, CLAMPED, first=first)
        assert made.gate_up_blocks is not None
        return made

    parts = [moe.routed_experts(x.bfloat16(), routing, experts(first, 2), "cpp") for first in range(0, NUM_EXPERTS, 2)]
    whole = moe.routed_experts(x.bfloat16(), routing, experts(0, NUM_EXPERTS), "cpp")
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 16, 300])
@pytest.mark.parametrize("activation", ["swiglu", "clamped"])
def test_compiled_experts_weighted_sum_is_the_twins(cpu_kernels: None, num_tokens: int, activation: str) -> None:
    """`routed_experts` on the op, the weighted sum per token in the same call, against the
    per-expert loop and the twin's float32 index_add_ over the same bfloat16 outputs (top-3 of
    8 experts): the same sums, added in the same order."""
    act = fused.silu_mul if activation == "swiglu" else CLAMPED
    experts, loop = _compiled_experts("none", act, True, num_tokens)
    x, routing = _routing(num_tokens, num_tokens, top_k=3)
    got = moe.routed_experts(x.bfloat16(), routing, experts, "cpp")
    want = moe.routed_experts(x.bfloat16(), routing, loop, "cpp")
    assert got.dtype == torch.float32 and got.shape == (num_tokens, HIDDEN)
    if activation == "swiglu":
        assert torch.equal(got, want)
    else:
        _close(got, want, 2**-7)
