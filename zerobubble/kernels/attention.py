"""Paged KV-cache writes and causal paged attention over a flat batch of many requests.

The flat batch holds request ``r``'s query tokens at ``[query_start_loc[r], query_start_loc[r+1])``;
query token ``j`` of ``r`` sits at position ``seq_lens[r] - q_len[r] + j`` and attends to
positions ``0..that position`` of its own request (optionally only the last ``sliding_window``
of them), read through ``block_tables[r]`` from caches shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``. Query head ``h`` reads KV head
``h // (num_q_heads // num_kv_heads)`` (grouped-query attention). With ``softcap`` (Gemma 2)
each scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` before the mask and softmax. With
``sinks`` (gpt-oss) each query head has a learned logit that joins the softmax's denominator as
one more key with no value: it takes a share of the probability mass, which then attends to
nothing. Without them every path runs as before.

Each public function has a torch implementation (CPU, and what the model uses there) and a Triton
implementation (CUDA, or forced with ``impl="triton"``) with identical semantics. The Triton
kernels address the caches through their strides; the torch attention path needs the storage
layout of :func:`new_kv_cache`, which lets it read the paged cache in place: on a CPU, attention
over a long context is bound by memory traffic, and copying each request's context out of the
pages first would double it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, is_interpreted, next_power_of_2, tl, triton, use_triton

# Requests with at most this many query tokens (decodes, speculative verification) are batched
# into one padded computation; longer ones (prefill chunks) run one request at a time, where
# padding every row to the longest chunk would waste far more than the loop costs.
MAX_BATCHED_QUERY_LEN = 16
# The compiled CPU kernel attends rows of up to this many query tokens itself, one token at a
# time: decodes, verification and prompts of a few hundred tokens (8 prompts of 256 tokens, 30
# layers: 141-155 ms against SDPA's 303-336 ms). Longer prefill chunks go to SDPA, whose tiles
# read each key once for many queries (one 2,000-token prompt: 1.21 s against the kernel's 1.30 s).
CPP_MAX_QUERY_LEN = 512
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


def new_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Both are permuted views of differently ordered storage (so use their strides, not ``view``).
    Keys are stored ``[blocks, heads, head_dim, block_size]``: a block's keys for one head and one
    feature form a contiguous row, so the torch path gets query-key scores as weighted sums of
    such rows, straight from the cache. Values are stored ``[blocks, heads, block_size, head_dim]``:
    the attention output is a weighted sum of value rows, read the same way.
    """
    keys = torch.zeros(num_blocks, num_kv_heads, head_dim, block_size, dtype=dtype, device=device)
    values = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
    return keys.permute(0, 3, 1, 2), values.permute(0, 2, 1, 3)


def _key_storage(k_cache: torch.Tensor) -> torch.Tensor:
    """``k_cache`` as its ``[blocks, heads, head_dim, block_size]`` storage."""
    storage = k_cache.permute(0, 2, 3, 1)
    if not storage.is_contiguous():
        raise ValueError("the torch attention path needs a k_cache allocated by new_kv_cache")
    return storage


def _value_storage(v_cache: torch.Tensor) -> torch.Tensor:
    """``v_cache`` as its ``[blocks, heads, block_size, head_dim]`` storage."""
    storage = v_cache.permute(0, 2, 1, 3)
    if not storage.is_contiguous():
        raise ValueError("the torch attention path needs a v_cache allocated by new_kv_cache")
    return storage


@dataclass(slots=True)
class _PrefillRow:
    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64


@dataclass(slots=True)
class _BatchedGroup:
    """Short rows of one query length, computed together by two ``embedding_bag`` calls.

    A bag per (row, query, head, block) sums the block's key rows weighted by the query's
    features, giving that block's scores; a bag per (row, query, head) sums value rows weighted
    by the softmax. Rows are grouped by query length so that no row is padded: the key bags
    scale with the number of queries, and a verification row of 1 + k slots beside plain
    decodes would otherwise make every decode pay for k + 1 queries.
    """

    token_index: torch.Tensor  # [Rb, Qb] int64: flat token of each (row, query)
    query_pos: torch.Tensor  # [Rb, Qb] int64
    key_bags: torch.Tensor  # [Rb * Qb * Hq * nblk, D] key storage rows
    value_bags: torch.Tensor  # [Rb * Qb * Hq, nblk * block_size] value storage rows
    num_blocks: int
    covers_batch: bool  # the group is the whole batch, in order (no scatter needed)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> additive mask


@dataclass(slots=True)
class AttentionPlan:
    """Host-side bookkeeping for the torch path, derived once per step and shared by all layers."""

    groups: list[_BatchedGroup] = field(default_factory=list)
    prefill_rows: list[_PrefillRow] = field(default_factory=list)
    masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (row, window) -> mask
    batched: bool = True  # whether short rows are planned too (False: the C++ kernel takes them)


def plan_attention(
    meta: AttentionMetadata, k_cache: torch.Tensor, num_q_heads: int, batched: bool = True
) -> AttentionPlan:
    """Split the batch into groups of short rows and looped long rows (torch path only).

    ``k_cache`` supplies the cache geometry, which every layer's caches must share.
    ``batched=False``: the rows longer than ``CPP_MAX_QUERY_LEN`` only (the C++ kernel attends
    the others itself).
    """
    num_cache_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    qsl = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    num_requests = len(seq_lens)
    plan = AttentionPlan(batched=batched)
    device = meta.block_tables.device
    by_len: dict[int, list[int]] = {}
    long_from = MAX_BATCHED_QUERY_LEN if batched else CPP_MAX_QUERY_LEN
    for r in range(num_requests):
        q_len = qsl[r + 1] - qsl[r]
        if q_len > long_from:
            block_ids = meta.block_tables[r, : -(-seq_lens[r] // block_size)].long()
            plan.prefill_rows.append(_PrefillRow(qsl[r], qsl[r + 1], seq_lens[r], block_ids))
        elif q_len > 0 and batched:
            by_len.setdefault(q_len, []).append(r)
    # int32 halves the index traffic; caches too large to address with it keep int64.
    index_dtype = torch.int32 if num_cache_blocks * num_kv_heads * block_size * head_dim < 2**31 else torch.int64
    kv_head = torch.arange(num_q_heads, device=device) // (num_q_heads // num_kv_heads)
    features = torch.arange(head_dim, device=device)
    slots = torch.arange(block_size, device=device)
    for q_len, rows in by_len.items():
        index = torch.tensor(rows, dtype=torch.long, device=device)
        seqs = meta.seq_lens.long()[index]
        max_blocks = -(-max(seq_lens[r] for r in rows) // block_size)
        offsets = torch.arange(q_len, device=device)
        token_index = meta.query_start_loc.long()[index][:, None] + offsets
        tables = meta.block_tables[index, :max_blocks].long()
        # Table entries past a row's context may be padding (even -1); they are masked anyway.
        needed = torch.arange(max_blocks, device=device)[None, :] < (-(-seqs // block_size))[:, None]
        block_ids = torch.where(needed, tables, torch.zeros_like(tables))
        # (block, KV head) slab of every (row, query head, block): [Rb, 1, Hq, nblk], same for all queries.
        slabs = (block_ids[:, None, :] * num_kv_heads + kv_head[:, None])[:, None]
        bag_shape = (len(rows), q_len, num_q_heads, max_blocks)
        key_bags = (slabs[..., None] * head_dim + features).expand(*bag_shape, head_dim)
        value_bags = (slabs[..., None] * block_size + slots).expand(*bag_shape, block_size)
        plan.groups.append(
            _BatchedGroup(
                token_index=token_index,
                query_pos=(seqs - q_len)[:, None] + offsets,
                key_bags=key_bags.reshape(-1, head_dim).to(index_dtype),
                value_bags=value_bags.reshape(-1, max_blocks * block_size).to(index_dtype),
                num_blocks=max_blocks,
                covers_batch=len(rows) == num_requests,
            )
        )
    return plan


def _soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` as Hugging Face's Gemma 2 computes it; 0: no cap."""
    return scores if softcap <= 0 else torch.tanh(scores / softcap) * softcap


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores``; with ``sinks`` (broadcastable to
    ``scores[..., :1]``: one logit per query head) each head's sink joins the denominator, as
    Hugging Face's gpt-oss computes it: the sink a last column, dropped after the softmax."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]


def _window_mask(query_pos: torch.Tensor, num_keys: int, sliding_window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[..., num_keys]``: key ``j`` visible to a query at ``p`` iff ``p - W < j <= p``."""
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
    if impl == "cpp" and k.dtype == k_cache.dtype:
        torch.ops.zerobubble_cpu.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return
    if use_triton(k, impl, _write_kv_kernel if HAS_TRITON else None):
        torch.ops.zerobubble.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


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
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[T, Hq, D]`` over each request's paged context -> ``[T, Hq, D]``.

    ``plan`` (from :func:`plan_attention`) lets a model reuse the torch path's bookkeeping
    across layers; the Triton path ignores it. ``softcap > 0`` caps the scores (the compiled
    CPU kernel has no cap, so ``impl="cpp"`` runs the torch path then). ``sinks``: float32
    ``[Hq]``, each query head's sink logit (gpt-oss).
    """
    window = sliding_window or 0
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if use_triton(q, impl, _paged_attention_kernel if HAS_TRITON else None):
        out: torch.Tensor = torch.ops.zerobubble.paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale, window, softcap, sinks,
        )  # fmt: skip
        return out
    if q.device.type != "cpu":
        # Off the CPU the planned path's host reads would stall the host behind the device.
        return _paged_attention_gathered(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
    if impl == "cpp" and softcap > 0:
        impl = "torch"
    if plan is None or plan.batched != (impl != "cpp"):
        plan = plan_attention(meta, k_cache, q.shape[1], batched=impl != "cpp")
    if impl == "cpp":
        return _paged_attention_cpp(q, k_cache, v_cache, meta, plan, scale, window, sinks)
    return _paged_attention_torch(q, k_cache, v_cache, plan, scale, window, softcap, sinks)


def _paged_attention_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin without host reads: static shapes from ``meta.max_seq_len`` and masks.

    Each query token gathers its request's first ``max_seq_len`` cache slots and masks the
    ones it may not see. Memory grows with tokens x ``max_seq_len``, so it serves accelerators
    without Triton and the sync-free test; the CPU uses the planned path above.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    device = q.device
    num_blocks = -(-meta.max_seq_len // block_size)
    qsl = meta.query_start_loc.to(torch.int64)
    token = torch.arange(num_tokens, device=device)
    # Tokens past the last row (padding) are attributed to the last row; their output is unused.
    row = torch.searchsorted(qsl[1:].contiguous(), token, right=True).clamp(max=qsl.shape[0] - 2)
    q_len = qsl[row + 1] - qsl[row]
    query_pos = meta.seq_lens.to(torch.int64)[row] - q_len + (token - qsl[row])
    tables = meta.block_tables[row, :num_blocks].to(torch.int64)
    keys = k_cache[tables].reshape(num_tokens, num_blocks * block_size, num_kv_heads, head_dim)
    values = v_cache[tables].reshape(num_tokens, num_blocks * block_size, num_kv_heads, head_dim)
    group = num_q_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2).float()
    values = values.repeat_interleave(group, dim=2).float()
    key_pos = torch.arange(num_blocks * block_size, device=device)
    hidden = key_pos[None, :] > query_pos[:, None]
    if window > 0:
        hidden |= key_pos[None, :] <= query_pos[:, None] - window
    scores = _soft_cap(torch.einsum("thd,tkhd->thk", q.float(), keys) * scale, softcap)
    probs = _softmax_with_sinks(scores.masked_fill(hidden[:, None, :], float("-inf")), _per_head(sinks, 1))
    return torch.einsum("thk,tkhd->thd", probs, values).to(q.dtype)


def _batched_attention(
    q: torch.Tensor,
    key_storage: torch.Tensor,
    value_storage: torch.Tensor,
    group: _BatchedGroup,
    scale: float,
    window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One group of short rows through its bags -> ``[Rb, Qb, Hq, D]``."""
    num_rows, q_len = group.token_index.shape
    num_q_heads, head_dim = q.shape[1:]
    num_keys = group.value_bags.shape[1]
    rows = q.view(num_rows, q_len, num_q_heads, head_dim) if group.covers_batch else q[group.token_index]
    # The scaled query once per block, written by one broadcasting multiply: reshaping an
    # expanded view instead goes through a generic strided copy several times slower.
    weights = rows.unsqueeze(3) * rows.new_full((group.num_blocks, 1), scale)
    scores = F.embedding_bag(
        group.key_bags,
        key_storage.view(-1, key_storage.shape[-1]),
        mode="sum",
        per_sample_weights=weights.view(-1, head_dim),
    ).view(num_rows, q_len, num_q_heads, num_keys)
    mask = group.masks.get(window)
    if mask is None:
        mask = _window_mask(group.query_pos, num_keys, window, torch.float32).unsqueeze(2)
        group.masks[window] = mask
    # Softmax in float32 whatever the model dtype, as SDPA does.
    probs = _softmax_with_sinks(_soft_cap(scores.float(), softcap) + mask, _per_head(sinks, 1)).to(q.dtype)
    return F.embedding_bag(
        group.value_bags,
        value_storage.view(-1, head_dim),
        mode="sum",
        per_sample_weights=probs.view(-1, num_keys),
    ).view(num_rows, q_len, num_q_heads, head_dim)


def _paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    key_storage, value_storage = _key_storage(k_cache), _value_storage(v_cache)
    if len(plan.groups) == 1 and plan.groups[0].covers_batch:  # all decodes of one length
        attended = _batched_attention(q, key_storage, value_storage, plan.groups[0], scale, window, softcap, sinks)
        return attended.view(q.shape)
    out = torch.empty_like(q)
    for group in plan.groups:
        attended = _batched_attention(q, key_storage, value_storage, group, scale, window, softcap, sinks)
        out[group.token_index.reshape(-1)] = attended.view(-1, *q.shape[1:])
    return _attend_long_rows(q, key_storage, value_storage, plan, scale, window, out, softcap, sinks)


def _paged_attention_cpp(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: AttentionPlan,
    scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of up to ``CPP_MAX_QUERY_LEN`` queries through the C++ kernel (zerobubble.kernels.cpu),
    longer ones through SDPA."""
    key_storage, value_storage = _key_storage(k_cache), _value_storage(v_cache)
    out: torch.Tensor = torch.ops.zerobubble_cpu.paged_attention(
        q, key_storage, value_storage, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        CPP_MAX_QUERY_LEN, scale, window, sinks,
    )  # fmt: skip
    return _attend_long_rows(q, key_storage, value_storage, plan, scale, window, out, sinks=sinks)


def _attend_long_rows(
    q: torch.Tensor,
    key_storage: torch.Tensor,
    value_storage: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    window: int,
    out: torch.Tensor,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes the attention of each of the plan's long rows (prefill chunks) into ``out``, by SDPA
    (by :func:`_eager_attention` with a soft cap or sinks, which SDPA has not)."""
    num_kv_heads, head_dim = key_storage.shape[1], key_storage.shape[2]
    for i, row in enumerate(plan.prefill_rows):
        num_queries = row.end - row.start
        # [nblk, Hkv, D, bs] and [nblk, Hkv, bs, D] -> [1, Hkv, L, D]; a copy is cheap next to a prefill.
        keys = key_storage[row.block_ids].permute(1, 0, 3, 2).reshape(1, num_kv_heads, -1, head_dim)
        values = value_storage[row.block_ids].transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)
        eager = softcap > 0 or sinks is not None
        fresh = row.seq_len == num_queries and (window == 0 or window >= row.seq_len) and not eager
        mask = None
        if not fresh:
            mask = plan.masks.get((i, window))
            if mask is None:
                query_pos = torch.arange(row.seq_len - num_queries, row.seq_len, device=q.device)
                mask = _window_mask(query_pos, row.seq_len, window, q.dtype)
                plan.masks[(i, window)] = mask
        attend = _eager_attention(softcap, sinks) if eager else F.scaled_dot_product_attention
        out[row.start : row.end] = attend(
            q[row.start : row.end].transpose(0, 1).unsqueeze(0),
            keys[:, :, : row.seq_len],
            values[:, :, : row.seq_len],
            attn_mask=mask,
            is_causal=fresh,
            scale=scale,
            enable_gqa=q.shape[1] != num_kv_heads,
        )[0].transpose(0, 1)
    return out


def _per_head(sinks: torch.Tensor | None, trailing: int) -> torch.Tensor | None:
    """``sinks [Hq]`` viewed to broadcast over a scores tensor whose head dimension is followed
    by ``trailing`` more (the keys', the queries')."""
    return None if sinks is None else sinks.view(-1, *(1,) * trailing)


def _eager_attention(softcap: float, sinks: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """SDPA's signature (as `_attend_long_rows` calls it) with soft-capped scores and sinks:
    Hugging Face's eager Gemma 2 and gpt-oss attention, scores and softmax in float32."""

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        scale: float,
        enable_gqa: bool,
    ) -> torch.Tensor:
        assert attn_mask is not None and not is_causal
        group = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = _soft_cap(torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale, softcap)
        probs = _softmax_with_sinks(scores + attn_mask.float(), _per_head(sinks, 2)).to(q.dtype)
        return torch.matmul(probs, values)

    return attend


# The Triton launches are custom ops (with fake implementations) so that a forward runs under
# FakeTensorMode, where its kernels can be counted, and torch.compile can trace it.
@torch.library.custom_op("zerobubble::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def _write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    # The kernel walks head_dim with unit stride in its inputs (the caches may be strided freely).
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
    )  # fmt: skip


@_write_kv_cache_triton.register_fake
def _(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    return None


@torch.library.custom_op("zerobubble::paged_attention", mutates_args=())
def _paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    num_requests = seq_lens.shape[0]
    if q.stride(-1) != 1:  # the kernel walks head_dim with unit stride in q and out
        q = q.contiguous()
    out = torch.empty_like(q)
    group = num_q_heads // num_kv_heads
    block_g = next_power_of_2(group)
    # Rows of a tile = its query tokens x the KV head's query heads. Decode and verification
    # rows take the smallest tile a tensor-core dot allows; prefill chunks take 64 rows. The
    # tile shapes and warps are the ones that compile without spilling registers on sm_80 and
    # sm_90 at head_dim 128 (scripts/compile_kernels.py reports registers and spills): 16 x 16
    # keys on 4 warps, 64 x 32 on 8 (on 4 warps 64 x 32 spills).
    decode = max_query_len <= MAX_BATCHED_QUERY_LEN
    block_m = max(16 if decode else 64, block_g)
    tokens_per_tile = block_m // block_g
    grid = (triton.cdiv(max_query_len, tokens_per_tile), num_requests, num_kv_heads)
    # Triton's CPU interpreter multiplies 16-bit dot operands wrongly (3.9: bfloat16 dots come
    # out as garbage), so there they are widened to float32 first: the same values.
    dot_f32 = q.dtype == torch.float32 or is_interpreted(_paged_attention_kernel)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_tables, sinks if sinks is not None else q,
        scale, window if window > 0 else _NO_WINDOW, softcap,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        k_cache.shape[1], group,
        HEAD_DIM=head_dim, BLOCK_D=max(next_power_of_2(head_dim), 16),
        BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_N=16 if decode else 32,
        DOT_F32=dot_f32, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
        # float32 operands get float32 products (tf32 would drift from the torch twin); the
        # setting means nothing to 16-bit operands, which keep the compiler's default.
        DOT_PRECISION="ieee" if dot_f32 else "tf32",
        num_warps=4 if decode else 8,
    )  # fmt: skip
    return out


@_paged_attention_triton.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return torch.empty_like(q)


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
        stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
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
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head
        k_dst += dims * stride_kc_dim
        v_dst += dims * stride_vc_dim
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr,
        scale, sliding_window, softcap,
        stride_qt, stride_qh,
        stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
        stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
        stride_ot, stride_oh,
        stride_bt,
        block_size, num_queries_per_kv,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        """One program per (tile of query tokens, request, KV head); online softmax.

        The tile's ``BLOCK_M // BLOCK_G`` query tokens times the KV head's query heads are the
        rows of one matrix, so each tile of keys and values is read once for all of them and
        both products are dots (tensor cores on a GPU). Row ``m`` is token ``m // BLOCK_G`` of
        the tile and query head ``m % BLOCK_G`` of the group.
        """
        tile = tl.program_id(0)
        r = tl.program_id(1)
        kv_head = tl.program_id(2)
        tokens_per_tile: tl.constexpr = BLOCK_M // BLOCK_G
        q_start = tl.load(query_start_loc_ptr + r)
        q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
        first_i = tile * tokens_per_tile
        if first_i < q_len:
            seq_len = tl.load(seq_lens_ptr + r)
            rows = tl.arange(0, BLOCK_M)
            i = first_i + rows // BLOCK_G  # the row's query token within the request
            group_index = rows % BLOCK_G
            row_valid = (i < q_len) & (group_index < num_queries_per_kv)
            query_pos = seq_len - q_len + i
            t = (q_start + i).to(tl.int64)
            heads = kv_head * num_queries_per_kv + group_index
            dims = tl.arange(0, BLOCK_D)
            dim_mask = dims < HEAD_DIM
            q_mask = row_valid[:, None] & dim_mask[None, :]
            q = tl.load(
                q_ptr + t[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0
            )  # [M, D]
            dot_dtype = tl.float32 if DOT_F32 else q.dtype
            q = q.to(dot_dtype)
            # The host passes a huge window for full attention, which keeps this branch-free.
            first_key = tl.maximum(query_pos - sliding_window + 1, 0)
            # Keys any row of the tile sees: from its first token's window to its last token.
            lo = tl.maximum(seq_len - q_len + first_i - sliding_window + 1, 0)
            hi = seq_len - q_len + tl.minimum(first_i + tokens_per_tile, q_len) - 1
            if HAS_SINKS:
                # The sink is a key seen first: its logit the running maximum, exp(0) = 1 the
                # running sum, and no value in the accumulator.
                m_i = tl.load(sinks_ptr + heads, mask=row_valid, other=float("-inf")).to(tl.float32)
                l_i = tl.where(row_valid, 1.0, 0.0)
            else:
                m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            for tile_start in range((lo // BLOCK_N) * BLOCK_N, hi + 1, BLOCK_N):
                keys_pos = tile_start + tl.arange(0, BLOCK_N)
                in_range = (keys_pos >= lo) & (keys_pos <= hi)
                block = tl.load(block_tables_ptr + r * stride_bt + keys_pos // block_size, mask=in_range, other=0)
                block = block.to(tl.int64)
                offset = keys_pos % block_size
                kv_mask = in_range[:, None] & dim_mask[None, :]
                k = tl.load(
                    k_cache_ptr + block[:, None] * stride_kc_block + offset[:, None] * stride_kc_slot
                    + kv_head * stride_kc_head + dims[None, :] * stride_kc_dim,
                    mask=kv_mask, other=0.0,
                ).to(dot_dtype)  # fmt: skip
                scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, N]
                if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
                    scores = softcap - 2.0 * softcap / (tl.exp(2.0 * scores / softcap) + 1.0)
                visible = (keys_pos[None, :] <= query_pos[:, None]) & (keys_pos[None, :] >= first_key[:, None])
                scores = tl.where(visible, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                # A row that has seen no key yet keeps m = -inf; its exponentials are then taken
                # against 0, which gives 0 where -inf - -inf would give NaN.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(scores - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                v = tl.load(
                    v_cache_ptr + block[:, None] * stride_vc_block + offset[:, None] * stride_vc_slot
                    + kv_head * stride_vc_head + dims[None, :] * stride_vc_dim,
                    mask=kv_mask, other=0.0,
                ).to(dot_dtype)  # fmt: skip
                # Probabilities in the values' dtype, as flash attention does (bfloat16: ~3 digits).
                p_dot = p.to(v_cache_ptr.dtype.element_ty).to(dot_dtype)
                acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
            result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            out_offsets = t[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=q_mask)
