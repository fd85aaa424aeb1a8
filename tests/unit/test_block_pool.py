"""KV block pool: allocation, reference counts, prefix cache, lazy LRU eviction."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zerobubble.scheduler_svc.block_pool import BlockPool, block_hash, extend_hash_chain


def _chain(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    extend_hash_chain(hashes, token_ids, block_size, len(token_ids) // block_size)
    return hashes


def _fill(pool: BlockPool, token_ids: list[int]) -> list[int]:
    """Allocate and register blocks for `token_ids` like a request whose blocks got confirmed."""
    block_ids = pool.allocate(len(token_ids) // pool.block_size)
    assert block_ids is not None
    for block_id, h in zip(block_ids, _chain(token_ids, pool.block_size), strict=True):
        pool.register(block_id, h)
    return block_ids


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4, 2)
    first = pool.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    assert pool.allocate(1) is not None
    assert pool.num_free == 0 and pool.usage_ratio() == 1.0
    pool.free(first)
    assert pool.num_free == 3 and pool.usage_ratio() == 0.25
    pool.check_invariants()


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2, 2)
    block_ids = pool.allocate(1)
    assert block_ids is not None
    pool.free(block_ids)
    with pytest.raises(ValueError):
        pool.free(block_ids)


def test_lookup_finds_longest_chain_and_takes_references() -> None:
    pool = BlockPool(8, 2)
    owner = _fill(pool, [1, 2, 3, 4, 5, 6])
    hit = pool.lookup([1, 2, 3, 4, 9, 9, 7])
    assert hit == owner[:2]
    assert [pool.ref_count(b) for b in owner] == [2, 2, 1]
    # A different first block breaks the chain even if later blocks match.
    assert pool.lookup([0, 2, 3, 4]) == []
    assert pool.lookup([1, 2, 3, 4, 5, 6], max_num_blocks=1) == owner[:1]
    pool.check_invariants()


def test_freed_cached_blocks_stay_cached_until_a_fresh_block_is_needed() -> None:
    pool = BlockPool(4, 2)
    old = _fill(pool, [1, 2, 3, 4])
    pool.free(old)
    assert pool.num_free == 4 and pool.num_cached == 2
    # Never-cached blocks are handed out first.
    fresh = pool.allocate(2)
    assert fresh is not None and not set(fresh) & set(old)
    assert pool.lookup([1, 2, 3, 4]) == old
    pool.free(old)
    pool.free(fresh)
    # Now every block is needed: the cached ones are evicted, least recently freed first.
    everything = pool.allocate(4)
    assert everything is not None and pool.num_cached == 0
    assert pool.lookup([1, 2, 3, 4]) == []
    pool.check_invariants()


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(2, 1)
    a = _fill(pool, [1])
    b = _fill(pool, [2])
    pool.free(b)
    pool.free(a)
    taken = pool.allocate(1)
    assert taken == b
    assert pool.lookup([1]) == a and pool.lookup([2]) == []


def test_register_keeps_the_first_copy() -> None:
    pool = BlockPool(4, 2)
    first = _fill(pool, [1, 2])
    second = pool.allocate(1)
    assert second is not None
    assert not pool.register(second[0], _chain([1, 2], 2)[0])
    assert pool.lookup([1, 2]) == first
    pool.free(second)
    assert pool.num_cached == 1


@settings(max_examples=200, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, 50), max_size=60),
    block_size=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 20), max_size=6),
)
def test_a_chain_grown_block_by_block_from_slices_is_the_whole_chain(
    token_ids: list[int], block_size: int, cuts: list[int]
) -> None:
    """As the scheduler grows a request's chain: each time only the tokens from the first
    block still to hash on, never the whole sequence."""
    num_blocks = len(token_ids) // block_size
    hashes: list[bytes] = []
    for target in sorted(min(c, num_blocks) for c in cuts) + [num_blocks]:
        first = len(hashes) * block_size
        extend_hash_chain(hashes, token_ids[first : target * block_size], block_size, max(target, len(hashes)), first)
    assert hashes == _chain(token_ids, block_size)


def test_prefix_counters_count_tokens() -> None:
    pool = BlockPool(4, 2)
    pool.record_query(7, 4)
    pool.record_query(3, 0)
    assert (pool.counters.num_query_tokens, pool.counters.num_hit_tokens) == (10, 4)


def test_block_hash_is_the_same_in_every_process() -> None:
    code = (
        "from zerobubble.scheduler_svc.block_pool import block_hash;"
        "print(block_hash(block_hash(None, [1, 2, 3]), [4, 5, 6]).hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == block_hash(block_hash(None, [1, 2, 3]), [4, 5, 6]).hex()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/register/lookup/free sequences against a reference-count model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, 2)
        self.holders: list[list[int]] = []  # each holder owns one reference per listed block

    @initialize()
    def start(self) -> None:
        self.pool.check_invariants()

    @rule(num_blocks=st.integers(0, 6))
    def allocate(self, num_blocks: int) -> None:
        referenced = {b for h in self.holders for b in h}
        num_free = self.pool.num_free
        got = self.pool.allocate(num_blocks)
        if num_blocks > num_free:
            assert got is None and self.pool.num_free == num_free
            return
        assert got is not None and len(got) == num_blocks
        assert not set(got) & referenced, "a referenced block was handed out again"
        self.holders.append(got)

    @rule(token_ids=st.lists(st.integers(0, 2), min_size=2, max_size=8))
    def fill_and_register(self, token_ids: list[int]) -> None:
        num_blocks = len(token_ids) // 2
        if num_blocks > self.pool.num_free:
            return
        self.holders.append(_fill(self.pool, token_ids[: num_blocks * 2]))

    @rule(token_ids=st.lists(st.integers(0, 2), max_size=8))
    def lookup(self, token_ids: list[int]) -> None:
        hit = self.pool.lookup(token_ids)
        chain = _chain(token_ids, 2)
        for i, block_id in enumerate(hit):
            assert self.pool.hash_of(block_id) == chain[i], "hit on a block with other content"
        self.holders.append(hit)

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        self.pool.free(self.holders.pop(index % len(self.holders)))

    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for holder in self.holders:
            for block_id in holder:
                expected[block_id] += 1
        assert [self.pool.ref_count(b) for b in range(self.pool.num_blocks)] == expected
        assert self.pool.num_free + self.pool.num_used == self.pool.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
