"""Sliding-window block release: which leading KV blocks of a running request no query can
attend any more.

A model whose every attention layer looks back at most ``window`` tokens (Mistral's
``sliding_window``; the worker reports the smallest window in `WorkerInfo.sliding_window`, or 0
when any layer, draft model or EAGLE head attends the whole sequence) has a query at position
``p`` attend keys ``p - window + 1 .. p``. Before the scheduler plans a running request's next
chunk or decode, the blocks wholly before ``first - window + 1`` go back to the pool, where
``first`` is the smallest position that step's first query can have:

- ``num_computed`` is optimistic: it counts every draft slot in flight as accepted. Rejected
  drafts move the real position back by at most the draft slots still in flight, so
  ``first = num_computed - num_inflight_drafts`` is certain (a prefill chunk has no drafts).
- Plans run in order, so a step already in flight that still reads a freed block finishes
  before any later owner of the block writes it.

The worker keeps the freed ids in the request's block table, so table entry ``i`` stays the
block of positions ``[i * block_size, (i + 1) * block_size)``. Another request may write the
block later; every attention path gives keys outside the window no weight (the Triton and C++
kernels start at the window's first key; the torch paths add ``-inf`` to their scores before the
softmax, so their finite values are multiplied by exactly 0), so what the block holds then does
not matter. A request whose sampling reads its whole context from the token pages (penalties, a
grammar replayed after preemption) keeps its blocks.

With prefix caching, only blocks already offered to the prefix cache (their step's result is
back) are freed; they stay there as cached free blocks: the request wrote them wholly and never
writes them again, so a prefix hit on them reads intact K/V until the pool evicts them. Waiting
for the result holds the blocks of the steps in flight a little longer; freeing earlier would
lose a long prompt's leading blocks for the prefix cache. Without prefix caching a block is
freed as soon as no query can attend it.
"""

from __future__ import annotations


def num_blocks_behind(first_query_pos: int, window: int, block_size: int) -> int:
    """Leading blocks wholly before the first key a query at ``first_query_pos`` may attend
    (0 without a window)."""
    if window <= 0:
        return 0
    return max(0, first_query_pos - window + 1) // block_size
