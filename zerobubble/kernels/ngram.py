"""N-gram (prompt lookup) draft proposal over the paged token history.

A request's sequence is ``history[0:seq_len[s]] ++ [last_token[s]]`` read through its block
table, so memory follows the tokens actually held (no dense ``max_num_seqs x max_model_len``
buffer). The suffix of length ``n`` (``max_n`` down to ``min_n``) is looked up earlier in the same
sequence; the longest ``n`` with a match wins, and among its matches the most recent one, whose
continuation becomes the drafts.

Both implementations compute, for every candidate end position ``e`` of an earlier window, the
length of the common suffix of ``seq[..e]`` and the whole sequence (capped at ``max_n``), then take
the lexicographic maximum of ``(suffix length, e)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, next_power_of_2, tl, triton, use_triton


def _ngram_torch(
    req_slots: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    block_table: Tensor,
    history: Tensor,
    block_size: int,
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[Tensor, Tensor]:
    device = seq_len.device
    num_reqs = req_slots.shape[0]
    slots = req_slots.to(torch.int64)
    held = seq_len.to(torch.int64)[slots]
    lengths = held + 1
    if device.type == "cpu":
        # The ragged batch is flattened: memory is proportional to the tokens held. Sizing it
        # reads the lengths, which on the CPU are host memory already.
        starts = torch.cumsum(lengths, 0) - lengths
        num_flat = int(lengths.sum())
        row = torch.repeat_interleave(torch.arange(num_reqs, device=device), lengths, output_size=num_flat)
    else:
        # Off the CPU a host read would stall the host behind the device: a static grid of
        # [rows, longest possible sequence], the entries past each row's length masked below.
        max_len = block_table.shape[1] * block_size + 1
        starts = torch.arange(num_reqs, device=device) * max_len
        num_flat = num_reqs * max_len
        row = torch.arange(num_reqs, device=device).repeat_interleave(max_len)
    flat = torch.arange(num_flat, device=device)
    idx = flat - starts[row]

    in_history = idx < held[row]
    block_idx = (idx // block_size).clamp(max=block_table.shape[1] - 1)
    block = torch.where(in_history, block_table[slots[row], block_idx].to(torch.int64), 0)
    from_history = history.view(-1)[block * block_size + idx % block_size].to(torch.int64)
    seq = torch.where(in_history, from_history, last_token.to(torch.int64)[slots[row]])

    last_flat = (starts + lengths - 1)[row]
    # A window ending at e may match only if it ends before the sequence's last token.
    running = idx <= lengths[row] - 2
    suffix_len = torch.zeros(num_flat, dtype=torch.int64, device=device)
    for j in range(max_n):
        same = seq[(flat - j).clamp(min=0)] == seq[(last_flat - j).clamp(min=0)]
        running = running & (idx >= j) & same
        suffix_len += running

    best_n = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    best_n.scatter_reduce_(0, row, suffix_len, reduce="amax")
    ends = torch.where((suffix_len >= best_n[row]) & (idx < lengths[row]), idx, -1)
    best_end = torch.full((num_reqs,), -1, dtype=torch.int64, device=device)
    best_end.scatter_reduce_(0, row, ends, reduce="amax")

    first = best_end + 1
    num_drafts = torch.where(best_n >= min_n, torch.clamp(lengths - first, max=k), 0)
    cols = torch.arange(k, device=device)
    take = cols[None, :] < num_drafts[:, None]
    src = ((starts + first)[:, None] + cols[None, :]).clamp(max=num_flat - 1)
    drafts = torch.where(take, seq[src], -1)
    return drafts.to(torch.int32), num_drafts.to(torch.int32)


if HAS_TRITON:

    @triton.jit
    def _seq_token(i, mask, held, last, table_row_ptr, history_ptr, BLOCK_SIZE: tl.constexpr):
        """Token ``i`` of a request's sequence (history, then the last sampled token)."""
        in_history = mask & (i < held)
        block = tl.load(table_row_ptr + i // BLOCK_SIZE, mask=in_history, other=0).to(tl.int64)
        token = tl.load(history_ptr + block * BLOCK_SIZE + i % BLOCK_SIZE, mask=in_history, other=0)
        return tl.where(in_history, token.to(tl.int64), last)

    @triton.jit
    def _ngram_kernel(
        req_slots_ptr,
        seq_len_ptr,
        last_token_ptr,
        block_table_ptr,
        history_ptr,
        drafts_ptr,
        num_drafts_ptr,
        max_blocks,
        min_n,
        k,
        BLOCK_SIZE: tl.constexpr,
        MAX_N: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0)
        slot = tl.load(req_slots_ptr + row).to(tl.int64)
        held = tl.load(seq_len_ptr + slot).to(tl.int64)
        last = tl.load(last_token_ptr + slot).to(tl.int64)
        table_row_ptr = block_table_ptr + slot * max_blocks
        length = held + 1
        # Packed (suffix length << 32 | end): one max picks the longest n, then the latest end.
        best = tl.full((), -1, tl.int64)
        for chunk in range(0, length - 1, BLOCK):
            end = chunk + tl.arange(0, BLOCK)
            candidate = end < length - 1
            running = candidate
            suffix_len = tl.zeros((BLOCK,), tl.int64)
            for j in tl.static_range(MAX_N):
                running = running & (end >= j)
                mine = _seq_token(end - j, running, held, last, table_row_ptr, history_ptr, BLOCK_SIZE)
                theirs = _seq_token(
                    length - 1 - j, length - 1 - j >= 0, held, last, table_row_ptr, history_ptr, BLOCK_SIZE
                )
                running = running & (mine == theirs)
                suffix_len += running.to(tl.int64)
            key = tl.where(candidate, (suffix_len << 32) | end, -1)
            best = tl.maximum(best, tl.max(key, axis=0))
        best_n = best >> 32
        first = (best & 0xFFFFFFFF) + 1
        num = tl.where(best_n >= min_n, tl.minimum(length - first, k), 0)
        cols = tl.arange(0, BLOCK_K)
        take = cols < num
        tokens = _seq_token(first + cols, take, held, last, table_row_ptr, history_ptr, BLOCK_SIZE)
        tl.store(drafts_ptr + row * k + cols, tl.where(take, tokens, -1).to(tl.int32), mask=cols < k)
        tl.store(num_drafts_ptr + row, num.to(tl.int32))


# A custom op (with a fake implementation): the step runs under FakeTensorMode and torch.compile.
@torch.library.custom_op("zerobubble::ngram_propose", mutates_args=())
def _ngram_triton(
    req_slots: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    block_table: Tensor,
    history: Tensor,
    block_size: int,
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[Tensor, Tensor]:
    num_reqs = req_slots.shape[0]
    drafts = torch.empty((num_reqs, k), dtype=torch.int32, device=seq_len.device)
    num_drafts = torch.empty(num_reqs, dtype=torch.int32, device=seq_len.device)
    if num_reqs == 0:
        return drafts, num_drafts
    _ngram_kernel[(num_reqs,)](
        req_slots,
        seq_len,
        last_token,
        block_table.contiguous(),
        history,
        drafts,
        num_drafts,
        block_table.shape[1],
        min_n,
        k,
        BLOCK_SIZE=block_size,
        MAX_N=max_n,
        BLOCK=256,
        BLOCK_K=next_power_of_2(k),
    )
    return drafts, num_drafts


@_ngram_triton.register_fake
def _(
    req_slots: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    block_table: Tensor,
    history: Tensor,
    block_size: int,
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[Tensor, Tensor]:
    num_reqs = req_slots.shape[0]
    return seq_len.new_empty((num_reqs, k), dtype=torch.int32), seq_len.new_empty(num_reqs, dtype=torch.int32)


def ngram_propose(
    req_slots: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    block_table: Tensor,
    history: Tensor,
    block_size: int,
    min_n: int,
    max_n: int,
    k: int,
    impl: KernelImpl = None,
) -> tuple[Tensor, Tensor]:
    """Propose up to ``k`` drafts per row by prompt lookup; returns
    ``(drafts [R, k] int32, num_drafts [R] int32)``.

    Row ``r`` reads slot ``s = req_slots[r]``: the sequence ``x`` of length
    ``L = seq_len[s] + 1`` is ``history`` at positions ``0..seq_len[s]-1`` through
    ``block_table[s]``, then ``last_token[s]``. For ``n`` from ``max_n`` down to ``min_n``, if
    ``x[L-n:]`` occurs at some start ``i < L-n``, the largest such ``i`` wins and the drafts are
    ``x[i+n : min(i+n+k, L)]``; the first ``n`` with a match wins; no match gives 0 drafts.
    Entries past ``num_drafts`` are -1. ``impl="cpp"``: the compiled CPU kernel (one scan per row,
    `zerobubble/kernels/csrc/ngram.cpp`); otherwise Triton on CUDA, the torch twin elsewhere.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 1:
        raise ValueError(f"need k >= 1, got {k}")
    if impl == "cpp":
        return torch.ops.zerobubble_cpu.ngram_propose(
            req_slots, seq_len, last_token, block_table.contiguous(), history, block_size, min_n, max_n, k
        )
    if use_triton(seq_len, impl, _ngram_kernel if HAS_TRITON else None):
        return _ngram_triton(req_slots, seq_len, last_token, block_table, history, block_size, min_n, max_n, k)
    return _ngram_torch(req_slots, seq_len, last_token, block_table, history, block_size, min_n, max_n, k)
