"""Input assembly for one step from the worker's device state.

Decode inputs come from the worker's own state (the last sampled token and the drafts proposed
after it), never from the scheduler, and positions start at the worker's true sequence length, so
the scheduler's optimistic placeholders never reach the model. The same pass writes the token
history pages that the n-gram proposer reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, tl, triton, use_triton
from zerobubble.kernels.slot_mapping import compute_slot_mapping


def _assemble_torch(
    req_slots: Tensor,
    query_start_loc: Tensor,
    is_decode: Tensor,
    prefill_ids: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    drafts: Tensor,
    num_drafts: Tensor,
    block_table: Tensor,
    history: Tensor,
    block_size: int,
    impl: KernelImpl,
) -> tuple[Tensor, Tensor, Tensor]:
    device = prefill_ids.device
    num_tokens = prefill_ids.shape[0]
    num_reqs = req_slots.shape[0]
    max_drafts = drafts.shape[1]
    qsl = query_start_loc.to(torch.int64)
    row = torch.repeat_interleave(torch.arange(num_reqs, device=device), qsl[1:] - qsl[:-1], output_size=num_tokens)
    offset = torch.arange(num_tokens, device=device) - qsl[row]
    slot = req_slots.to(torch.int64)[row]
    positions = seq_len.to(torch.int64)[slot] + offset

    last = last_token.to(torch.int64)[slot]
    draft_idx = offset - 1
    # Only drafts the proposer really produced are used; any other slot repeats the last token,
    # so stale or -1 ids in `drafts` can never become model inputs.
    use_draft = (draft_idx >= 0) & (draft_idx < num_drafts.to(torch.int64)[slot])
    use_draft &= draft_idx < max_drafts
    decode_ids = last
    if max_drafts > 0:
        draft_ids = drafts[slot, draft_idx.clamp(0, max_drafts - 1)].to(torch.int64)
        decode_ids = torch.where(use_draft, draft_ids, last)
    input_ids = torch.where(is_decode[row], decode_ids, prefill_ids.to(torch.int64))

    slot_mapping = compute_slot_mapping(
        query_start_loc,
        positions,
        block_table.index_select(0, req_slots.to(torch.int64)),
        block_size,
        impl=impl,
    )
    history.view(-1).index_copy_(0, slot_mapping, input_ids.to(history.dtype))
    return input_ids, positions, slot_mapping


if HAS_TRITON:

    @triton.jit
    def _assemble_kernel(
        req_slots_ptr,
        qsl_ptr,
        is_decode_ptr,
        prefill_ids_ptr,
        seq_len_ptr,
        last_token_ptr,
        drafts_ptr,
        num_drafts_ptr,
        block_table_ptr,
        history_ptr,
        input_ids_ptr,
        positions_ptr,
        slot_mapping_ptr,
        max_drafts,
        max_blocks,
        BLOCK_SIZE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per request row; it walks its own token range in chunks.
        row = tl.program_id(0)
        start = tl.load(qsl_ptr + row)
        end = tl.load(qsl_ptr + row + 1)
        slot = tl.load(req_slots_ptr + row).to(tl.int64)
        decode = tl.load(is_decode_ptr + row) != 0
        base = tl.load(seq_len_ptr + slot).to(tl.int64)
        last = tl.load(last_token_ptr + slot).to(tl.int64)
        # Scalar flags are folded into bounds instead of and-ed with vector masks (keeps the
        # CPU interpreter happy and reads no draft at all for prefill rows).
        num_valid = tl.where(decode, tl.minimum(tl.load(num_drafts_ptr + slot), max_drafts), 0)
        prefill_end = tl.where(decode, start, end)
        for chunk in range(start, end, BLOCK):
            tok = chunk + tl.arange(0, BLOCK)
            mask = tok < end
            offset = tok - start
            pos = base + offset
            draft_idx = offset - 1
            use_draft = mask & (draft_idx >= 0) & (draft_idx < num_valid)
            draft = tl.load(drafts_ptr + slot * max_drafts + draft_idx, mask=use_draft, other=0)
            prefill = tl.load(prefill_ids_ptr + tok, mask=tok < prefill_end, other=0)
            ids = tl.where(decode, tl.where(use_draft, draft.to(tl.int64), last), prefill.to(tl.int64))
            block = tl.load(block_table_ptr + slot * max_blocks + pos // BLOCK_SIZE, mask=mask, other=0)
            kv_slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            tl.store(input_ids_ptr + tok, ids, mask=mask)
            tl.store(positions_ptr + tok, pos, mask=mask)
            tl.store(slot_mapping_ptr + tok, kv_slot, mask=mask)
            tl.store(history_ptr + kv_slot, ids.to(history_ptr.dtype.element_ty), mask=mask)


# A custom op (with a fake implementation): the step runs under FakeTensorMode and torch.compile.
@torch.library.custom_op("zerobubble::assemble_inputs", mutates_args=("history",))
def _assemble_triton(
    req_slots: Tensor,
    query_start_loc: Tensor,
    is_decode: Tensor,
    prefill_ids: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    drafts: Tensor,
    num_drafts: Tensor,
    block_table: Tensor,
    history: Tensor,
    block_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    num_tokens = prefill_ids.shape[0]
    device = prefill_ids.device
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
    positions = torch.empty(num_tokens, dtype=torch.int64, device=device)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=device)
    num_reqs = req_slots.shape[0]
    if num_reqs == 0:
        return input_ids, positions, slot_mapping
    _assemble_kernel[(num_reqs,)](
        req_slots,
        query_start_loc,
        is_decode,
        prefill_ids,
        seq_len,
        last_token,
        drafts.contiguous(),
        num_drafts,
        block_table.contiguous(),
        history,
        input_ids,
        positions,
        slot_mapping,
        drafts.shape[1],
        block_table.shape[1],
        BLOCK_SIZE=block_size,
        BLOCK=128,
    )
    return input_ids, positions, slot_mapping


@_assemble_triton.register_fake
def _(
    req_slots: Tensor,
    query_start_loc: Tensor,
    is_decode: Tensor,
    prefill_ids: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    drafts: Tensor,
    num_drafts: Tensor,
    block_table: Tensor,
    history: Tensor,
    block_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    num_tokens = prefill_ids.shape[0]
    ids, positions, slots = (prefill_ids.new_empty(num_tokens, dtype=torch.int64) for _ in range(3))
    return ids, positions, slots


def assemble_inputs(
    req_slots: Tensor,
    query_start_loc: Tensor,
    is_decode: Tensor,
    prefill_ids: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    drafts: Tensor,
    num_drafts: Tensor,
    block_table: Tensor,
    history: Tensor,
    block_size: int,
    impl: KernelImpl = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Build ``(input_ids [T] int64, positions [T] int64, slot_mapping [T] int64)`` for a step.

    Row ``r`` uses state slot ``s = req_slots[r]`` and owns flat tokens
    ``[query_start_loc[r], query_start_loc[r+1])``; token ``j`` of the row sits at position
    ``seq_len[s] + j``. Prefill rows take their ids from ``prefill_ids [T]``; a decode row of
    ``1 + k`` tokens is ``[last_token[s], drafts[s, 0..k-1]]`` where every draft slot
    ``j >= num_drafts[s]`` repeats ``last_token[s]`` (drafts beyond the valid count are never
    read). ``slot_mapping = block_table[s, pos // block_size] * block_size + pos % block_size``.

    Side effect: ``history.view(-1)[slot_mapping] = input_ids`` (``history`` is
    ``[num_blocks, block_size]`` int32 and must be contiguous), so token pages follow KV blocks.
    """
    if use_triton(prefill_ids, impl, _assemble_kernel if HAS_TRITON else None):
        return _assemble_triton(
            req_slots,
            query_start_loc,
            is_decode,
            prefill_ids,
            seq_len,
            last_token,
            drafts,
            num_drafts,
            block_table,
            history,
            block_size,
        )
    return _assemble_torch(
        req_slots,
        query_start_loc,
        is_decode,
        prefill_ids,
        seq_len,
        last_token,
        drafts,
        num_drafts,
        block_table,
        history,
        block_size,
        impl,
    )
