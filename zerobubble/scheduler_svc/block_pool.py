"""KV block accounting: ids, reference counts and the prefix cache.

A block is *used* while its reference count is positive. Freed blocks that carry a prefix-cache
hash stay cached (their K/V is still valid on the worker) and are reused by a later prefix hit;
they are evicted lazily, least recently freed first, only when a fresh block is needed and no
never-cached block is left.

The hash of a block chains the hash of the block before it with the block's token ids, so a hit
on block i implies the whole prefix up to block i matches. blake2b keeps it identical across
processes (Python's `hash` is salted per process).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BlockHash = bytes


def block_hash(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Stable hash of one full block given the hash of the block before it (None for the first)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


def extend_hash_chain(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int, first: int = 0
) -> None:
    """Grow `hashes` (the chain of a sequence's first full blocks) to `num_blocks` entries.

    `token_ids` holds the sequence from position `first` on (a block boundary at or before the
    first block still to hash), so a long sequence need not be copied to hash its newest block.
    """
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else None
        start = i * block_size - first
        hashes.append(block_hash(parent, token_ids[start : start + block_size]))


@dataclass(slots=True)
class PrefixCacheCounters:
    """Prefix-cache effectiveness, in tokens (Prometheus `prefix_cache_queries/hits_total`)."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0


class BlockPool:
    """Block ids `0..num_blocks-1` with reference counts and a lazily evicted prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """`block_size` is in tokens; it defines what a full block is for hashing."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.counters = PrefixCacheCounters()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # Free blocks that still hold cached K/V, least recently freed first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out (cached free blocks included: they are evictable)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        """Blocks with a positive reference count."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks currently registered in the prefix cache (used or free)."""
        return len(self._hash_of)

    def usage_ratio(self) -> float:
        """Used blocks ÷ all blocks."""
        return self.num_used / self.num_blocks

    def hash_of(self, block_id: int) -> BlockHash | None:
        """The prefix-cache hash a block is registered under, if any."""
        return self._hash_of.get(block_id)

    def ref_count(self, block_id: int) -> int:
        """Reference count of one block."""
        return self._refs[block_id]

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks with refcount 1, or None (and nothing taken) if too few."""
        if num_blocks > self.num_free:
            return None
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block_id = self._free_uncached.popleft()
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(block_id)]
            self._refs[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free (cached or not)."""
        for block_id in block_ids:
            refs = self._refs[block_id]
            if refs <= 0:
                raise ValueError(f"block {block_id} freed more often than referenced")
            self._refs[block_id] = refs - 1
            if refs == 1:
                if block_id in self._hash_of:
                    self._free_cached[block_id] = None
                else:
                    self._free_uncached.append(block_id)

    def register(self, block_id: int, hash_: BlockHash) -> bool:
        """Offer a used block full of confirmed tokens to the prefix cache.

        Returns False (and changes nothing) when the block is already cached or another block
        already caches the same content: the first copy wins and this one stays private.
        """
        if self._refs[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use")
        if block_id in self._hash_of or hash_ in self._block_of:
            return False
        self._hash_of[block_id] = hash_
        self._block_of[hash_] = block_id
        return True

    def lookup(self, token_ids: Sequence[int], max_num_blocks: int | None = None) -> list[int]:
        """Longest cached chain of full blocks prefixing `token_ids`, at most `max_num_blocks`.

        Each returned block gets one more reference (the caller frees them like its own).
        Counters are not touched here
        (see `record_query`): a lookup may be undone when the request cannot be admitted yet.
        """
        block_ids = self._match(token_ids, max_num_blocks)
        for block_id in block_ids:
            if self._refs[block_id] == 0:
                del self._free_cached[block_id]
            self._refs[block_id] += 1
        return block_ids

    def num_cached_prefix_blocks(self, token_ids: Sequence[int]) -> int:
        """Length of the cached chain `lookup` would return, without taking references."""
        return len(self._match(token_ids, None))

    def _match(self, token_ids: Sequence[int], max_num_blocks: int | None) -> list[int]:
        limit = len(token_ids) // self.block_size
        if max_num_blocks is not None:
            limit = min(limit, max_num_blocks)
        block_ids: list[int] = []
        parent: BlockHash | None = None
        bs = self.block_size
        for i in range(limit):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self._block_of.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup."""
        self.counters.num_query_tokens += num_query_tokens
        self.counters.num_hit_tokens += num_hit_tokens

    def check_invariants(self) -> None:
        """Assert internal consistency (used by tests; O(num_blocks))."""
        assert all(r >= 0 for r in self._refs)
        free_ids = list(self._free_uncached) + list(self._free_cached)
        assert len(free_ids) == len(set(free_ids)), "a block is free twice"
        assert all(self._refs[b] == 0 for b in free_ids), "a free block is referenced"
        assert len(free_ids) + sum(1 for r in self._refs if r > 0) == self.num_blocks
        assert all(b in self._hash_of for b in self._free_cached)
        assert all(b not in self._hash_of for b in self._free_uncached)
        assert all(self._block_of[h] == b for b, h in self._hash_of.items())
        assert len(self._block_of) == len(self._hash_of)
