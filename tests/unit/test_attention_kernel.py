"""Triton kernels (CPU, ``TRITON_INTERPRET=1``) and the compiled CPU kernels vs torch references vs
naive dense attention."""

from __future__ import annotations

import os

# Triton decides interpreted vs compiled when a kernel is defined, i.e. at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from zerobubble.kernels._triton import HAS_TRITON  # noqa: E402
from zerobubble.kernels.attention import (  # noqa: E402
    CPP_MAX_QUERY_LEN,
    AttentionMetadata,
    new_kv_cache,
    paged_attention,
    write_kv_cache,
)
from zerobubble.kernels.slot_mapping import compute_slot_mapping  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

NUM_Q_HEADS, NUM_KV_HEADS = 4, 2
# (tokens already in the cache, query tokens this step) per request: decodes, a verification
# row, a chunk continuing a prefill, a fresh prefill longer than the batched threshold.
REQUESTS = [(9, 1), (0, 7), (3, 1), (5, 3), (4, 20), (0, 18)]
# Decode and verification rows only (the Triton kernel's small tiles), and prefill chunks that
# span several of its large tiles, one of them beside a decode.
DECODES = [(9, 1), (30, 4), (3, 1), (0, 2), (17, 4)]
LONG_PREFILLS = [(0, 70), (6, 1), (37, 45)]


def _random_cache(
    shape: tuple[int, int, int, int], layout: str, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V ``[num_blocks, block_size, Hkv, D]``, contiguous or in :func:`new_kv_cache`'s layout."""
    if layout == "contiguous":
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k_cache, v_cache = new_kv_cache(*shape, torch.float32, "cpu")
    k_cache.copy_(torch.randn(shape, generator=g))
    v_cache.copy_(torch.randn(shape, generator=g))
    return k_cache, v_cache


def _batch(
    block_size: int,
    head_dim: int,
    seed: int,
    num_kv_heads: int = NUM_KV_HEADS,
    layout: str = "new_kv_cache",
    requests: list[tuple[int, int]] = REQUESTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q, caches full of random values, and metadata with scattered, -1-padded block tables."""
    g = torch.Generator().manual_seed(seed)
    q_lens = [q for _, q in requests]
    seq_lens = [c + q for c, q in requests]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_needed) + 2
    block_tables = torch.full((len(requests), max_blocks), -1, dtype=torch.int32)
    for r, n in enumerate(blocks_needed):
        block_tables[r, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    k_cache, v_cache = _random_cache((num_blocks, block_size, num_kv_heads, head_dim), layout, g)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in requests])
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        slot_mapping=compute_slot_mapping(query_start_loc, positions, block_tables, block_size),
    )
    q = torch.randn(int(query_start_loc[-1]), NUM_Q_HEADS, head_dim, generator=g)
    return q, k_cache, v_cache, meta


def _dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per request: read its context position by position, then plain masked softmax in float64;
    ``sinks [Hq]``: each head's logit joins the denominator (one more key, with no value)."""
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for r in range(meta.seq_lens.shape[0]):
        start, end = int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])
        seq_len = int(meta.seq_lens[r])
        pos = torch.arange(seq_len)
        blocks = meta.block_tables[r, pos // block_size].long()
        keys = k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        query_pos = torch.arange(seq_len - (end - start), seq_len)
        visible = pos[None, :] <= query_pos[:, None]
        if window:
            visible &= pos[None, :] > query_pos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            exp = (scores - scores.amax(-1, keepdim=True)).exp()
            sink = (sinks.double()[:, None, None] - scores.amax(-1, keepdim=True)).exp()
            probs = exp / (exp.sum(-1, keepdim=True) + sink)
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize(("block_size", "head_dim"), [(4, 16), (5, 24)])
def test_paged_attention_torch_matches_dense(block_size: int, head_dim: int, window: int) -> None:
    q, k_cache, v_cache, meta = _batch(block_size, head_dim, seed=block_size)
    scale = head_dim**-0.5
    expected = _dense_attention(q, k_cache, v_cache, meta, scale, window)
    got = paged_attention(q, k_cache, v_cache, meta, scale, impl="torch", sliding_window=window or None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton), "cpp", "gathered"])
@pytest.mark.parametrize("requests", [REQUESTS, LONG_PREFILLS], ids=["mixed", "long-prefills"])
def test_soft_capped_attention_matches_dense(impl: str, requests: list[tuple[int, int]]) -> None:
    """Gemma 2's ``softcap * tanh(s / softcap)`` on every path; the compiled CPU kernel has no
    cap and hands such layers to the torch path (so "cpp" needs no compiled kernels here)."""
    q, k_cache, v_cache, meta = _batch(4, 16, seed=7, requests=requests)
    q = q * 3  # scores of several units, where the cap bites
    expected = _dense_attention(q, k_cache, v_cache, meta, 0.25, 6, softcap=2.0)
    assert not torch.allclose(expected, _dense_attention(q, k_cache, v_cache, meta, 0.25, 6), atol=1e-3)
    if impl == "gathered":
        from zerobubble.kernels.attention import _paged_attention_gathered

        got = _paged_attention_gathered(q, k_cache, v_cache, meta, 0.25, 6, 2.0)
    else:
        got = paged_attention(q, k_cache, v_cache, meta, 0.25, impl=impl, sliding_window=6, softcap=2.0)  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton), "cpp", "gathered"])
@pytest.mark.parametrize("requests", [REQUESTS, DECODES, LONG_PREFILLS], ids=["mixed", "decodes", "long-prefills"])
def test_attention_sinks_match_dense(
    request: pytest.FixtureRequest, impl: str, requests: list[tuple[int, int]], window: int
) -> None:
    """gpt-oss's sinks on every path: each head's logit joins the softmax's denominator. The
    sinks span the scores' range, so some heads give most of their mass to the sink."""
    if impl == "cpp":
        request.getfixturevalue("cpu_kernels")
    q, k_cache, v_cache, meta = _batch(4, 16, seed=5, requests=requests)
    sinks = torch.tensor([-2.0, 0.5, 3.0, 8.0])
    expected = _dense_attention(q, k_cache, v_cache, meta, 0.25, window, sinks=sinks)
    assert not torch.allclose(expected, _dense_attention(q, k_cache, v_cache, meta, 0.25, window), atol=1e-3)
    if impl == "gathered":
        from zerobubble.kernels.attention import _paged_attention_gathered

        got = _paged_attention_gathered(q, k_cache, v_cache, meta, 0.25, window, sinks=sinks)
    else:
        got = paged_attention(q, k_cache, v_cache, meta, 0.25, impl=impl, sliding_window=window or None, sinks=sinks)  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    twin = paged_attention(q, k_cache, v_cache, meta, 0.25, impl="torch", sliding_window=window or None, sinks=sinks)
    torch.testing.assert_close(got, twin, atol=1e-5, rtol=1e-5)


def test_attention_sinks_cpp_in_bfloat16_matches_dense(cpu_kernels: None) -> None:
    """The C++ kernel's compiled geometry (block size 16, head dim 64) with sinks."""
    _, k_cache, v_cache, meta = _batch(16, 64, 1, requests=REQUESTS)
    q = torch.randn(int(meta.query_start_loc[-1]), NUM_Q_HEADS, 64, generator=torch.Generator().manual_seed(4))
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    sinks = torch.tensor([-1.0, 0.0, 1.0, 2.0])
    got = paged_attention(q, k_cache, v_cache, meta, 0.125, impl="cpp", sliding_window=6, sinks=sinks)
    expected = _dense_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.125, 6, sinks=sinks)
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2**-7)


@needs_triton
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("requests", [REQUESTS, DECODES, LONG_PREFILLS], ids=["mixed", "decodes", "long-prefills"])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "num_kv_heads", "layout"),
    [(4, 16, 2, "new_kv_cache"), (5, 24, 2, "new_kv_cache"), (4, 16, 4, "new_kv_cache"), (4, 16, 1, "contiguous")],
)
def test_paged_attention_triton_matches_torch(
    block_size: int, head_dim: int, num_kv_heads: int, layout: str, requests: list[tuple[int, int]], window: int
) -> None:
    q, k_cache, v_cache, meta = _batch(block_size, head_dim, block_size, num_kv_heads, layout, requests)
    scale = head_dim**-0.5
    triton_out = paged_attention(q, k_cache, v_cache, meta, scale, impl="triton", sliding_window=window or None)
    torch.testing.assert_close(
        triton_out, _dense_attention(q, k_cache, v_cache, meta, scale, window), atol=1e-5, rtol=1e-5
    )
    if layout == "new_kv_cache":  # the torch path reads only that layout
        torch_out = paged_attention(q, k_cache, v_cache, meta, scale, impl="torch", sliding_window=window or None)
        torch.testing.assert_close(triton_out, torch_out, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("requests", [DECODES, LONG_PREFILLS], ids=["decodes", "long-prefills"])
def test_paged_attention_triton_in_bfloat16_matches_torch(requests: list[tuple[int, int]]) -> None:
    q, k_cache, v_cache, meta = _batch(4, 16, 1, requests=requests)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    scale = 0.25
    triton_out = paged_attention(q, k_cache, v_cache, meta, scale, impl="triton")
    assert triton_out.dtype == torch.bfloat16
    expected = _dense_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, 0)
    # bfloat16 inputs, probabilities rounded to bfloat16 before the value product: ~3 digits.
    torch.testing.assert_close(triton_out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("requests", [REQUESTS, DECODES, LONG_PREFILLS], ids=["mixed", "decodes", "long-prefills"])
@pytest.mark.parametrize(("block_size", "head_dim", "num_kv_heads"), [(4, 16, 2), (5, 24, 2), (16, 64, 1), (4, 16, 4)])
def test_paged_attention_cpp_matches_dense(
    cpu_kernels: None, block_size: int, head_dim: int, num_kv_heads: int, requests: list[tuple[int, int]], window: int
) -> None:
    """The C++ kernel takes the short rows, SDPA the long ones, as the model runs them."""
    q, k_cache, v_cache, meta = _batch(block_size, head_dim, block_size, num_kv_heads, requests=requests)
    scale = head_dim**-0.5
    got = paged_attention(q, k_cache, v_cache, meta, scale, impl="cpp", sliding_window=window or None)
    torch.testing.assert_close(got, _dense_attention(q, k_cache, v_cache, meta, scale, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 300])
def test_paged_attention_cpp_leaves_long_prefills_to_sdpa(cpu_kernels: None, window: int) -> None:
    """A prompt longer than CPP_MAX_QUERY_LEN (SDPA) beside a shorter one and a decode (the
    kernel), a chunk continuing a context among them: all match the dense oracle."""
    assert CPP_MAX_QUERY_LEN < 530
    requests = [(0, 530), (3, 1), (20, 200), (600, 40)]
    q, k_cache, v_cache, meta = _batch(16, 64, 7, requests=requests)
    q = q.bfloat16()
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    got = paged_attention(q, k_cache, v_cache, meta, 0.125, impl="cpp", sliding_window=window or None)
    expected = _dense_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.125, window)
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2**-7)


def test_paged_attention_cpp_attends_wide_query_groups(cpu_kernels: None) -> None:
    """Ten query heads a KV head: the kernel takes a KV head's query heads eight at a time."""
    _, k_cache, v_cache, meta = _batch(16, 64, 2, requests=REQUESTS)
    q = torch.randn(int(meta.query_start_loc[-1]), 20, 64, generator=torch.Generator().manual_seed(3))
    got = paged_attention(q, k_cache, v_cache, meta, 0.125, impl="cpp", sliding_window=6)
    torch.testing.assert_close(got, _dense_attention(q, k_cache, v_cache, meta, 0.125, 6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "num_q_heads", "num_kv_heads"),
    [(4, 16, 4, 1), (16, 64, 9, 3), (32, 128, 12, 2)],
    ids=["generic-loop", "smollm2-groups-of-3", "groups-of-6"],
)
def test_paged_attention_cpp_in_bfloat16_matches_dense(
    cpu_kernels: None, window: int, block_size: int, head_dim: int, num_q_heads: int, num_kv_heads: int
) -> None:
    """The geometries compiled with vector key rows (block size 16 or 32) and the generic loop;
    query groups of a compiled size (3) and of one run as the next (6 as 8, two heads unused)."""
    _, k_cache, v_cache, meta = _batch(block_size, head_dim, 1, num_kv_heads, requests=REQUESTS)
    q = torch.randn(int(meta.query_start_loc[-1]), num_q_heads, head_dim, generator=torch.Generator().manual_seed(4))
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    scale = head_dim**-0.5
    got = paged_attention(q, k_cache, v_cache, meta, scale, impl="cpp", sliding_window=window or None)
    assert got.dtype == torch.bfloat16
    expected = _dense_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, window)
    # bfloat16 inputs, float32 scores, probabilities and sums, one rounding of the output: a
    # bfloat16 step (2^-8 relative) of the largest outputs.
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2**-7)


def test_paged_attention_cpp_names_a_bad_cache(cpu_kernels: None) -> None:
    q, k_cache, v_cache, meta = _batch(4, 16, seed=0)
    with pytest.raises(RuntimeError, match="caches must be in q's dtype"):
        paged_attention(q.bfloat16(), k_cache, v_cache, meta, 0.25, impl="cpp")


def test_torch_path_rejects_other_layouts() -> None:
    q, k_cache, v_cache, meta = _batch(4, 16, seed=0, layout="contiguous")
    with pytest.raises(ValueError, match="new_kv_cache"):
        paged_attention(q, k_cache, v_cache, meta, 0.25, impl="torch")


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "cpp"])
@pytest.mark.parametrize("layout", ["new_kv_cache", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_torch(
    request: pytest.FixtureRequest, impl: str, layout: str, dtype: torch.dtype
) -> None:
    if impl == "cpp":
        request.getfixturevalue("cpu_kernels")
    q, k_cache, v_cache, meta = _batch(4, 16, seed=7, layout=layout)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    g = torch.Generator().manual_seed(8)
    # k and v as the model passes them: strided views of one fused projection.
    kv = torch.randn(q.shape[0], 2 * NUM_KV_HEADS + 1, 16, generator=g).to(dtype)
    k, v = kv[:, 1 : 1 + NUM_KV_HEADS], kv[:, 1 + NUM_KV_HEADS :]
    caches = {name: (k_cache.clone(), v_cache.clone()) for name in ("torch", impl)}
    for name, (kc, vc) in caches.items():
        write_kv_cache(k, v, kc, vc, meta.slot_mapping, impl=name)  # type: ignore[arg-type]
    assert torch.equal(caches["torch"][0], caches[impl][0])
    assert torch.equal(caches["torch"][1], caches[impl][1])
    written = caches["torch"][0][meta.slot_mapping // 4, meta.slot_mapping % 4]
    assert torch.equal(written, k)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_slot_mapping_matches_python(impl: str) -> None:
    block_size = 4
    _, _, _, meta = _batch(block_size, 16, seed=3)
    positions = torch.cat([torch.arange(c, c + q) for c, q in REQUESTS])
    expected = []
    for r, (context, num_queries) in enumerate(REQUESTS):
        for p in range(context, context + num_queries):
            expected.append(int(meta.block_tables[r, p // block_size]) * block_size + p % block_size)
    got = compute_slot_mapping(meta.query_start_loc, positions, meta.block_tables, block_size, impl=impl)
    assert got.dtype == torch.int64
    assert got.tolist() == expected


def test_empty_batch() -> None:
    q, k_cache, v_cache, _ = _batch(4, 16, seed=0)
    empty = AttentionMetadata(
        query_start_loc=torch.zeros(1, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        block_tables=torch.zeros(0, 1, dtype=torch.int32),
        max_query_len=0,
        max_seq_len=0,
        slot_mapping=torch.zeros(0, dtype=torch.int64),
    )
    assert paged_attention(q[:0], k_cache, v_cache, empty, 0.25).shape == (0, NUM_Q_HEADS, 16)
    assert (
        compute_slot_mapping(empty.query_start_loc, torch.zeros(0, dtype=torch.long), empty.block_tables, 4).numel()
        == 0
    )


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton), "cpp", "gathered"])
@pytest.mark.parametrize("requests", [REQUESTS, DECODES, LONG_PREFILLS], ids=["mixed", "decodes", "long-prefills"])
def test_blocks_behind_the_window_get_no_weight_whatever_they_hold(
    request: pytest.FixtureRequest, impl: str, requests: list[tuple[int, int]]
) -> None:
    """A sliding-window model's scheduler frees a running request's blocks behind its window
    and hands them to others, while the worker keeps their ids in the request's table
    (scheduler_svc/window.py). Every path must give those keys no weight: here each such table
    entry is pointed at another request's block or at a block of huge values, and the output
    is the one attention over the request's own window gives."""
    if impl == "cpp":
        request.getfixturevalue("cpu_kernels")
    block_size, window = 4, 6
    q, k_cache, v_cache, meta = _batch(block_size, 16, seed=11, requests=requests)
    expected = _dense_attention(q, k_cache, v_cache, meta, 0.25, window)
    tables = meta.block_tables
    poison = sorted(set(range(k_cache.shape[0])) - set(tables.flatten().tolist()))[0]
    k_cache[poison].fill_(1e4)
    v_cache[poison].fill_(-1e4)
    num_aliased = 0
    for r, (num_cached, _) in enumerate(requests):
        other = tables[(r + 1) % len(requests), 0].item()
        for i in range(max(0, num_cached - window + 1) // block_size):  # blocks before the first query's window
            tables[r, i] = poison if i % 2 == 0 else other
            num_aliased += 1
    assert num_aliased > 0
    if impl == "gathered":
        from zerobubble.kernels.attention import _paged_attention_gathered

        got = _paged_attention_gathered(q, k_cache, v_cache, meta, 0.25, window)
    else:
        got = paged_attention(q, k_cache, v_cache, meta, 0.25, impl=impl, sliding_window=window)  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
