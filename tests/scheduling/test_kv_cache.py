"""Block pool and free queue: order, ref counts, eviction, invariants (CPU only, no engine)."""
import pytest

from scheduling.kv_cache import BlockPool, FreeBlockQueue, KVBlock, chain_hash


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_order_and_links():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    # HEAD <-> 0 <-> 1 <-> 2 <-> 3 <-> 4 <-> TAIL
    assert q.num_free_blocks == 5 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    # HEAD <-> 0 <-> 1 <-> 3 <-> 4 <-> TAIL
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    # HEAD <-> 1 <-> 3 <-> 4 <-> 2 <-> TAIL
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2] and q.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(blocks[0])


def test_popleft_empty_raises():
    q = FreeBlockQueue([])
    with pytest.raises(RuntimeError, match="empty"):
        q.popleft()


def test_null_block_never_handed_out_and_shortage_returns_none():
    pool = BlockPool(4)
    assert pool.num_total_blocks == 3
    got = pool.get_new_blocks(3)
    assert 0 not in ids(got) and pool.null_block.block_id == 0
    assert pool.get_new_blocks(1) is None  # an expected shortage, not an error
    pool.check_invariants()


def test_reverse_free_evicts_tail_blocks_first_and_hash_survives_until_reuse():
    pool = BlockPool(7)  # 6 usable
    req = pool.get_new_blocks(4)  # blocks 1..4
    hashes = []
    parent = None
    for i, b in enumerate(req):
        parent = chain_hash(parent, ("j", "a", i))
        hashes.append(parent)
        pool.cache_block(b, parent)
    pool.free_blocks(reversed(req))
    # free queue: 5, 6 (never used), then 4, 3, 2, 1 (the request's tail first)
    assert ids(pool.free_queue.get_all_free_blocks()) == [5, 6, 4, 3, 2, 1]
    assert pool.num_cached_free == 4 and all(pool.get_cached_block(h) is not None for h in hashes)
    new = pool.get_new_blocks(3)
    assert ids(new) == [5, 6, 4]
    assert pool.get_cached_block(hashes[3]) is None  # the tail block was evicted...
    assert pool.get_cached_block(hashes[0]) is req[0]  # ...the head block still hits
    assert pool.num_evictions == 1 and pool.evicted_log == [hashes[3]]
    pool.check_invariants()


def test_touch_takes_free_cached_blocks_off_the_queue_and_ref_counts():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    pool.cache_block(a[0], chain_hash(None, ("g", "x", 0)))
    pool.free_blocks(reversed(a))
    assert pool.num_free_blocks == 4
    pool.touch([a[0]])
    pool.touch([a[0]])  # a second sharer
    assert a[0].ref_cnt == 2 and pool.num_free_blocks == 3 and pool.num_cached_free == 0
    pool.free_blocks([a[0]])
    assert a[0].ref_cnt == 1 and pool.num_used_blocks == 1
    pool.free_blocks([a[0]])
    assert pool.num_used_blocks == 0 and pool.num_cached_free == 1
    with pytest.raises(RuntimeError, match="ref count 0"):
        pool.free_blocks([a[0]])
    pool.check_invariants()


def test_duplicate_hash_keeps_first_block_cached():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = chain_hash(None, ("g", "x", 0))
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_invariants_hold_through_random_operations():
    import random

    rng = random.Random(0)
    pool = BlockPool(33)
    held: list[list] = []
    for step in range(400):
        if held and rng.random() < 0.45:
            blocks = held.pop(rng.randrange(len(held)))
            pool.free_blocks(reversed(blocks))
        else:
            got = pool.get_new_blocks(rng.randint(1, 6))
            if got is None:
                continue
            for b in got:
                if rng.random() < 0.5:
                    pool.cache_block(b, chain_hash(step, ("j", "r", b.block_id)))
            held.append(got)
        pool.check_invariants()
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_total_blocks
