"""Block pool: order, ref counts, eviction, invariants (no engine).

Every behavioural test runs on both implementations: the compiled pool the engine uses and the
pure-Python reference. A differential test drives both with the same random operations and
compares everything they expose after each one.
"""
import os
import random

import pytest

from scheduling.engine import kv_cache
from scheduling.engine.kv_cache import PyBlockPool, chain_hash

if os.environ.get("GPUBENCH_PURE_PYTHON") == "1":
    pytest.skip("GPUBENCH_PURE_PYTHON=1: the compiled pool is not under test", allow_module_level=True)
# Not importorskip: a broken or missing build must fail here, not skip (tests/scheduling/test_kvpool_build.py).
from scheduling import _kvpool  # noqa: E402

IMPLS = {"compiled": _kvpool.BlockPool, "python": PyBlockPool}


@pytest.fixture(params=sorted(IMPLS))
def Pool(request):
    return IMPLS[request.param]


def test_engine_uses_the_compiled_pool():
    assert kv_cache.COMPILED and kv_cache.BlockPool is _kvpool.BlockPool


def test_needs_two_blocks(Pool):
    with pytest.raises(ValueError, match="at least 2 blocks"):
        Pool(1)


def test_null_block_never_handed_out_and_shortage_returns_none(Pool):
    pool = Pool(4)
    assert pool.num_total_blocks == 3
    got = pool.get_new_blocks(3)
    assert sorted(got) == [1, 2, 3] and pool.ref_cnt(0) == 1
    assert pool.get_new_blocks(1) is None  # an expected shortage, not an error
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 3
    pool.check_invariants()


def test_reverse_free_evicts_tail_blocks_first_and_hash_survives_until_reuse(Pool):
    pool = Pool(7)  # 6 usable
    req = pool.get_new_blocks(4)
    assert req == [1, 2, 3, 4]
    hashes, parent = [], None
    for i in range(4):
        parent = chain_hash(parent, ("j", "a", i))
        hashes.append(parent)
    pool.cache_blocks(req, hashes, 0, 4)
    pool.free_blocks(req, True)
    # free queue: 5, 6 (never used), then 4, 3, 2, 1 (the request's tail first)
    assert pool.free_queue_ids() == [5, 6, 4, 3, 2, 1]
    assert pool.num_cached_free == 4 and pool.lookup(hashes, 0, 4) == [1, 2, 3, 4]
    assert pool.get_new_blocks(3) == [5, 6, 4]
    assert pool.get_cached_block(hashes[3]) is None  # the tail block was evicted...
    assert pool.get_cached_block(hashes[0]) == 1      # ...the head block still hits
    assert pool.num_evictions == 1 and pool.evicted_since(0) == [hashes[3]] and pool.evicted_since(1) == []
    assert pool.lookup(hashes, 0, 4) == [1, 2, 3]  # up to the first miss
    assert pool.lookup(hashes, 1, 3) == [2, 3]
    pool.check_invariants()


def test_touch_takes_free_cached_blocks_off_the_queue_and_ref_counts(Pool):
    pool = Pool(5)
    a = pool.get_new_blocks(2)
    pool.cache_block(a[0], chain_hash(None, ("g", "x", 0)))
    pool.free_blocks(a, True)
    assert pool.num_free_blocks == 4 and pool.count_free(a) == 2
    pool.touch([a[0]])
    pool.touch([a[0]])  # a second sharer
    assert pool.ref_cnt(a[0]) == 2 and pool.num_free_blocks == 3 and pool.num_cached_free == 0
    assert pool.count_free(a) == 1
    pool.free_blocks([a[0]])
    assert pool.ref_cnt(a[0]) == 1 and pool.num_used_blocks == 1
    pool.free_blocks([a[0]])
    assert pool.num_used_blocks == 0 and pool.num_cached_free == 1
    with pytest.raises(RuntimeError, match="ref count 0"):
        pool.free_blocks([a[0]])
    pool.check_invariants()


def test_a_block_keeps_the_hash_it_has(Pool):
    pool = Pool(4)
    (a,) = pool.get_new_blocks(1)
    h = chain_hash(None, ("g", "x", 0))
    pool.cache_block(a, h)
    pool.cache_block(a, h + 1)
    assert pool.block_hash(a) == h and pool.get_cached_block(h + 1) is None


def test_duplicate_blocks_are_each_indexed_as_vllm_does(Pool):
    """vLLM's block pool does not de-duplicate: every copy of a computed block is hashed and
    indexed, a lookup returns the oldest surviving copy, the hash stays cached while any copy
    survives, and a freed copy is a cached block (tail of the free queue)."""
    pool = Pool(6)  # 5 usable
    a, b, c = pool.get_new_blocks(3)
    h = chain_hash(None, ("g", "x", 0))
    for blk in (a, b, c):
        pool.cache_block(blk, h)
    assert [pool.block_hash(x) for x in (a, b, c)] == [h, h, h]
    assert pool.cached_copies(h) == [a, b, c] and pool.get_cached_block(h) == a and pool.lookup([h], 0, 1) == [a]
    pool.free_blocks([b, a, c])  # every copy holds the hash: all join the tail, in order
    assert pool.free_queue_ids() == [4, 5, b, a, c] and pool.num_cached_free == 3
    pool.check_invariants()
    assert pool.get_new_blocks(3) == [4, 5, b]  # evicting a later copy leaves the oldest the answer
    assert pool.cached_copies(h) == [a, c] and pool.get_cached_block(h) == a and pool.evicted_since(0) == [h]
    assert pool.get_new_blocks(1) == [a]  # the oldest goes: the next copy answers
    assert pool.get_cached_block(h) == c and pool.lookup([h], 0, 1) == [c] and pool.evicted_since(0) == [h, h]
    pool.check_invariants()
    assert pool.get_new_blocks(1) == [c]  # the last copy takes the hash with it
    assert pool.get_cached_block(h) is None and pool.cached_copies(h) == [] and pool.num_evictions == 3
    pool.check_invariants()


def test_a_copy_cached_after_its_first_is_evicted_answers_after_the_older_survivor(Pool):
    pool = Pool(5)
    a, b = pool.get_new_blocks(2)
    h = chain_hash(None, ("g", "y", 0))
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    pool.free_blocks([a])
    assert pool.get_new_blocks(3) == [3, 4, a]  # a evicted: b is the oldest survivor
    pool.cache_block(a, h)  # a computes the block again: a later copy than b
    assert pool.cached_copies(h) == [b, a] and pool.get_cached_block(h) == b
    pool.check_invariants()


def test_bad_ids_and_ranges_are_errors_not_corruption(Pool):
    pool = Pool(4)
    with pytest.raises((IndexError, RuntimeError)):
        pool.free_blocks([0])  # the null block is never freed
    with pytest.raises(IndexError):
        pool.cache_blocks([1], [5], 0, 2)
    with pytest.raises(IndexError):
        pool.lookup([5], -1, 1)
    with pytest.raises(IndexError):
        pool.touch([4])  # outside a 4-slot pool
    pool.check_invariants()


def _state(pool, hashes):
    return (pool.free_queue_ids(), [pool.ref_cnt(b) for b in range(pool.num_total_blocks + 1)],
            [pool.block_hash(b) for b in range(pool.num_total_blocks + 1)], pool.num_free_blocks,
            pool.num_used_blocks, pool.num_cached_free, pool.num_evictions, pool.evicted_since(0),
            [pool.get_cached_block(h) for h in hashes], [pool.cached_copies(h) for h in hashes])


@pytest.mark.parametrize("num_blocks, num_chains, chain_len, max_req", [(41, 6, 30, 12), (3001, 40, 400, 300)])
def test_compiled_pool_matches_the_reference_under_random_operations(num_blocks, num_chains, chain_len, max_req):
    """Requests over hash chains (shared prefixes, hits, reverse frees, evictions); the large case
    fills the compiled hash map's tables through several growths and many deletions."""
    rng = random.Random(7)
    fast, ref = _kvpool.BlockPool(num_blocks), PyBlockPool(num_blocks)
    chains = []
    for c in range(num_chains):
        parent, chain = None, []
        for i in range(chain_len):
            parent = chain_hash(parent, ("g" if i < 4 else "j", c if i >= 4 else 0, i))
            chain.append(parent)
        chains.append(chain)
    all_hashes = [h for ch in chains for h in ch]
    held: list[list[int]] = []
    for step in range(3000):
        op = rng.random()
        if held and op < 0.4:
            blocks = held.pop(rng.randrange(len(held)))
            rev = rng.random() < 0.8
            fast.free_blocks(blocks, rev)
            ref.free_blocks(blocks, rev)
        else:
            chain = rng.choice(chains)
            n = rng.randint(1, max_req)
            hit = ref.lookup(chain, 0, n)
            assert fast.lookup(chain, 0, n) == hit
            if hit and rng.random() < 0.3:  # compute part of the hit again (a capped hit, or a
                del hit[rng.randrange(len(hit)):]  # concurrent prefill): duplicate blocks
            assert fast.count_free(hit) == ref.count_free(hit)
            if n - len(hit) > ref.num_free_blocks:
                assert fast.get_new_blocks(n - len(hit)) is None and ref.get_new_blocks(n - len(hit)) is None
                continue
            if n - len(hit) + ref.count_free(hit) > ref.num_free_blocks:
                continue  # touching the hit would leave too few (the engine checks the same)
            fast.touch(hit)
            ref.touch(hit)
            new = ref.get_new_blocks(n - len(hit))
            assert fast.get_new_blocks(n - len(hit)) == new
            blocks = hit + new
            full = rng.randint(len(hit), n)  # the blocks computed so far get their hashes
            fast.cache_blocks(blocks, chain, len(hit), full)
            ref.cache_blocks(blocks, chain, len(hit), full)
            held.append(blocks)
        if step % 50 == 0:
            fast.check_invariants()
            ref.check_invariants()
        assert fast.num_free_blocks == ref.num_free_blocks and fast.num_evictions == ref.num_evictions
    assert _state(fast, all_hashes) == _state(ref, all_hashes)
    assert ref.num_evictions > 50  # the test did exercise eviction
    assert any(len(ref.cached_copies(h)) > 1 for h in all_hashes)  # ... and duplicate copies


def test_invariant_check_catches_corruption():
    pool = PyBlockPool(5)
    (b,) = pool.get_new_blocks(1)
    pool.check_invariants()
    pool._ref[b] = 0  # in use but ref 0: not in the free queue
    with pytest.raises(RuntimeError, match="disagree"):
        pool.check_invariants()
