"""Sequence-length correction: advance the worker's device state after verification.

The scheduler plans optimistically (every draft accepted); the worker's true lengths move by the
tokens actually accepted, on the device, so the next step's positions and slot mappings are right
without the host waiting for this step's results.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, tl, triton, use_triton


def _update_torch(
    req_slots: Tensor,
    is_decode: Tensor,
    num_scheduled: Tensor,
    num_accepted: Tensor,
    do_sample: Tensor,
    sampled_last: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    num_drafts: Tensor,
) -> None:
    slots = req_slots.to(torch.int64)
    growth = torch.where(is_decode, 1 + num_accepted.to(torch.int64), num_scheduled.to(torch.int64))
    # Slots in one step are distinct, so gather-modify-scatter is race free.
    seq_len[slots] = (seq_len[slots].to(torch.int64) + growth).to(seq_len.dtype)
    last_token[slots] = torch.where(do_sample, sampled_last.to(last_token.dtype), last_token[slots])
    # `index_fill_` takes the number as a kernel argument; `num_drafts[slots] = 0` would copy
    # a host scalar to the device first, a host sync on CUDA.
    num_drafts.index_fill_(0, slots, 0)


if HAS_TRITON:

    @triton.jit
    def _update_kernel(
        req_slots_ptr,
        is_decode_ptr,
        num_scheduled_ptr,
        num_accepted_ptr,
        do_sample_ptr,
        sampled_last_ptr,
        seq_len_ptr,
        last_token_ptr,
        num_drafts_ptr,
        num_reqs,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < num_reqs
        slots = tl.load(req_slots_ptr + rows, mask=mask, other=0).to(tl.int64)
        decode = tl.load(is_decode_ptr + rows, mask=mask, other=0) != 0
        scheduled = tl.load(num_scheduled_ptr + rows, mask=mask, other=0)
        accepted = tl.load(num_accepted_ptr + rows, mask=mask, other=0)
        sample = tl.load(do_sample_ptr + rows, mask=mask, other=0) != 0
        sampled = tl.load(sampled_last_ptr + rows, mask=mask, other=0)
        length = tl.load(seq_len_ptr + slots, mask=mask, other=0)
        growth = tl.where(decode, 1 + accepted, scheduled)
        tl.store(seq_len_ptr + slots, (length + growth).to(seq_len_ptr.dtype.element_ty), mask=mask)
        tl.store(last_token_ptr + slots, sampled.to(last_token_ptr.dtype.element_ty), mask=mask & sample)
        tl.store(num_drafts_ptr + slots, tl.zeros_like(slots).to(num_drafts_ptr.dtype.element_ty), mask=mask)


# A custom op (with a fake implementation): the step runs under FakeTensorMode and torch.compile.
@torch.library.custom_op("zerobubble::update_state", mutates_args=("seq_len", "last_token", "num_drafts"))
def _update_triton(
    req_slots: Tensor,
    is_decode: Tensor,
    num_scheduled: Tensor,
    num_accepted: Tensor,
    do_sample: Tensor,
    sampled_last: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    num_drafts: Tensor,
) -> None:
    num_reqs = req_slots.shape[0]
    if num_reqs == 0:
        return
    block = 128
    _update_kernel[(triton.cdiv(num_reqs, block),)](
        req_slots,
        is_decode,
        num_scheduled,
        num_accepted,
        do_sample,
        sampled_last,
        seq_len,
        last_token,
        num_drafts,
        num_reqs,
        BLOCK=block,
    )


@_update_triton.register_fake
def _(
    req_slots: Tensor,
    is_decode: Tensor,
    num_scheduled: Tensor,
    num_accepted: Tensor,
    do_sample: Tensor,
    sampled_last: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    num_drafts: Tensor,
) -> None:
    return None


def update_state(
    req_slots: Tensor,
    is_decode: Tensor,
    num_scheduled: Tensor,
    num_accepted: Tensor,
    do_sample: Tensor,
    sampled_last: Tensor,
    seq_len: Tensor,
    last_token: Tensor,
    num_drafts: Tensor,
    impl: KernelImpl = None,
) -> None:
    """Advance the per-slot state in place for the ``R`` rows of a step (distinct slots).

    Row ``r`` (slot ``s = req_slots[r]``): a decode row adds ``1 + num_accepted[r]`` to
    ``seq_len[s]``, a prefill row adds ``num_scheduled[r]``; rows with ``do_sample[r]`` set
    ``last_token[s] = sampled_last[r]``; every row sets ``num_drafts[s] = 0`` (the proposer
    refills it afterwards). Other slots are untouched.
    """
    if use_triton(seq_len, impl, _update_kernel if HAS_TRITON else None):
        _update_triton(
            req_slots, is_decode, num_scheduled, num_accepted, do_sample, sampled_last, seq_len, last_token, num_drafts
        )
    else:
        _update_torch(
            req_slots, is_decode, num_scheduled, num_accepted, do_sample, sampled_last, seq_len, last_token, num_drafts
        )
