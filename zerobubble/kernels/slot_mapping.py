"""Slot mapping: the flat KV-cache slot each token's K/V is written to.

Token ``t`` of request ``r`` at position ``p`` goes to
``block_tables[r, p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import torch

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, tl, triton, use_triton

_TOKENS_PER_ITERATION = 128


def compute_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    impl: KernelImpl = None,
) -> torch.Tensor:
    """Slots ``[T]`` int64 for ``positions`` ``[T]`` of the requests laid out by ``query_start_loc`` ``[R+1]``."""
    num_tokens = positions.shape[0]
    num_requests = block_tables.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return torch.empty(num_tokens, dtype=torch.int64, device=positions.device)
    if use_triton(positions, impl, _slot_mapping_kernel if HAS_TRITON else None):
        result: torch.Tensor = torch.ops.zerobubble.slot_mapping(query_start_loc, positions, block_tables, block_size)
        return result
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    # output_size keeps this free of a device-to-host sync.
    request = torch.repeat_interleave(
        torch.arange(num_requests, device=positions.device), q_lens, output_size=num_tokens
    )
    positions = positions.long()
    blocks = block_tables[request, positions // block_size].long()
    return blocks * block_size + positions % block_size


# A custom op (with a fake implementation): the step runs under FakeTensorMode and torch.compile.
@torch.library.custom_op("zerobubble::slot_mapping", mutates_args=())
def _slot_mapping_triton(
    query_start_loc: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    slots = torch.empty(positions.shape[0], dtype=torch.int64, device=positions.device)
    _slot_mapping_kernel[(block_tables.shape[0],)](
        query_start_loc, positions, block_tables, slots, block_tables.stride(0), block_size,
        BLOCK=_TOKENS_PER_ITERATION,
    )  # fmt: skip
    return slots


@_slot_mapping_triton.register_fake
def _(
    query_start_loc: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    return positions.new_empty(positions.shape[0], dtype=torch.int64)


if HAS_TRITON:

    @triton.jit
    def _slot_mapping_kernel(query_start_loc_ptr, positions_ptr, block_tables_ptr, slots_ptr,
                             stride_bt, block_size, BLOCK: tl.constexpr):  # fmt: skip
        """One program per request, walking its tokens BLOCK at a time."""
        r = tl.program_id(0)
        start = tl.load(query_start_loc_ptr + r)
        end = tl.load(query_start_loc_ptr + r + 1)
        for first in range(start, end, BLOCK):
            tokens = first + tl.arange(0, BLOCK)
            mask = tokens < end
            pos = tl.load(positions_ptr + tokens, mask=mask, other=0).to(tl.int64)
            block = tl.load(block_tables_ptr + r * stride_bt + pos // block_size, mask=mask, other=0)
            tl.store(slots_ptr + tokens, block.to(tl.int64) * block_size + pos % block_size, mask=mask)
