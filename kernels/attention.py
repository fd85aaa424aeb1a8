"""Paged KV-cache writes and causal paged attention over a flat batch of many requests.

The flat batch holds request ``r``'s query tokens at ``[query_start_loc[r], query_start_loc[r+1])``;
query token ``j`` of ``r`` sits at position ``seq_lens[r] - q_len[r] + j`` and attends to
positions ``0..that position`` of its own request (optionally only the last ``sliding_window``
of them), read through ``block_tables[r]`` from caches shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``. Query head ``h`` reads KV head
``h // (num_q_heads // num_kv_heads)`` (grouped-query attention).

Each public function has a torch implementation (CPU, and what the model uses there) and a Triton
implementation (CUDA, or forced with ``impl="triton"``) with identical semantics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, KernelImpl, next_power_of_2, tl, triton, use_triton

# Requests with at most this many query tokens (decodes, speculative verification) are batched
# into one padded SDPA call; longer ones (prefill chunks) run one request at a time, where
# padding every row to the longest chunk would waste far more than the loop costs.
MAX_BATCHED_QUERY_LEN = 16
# Stands in for "no sliding window" in the Triton kernel: wider than any context.
_NO_WINDOW = 1 << 30


@dataclass(slots=True)
class AttentionMetadata:
    """Where each request's tokens sit in the flat batch and in the paged KV cache."""

    query_start_loc: torch.Tensor  # [R+1] int32: request r owns flat tokens [qsl[r], qsl[r+1])
    seq_lens: torch.Tensor  # [R] int32: context length of r after this step's tokens
    block_tables: torch.Tensor  # [R, max_blocks] int32 (padding entries are never read)
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor  # [T] int64: where token t's K/V are written


@dataclass(slots=True)
class _PrefillRow:
    start: int
    end: int
    seq_len: int
    num_keys: int  # seq_len rounded up to whole blocks
    cache_chunks: torch.Tensor  # see _chunk_index


@dataclass(slots=True)
class AttentionPlan:
    """Host-side bookkeeping for the torch path, derived once per step and shared by all layers.

    K/V are gathered straight into the ``[.., Hkv, L, D]`` layout SDPA reads fastest, whole
    ``block_size x head_dim`` slabs at a time when the cache is head-major (see :func:`_chunk_index`).
    """

    num_tokens: int
    # Batched short rows: query tokens padded to [num_rows, max_len] (padding repeats a real token).
    batched_token_index: torch.Tensor | None = None  # [Rb, Qb] int64
    batched_query_pos: torch.Tensor | None = None  # [Rb, Qb] int64
    batched_cache_chunks: torch.Tensor | None = None  # see _chunk_index (blocks past the context -> block 0)
    batched_num_keys: int = 0  # Lb: padded context length of the batched rows
    batched_valid: torch.Tensor | None = None  # [Rb * Qb] bool, None when there is no padding
    batched_out_index: torch.Tensor | None = None  # [num valid] int64, None when rows cover the batch in order
    prefill_rows: list[_PrefillRow] = field(default_factory=list)
    masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (row or -1, window) -> mask
    # Gather targets reused by every layer and row: a fresh multi-MB tensor per layer costs page faults.
    num_buffer_elements: int = 0
    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None


def _check_cache_layout(cache: torch.Tensor) -> None:
    """The torch path reads any dense layout whose head_dim is innermost (row gathers need it)."""
    head_dim = cache.shape[-1]
    dims = sorted(range(cache.dim()), key=lambda d: cache.stride(d))
    expected = 1
    for d in dims:
        if cache.stride(d) != expected and cache.shape[d] > 1:
            raise ValueError(f"KV cache with strides {cache.stride()} is not dense")
        expected *= cache.shape[d]
    if cache.stride(-1) != 1 or any(stride % head_dim for stride in cache.stride()[:-1]):
        raise ValueError(f"KV cache with strides {cache.stride()} does not keep head_dim innermost")


def _slots_per_chunk(cache: torch.Tensor) -> int:
    """How many consecutive slots of one head sit contiguously: a whole block when head-major."""
    return cache.shape[1] if cache.stride(1) == cache.shape[-1] else 1


def _cache_chunks(cache: torch.Tensor, slots_per_chunk: int) -> torch.Tensor:
    """A dense cache as ``[num_chunks, slots_per_chunk * head_dim]``, whatever its dim order."""
    width = slots_per_chunk * cache.shape[-1]
    return cache.as_strided((cache.numel() // width, width), (width, 1))


def _chunk_index(block_ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Chunks of ``_cache_chunks`` holding ``block_ids`` ``[N, nblk]``, ordered ``[N, Hkv, positions]``.

    Gathering them yields ``[N, Hkv, nblk * block_size, head_dim]`` contiguous, SDPA's layout.
    """
    _, block_size, num_kv_heads, head_dim = cache.shape
    per_chunk = _slots_per_chunk(cache)
    width = per_chunk * head_dim
    block_stride, slot_stride, head_stride = (s // width for s in cache.stride()[:3])
    device = block_ids.device
    slots = torch.arange(0, block_size, per_chunk, device=device)
    chunks = (
        block_ids[:, None, :, None] * block_stride
        + torch.arange(num_kv_heads, device=device)[None, :, None, None] * head_stride
        + slots[None, None, None, :] * slot_stride
    )
    return chunks.reshape(-1)


def plan_attention(meta: AttentionMetadata, k_cache: torch.Tensor) -> AttentionPlan:
    """Split the batch into batched short rows and looped long rows (torch path only).

    ``k_cache`` supplies the block size and layout; every layer's caches must share them.
    """
    _check_cache_layout(k_cache)
    block_size = k_cache.shape[1]
    head_elements = k_cache.shape[2] * k_cache.shape[3]
    qsl = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    num_requests = len(seq_lens)
    plan = AttentionPlan(num_tokens=qsl[-1] if qsl else 0)
    device = meta.block_tables.device
    short = [r for r in range(num_requests) if 0 < qsl[r + 1] - qsl[r] <= MAX_BATCHED_QUERY_LEN]
    for r in range(num_requests):
        if qsl[r + 1] - qsl[r] > MAX_BATCHED_QUERY_LEN:
            num_blocks = -(-seq_lens[r] // block_size)
            chunks = _chunk_index(meta.block_tables[r : r + 1, :num_blocks].long(), k_cache)
            plan.prefill_rows.append(_PrefillRow(qsl[r], qsl[r + 1], seq_lens[r], num_blocks * block_size, chunks))
            plan.num_buffer_elements = max(plan.num_buffer_elements, num_blocks * block_size * head_elements)
    if not short:
        return plan

    index = torch.tensor(short, dtype=torch.long, device=device)
    starts = meta.query_start_loc.long()[index]
    q_lens = meta.query_start_loc.long()[index + 1] - starts
    seqs = meta.seq_lens.long()[index]
    max_q = max(qsl[r + 1] - qsl[r] for r in short)
    max_blocks = -(-max(seq_lens[r] for r in short) // block_size)
    # Padding query slots repeat the row's last real token, so every padded row keeps a
    # non-empty causal window (an all-masked row would make SDPA produce NaN).
    offsets = torch.minimum(torch.arange(max_q, device=device)[None, :], (q_lens - 1)[:, None])
    plan.batched_token_index = starts[:, None] + offsets
    plan.batched_query_pos = (seqs - q_lens)[:, None] + offsets
    columns = torch.arange(max_blocks, device=device)[None, :]
    tables = meta.block_tables[index, :max_blocks].long()
    # Table entries past a row's context may be padding (even -1); they are masked anyway.
    needed = columns < (-(-seqs // block_size))[:, None]
    block_ids = torch.where(needed, tables, torch.zeros_like(tables))
    plan.batched_cache_chunks = _chunk_index(block_ids, k_cache)
    plan.batched_num_keys = max_blocks * block_size
    plan.num_buffer_elements = max(plan.num_buffer_elements, len(short) * plan.batched_num_keys * head_elements)
    all_full = all(qsl[r + 1] - qsl[r] == max_q for r in short)
    if not all_full:
        plan.batched_valid = (torch.arange(max_q, device=device)[None, :] < q_lens[:, None]).reshape(-1)
    if not (len(short) == num_requests and all_full):
        token_index = plan.batched_token_index.reshape(-1)
        plan.batched_out_index = token_index if plan.batched_valid is None else token_index[plan.batched_valid]
    return plan


def _window_mask(query_pos: torch.Tensor, num_keys: int, sliding_window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[..., num_keys]``: key ``j`` visible to a query at ``p`` iff ``p - W < j <= p``.

    Additive rather than boolean: SDPA would convert a boolean mask on every call.
    """
    keys = torch.arange(num_keys, device=query_pos.device)
    hidden = keys > query_pos[..., None]
    if sliding_window > 0:
        hidden |= keys <= (query_pos[..., None] - sliding_window)
    return torch.zeros(hidden.shape, dtype=dtype, device=query_pos.device).masked_fill_(hidden, float("-inf"))


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: KernelImpl = None,
) -> None:
    """Store ``k``/``v`` ``[T, num_kv_heads, head_dim]`` at flat slots ``slot_mapping`` (all valid)."""
    if k.shape[0] == 0:
        return
    if use_triton(k, impl, _write_kv_kernel if HAS_TRITON else None):
        _write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    _check_cache_layout(k_cache)
    if v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    block_stride, slot_stride, head_stride = (s // head_dim for s in k_cache.stride()[:3])
    slots = slot_mapping.long()
    rows = (slots // block_size * block_stride + slots % block_size * slot_stride)[:, None] + (
        torch.arange(num_kv_heads, device=slots.device) * head_stride
    )
    rows = rows.reshape(-1)
    _cache_chunks(k_cache, 1).index_copy_(0, rows, k.reshape(-1, head_dim).to(k_cache.dtype))
    _cache_chunks(v_cache, 1).index_copy_(0, rows, v.reshape(-1, head_dim).to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    impl: KernelImpl = None,
    *,
    sliding_window: int | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[T, Hq, D]`` over each request's paged context -> ``[T, Hq, D]``.

    ``plan`` (from :func:`plan_attention`) lets a model reuse the torch path's bookkeeping
    across layers; the Triton path ignores it.
    """
    window = sliding_window or 0
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if use_triton(q, impl, _paged_attention_kernel if HAS_TRITON else None):
        return _paged_attention_triton(q, k_cache, v_cache, meta, scale, window)
    if plan is None:
        plan = plan_attention(meta, k_cache)
    return _paged_attention_torch(q, k_cache, v_cache, plan, scale, window)


def _gather(cache: torch.Tensor, chunks: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The ``chunks`` of ``cache`` into the front of the flat ``buffer``; returns that prefix, flat."""
    source = _cache_chunks(cache, _slots_per_chunk(cache))
    out = buffer[: chunks.shape[0] * source.shape[1]].view(chunks.shape[0], source.shape[1])
    return torch.index_select(source, 0, chunks, out=out).view(-1)


def _paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    window: int,
) -> torch.Tensor:
    if v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    enable_gqa = q.shape[1] != num_kv_heads
    if plan.key_buffer is None or plan.key_buffer.dtype != k_cache.dtype:
        plan.key_buffer = k_cache.new_empty(plan.num_buffer_elements)
        plan.value_buffer = v_cache.new_empty(plan.num_buffer_elements)
    out: torch.Tensor | None = None
    if plan.batched_token_index is not None:
        num_rows, max_q = plan.batched_token_index.shape
        keys = _gather(k_cache, plan.batched_cache_chunks, plan.key_buffer)
        values = _gather(v_cache, plan.batched_cache_chunks, plan.value_buffer)
        mask = plan.masks.get((-1, window))
        if mask is None:
            mask = _window_mask(plan.batched_query_pos, plan.batched_num_keys, window, q.dtype).unsqueeze(1)
            plan.masks[(-1, window)] = mask
        if plan.batched_out_index is None:
            rows = q.view(num_rows, max_q, *q.shape[1:])
        else:
            rows = q[plan.batched_token_index]
        attended = F.scaled_dot_product_attention(
            rows.transpose(1, 2),
            keys.view(num_rows, num_kv_heads, -1, head_dim),
            values.view(num_rows, num_kv_heads, -1, head_dim),
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        ).transpose(1, 2)
        if plan.batched_out_index is None:  # the rows are exactly the batch, in order
            return attended.reshape(q.shape)
        out = torch.empty_like(q)
        flat = attended.reshape(-1, *q.shape[1:])
        if plan.batched_valid is not None:
            flat = flat[plan.batched_valid]
        out[plan.batched_out_index] = flat
    if out is None:
        out = torch.empty_like(q)
    for i, row in enumerate(plan.prefill_rows):
        num_queries = row.end - row.start
        keys = _gather(k_cache, row.cache_chunks, plan.key_buffer).view(1, num_kv_heads, row.num_keys, head_dim)
        values = _gather(v_cache, row.cache_chunks, plan.value_buffer).view(1, num_kv_heads, row.num_keys, head_dim)
        fresh = row.seq_len == num_queries and (window == 0 or window >= row.seq_len)
        mask = None
        if not fresh:
            mask = plan.masks.get((i, window))
            if mask is None:
                query_pos = torch.arange(row.seq_len - num_queries, row.seq_len, device=q.device)
                mask = _window_mask(query_pos, row.seq_len, window, q.dtype)
                plan.masks[(i, window)] = mask
        out[row.start : row.end] = F.scaled_dot_product_attention(
            q[row.start : row.end].transpose(0, 1).unsqueeze(0),
            keys[:, :, : row.seq_len],
            values[:, :, : row.seq_len],
            attn_mask=mask,
            is_causal=fresh,
            scale=scale,
            enable_gqa=enable_gqa,
        )[0].transpose(0, 1)
    return out


def _write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
    )  # fmt: skip


def _paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_requests = meta.seq_lens.shape[0]
    out = torch.empty_like(q)
    grid = (meta.max_query_len, num_requests, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale, window if window > 0 else _NO_WINDOW,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        k_cache.shape[1], num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_G=next_power_of_2(num_q_heads // num_kv_heads), BLOCK_N=32,
    )  # fmt: skip
    return out


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        block_size, num_kv_heads, head_dim,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One program per token: copy its [num_kv_heads, head_dim] K and V into its slot."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head + dims
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head + dims
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
        scale, sliding_window,
        stride_qt, stride_qh,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_ot, stride_oh,
        stride_bt,
        block_size, num_queries_per_kv,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """One program per (query token, KV head): its query heads share each K/V tile; online softmax."""
        i = tl.program_id(0)
        r = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + r)
        q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
        if i < q_len:
            query_pos = tl.load(seq_lens_ptr + r) - q_len + i
            t = (q_start + i).to(tl.int64)
            heads = kv_head * num_queries_per_kv + tl.arange(0, BLOCK_G)
            head_mask = tl.arange(0, BLOCK_G) < num_queries_per_kv
            dims = tl.arange(0, BLOCK_D)
            dim_mask = dims < HEAD_DIM
            q_mask = head_mask[:, None] & dim_mask[None, :]
            q_offsets = t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
            q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)  # [G, D]
            # The host passes a huge window for full attention, which keeps this branch-free.
            first_key = tl.maximum(query_pos - sliding_window + 1, 0)
            m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_G,), tl.float32)
            acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
            # Tiles start at a multiple of BLOCK_N, so each tile holds at least one visible key.
            for tile_start in range((first_key // BLOCK_N) * BLOCK_N, query_pos + 1, BLOCK_N):
                keys_pos = tile_start + tl.arange(0, BLOCK_N)
                visible = (keys_pos <= query_pos) & (keys_pos >= first_key)
                block = tl.load(block_tables_ptr + r * stride_bt + keys_pos // block_size, mask=visible, other=0)
                block = block.to(tl.int64)
                offset = keys_pos % block_size
                kv_mask = visible[:, None] & dim_mask[None, :]
                k = tl.load(
                    k_cache_ptr + block[:, None] * stride_kc_block + offset[:, None] * stride_kc_slot
                    + kv_head * stride_kc_head + dims[None, :],
                    mask=kv_mask, other=0.0,
                ).to(tl.float32)  # fmt: skip
                scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
                scores = tl.where(visible[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                p = tl.exp(scores - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                v = tl.load(
                    v_cache_ptr + block[:, None] * stride_vc_block + offset[:, None] * stride_vc_slot
                    + kv_head * stride_vc_head + dims[None, :],
                    mask=kv_mask, other=0.0,
                ).to(tl.float32)  # fmt: skip
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
            result = acc / l_i[:, None]
            out_offsets = t * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=q_mask)
