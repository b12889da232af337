"""Paged KV cache as in vLLM V1: preallocated blocks, a null block, ref counts, an LRU free queue.

Layout of the pool (``num_blocks`` slots, block 0 reserved as the null placeholder)::

    blocks: [null][b1][b2] ... [bN-1]
    free queue:  HEAD <-> bA <-> bB <-> ... <-> bZ <-> TAIL      (intrusive, no allocation per op)
                 ^ evicted first (least recently freed)   ^ freed last

Eviction order: a block that reaches ref count 0 is appended at the tail; new blocks are taken
from the head, so the least recently freed block is reused first. A finished request frees its
blocks in *reverse* order (``free_blocks(reversed(blocks))``), so within one request its tail
blocks are evicted before its head blocks (heads are shared prefixes, more likely to hit again).
A freed block keeps its hash (stays a prefix-cache hit) until it is popped for reuse.

Only full blocks carry a hash. ``BlockHash`` values are Python ints chained over the parent hash
(see :func:`chain_hash`).
"""
from __future__ import annotations

from typing import Callable, Iterable, NewType

BlockHash = NewType("BlockHash", int)


def chain_hash(parent: int | None, identity: tuple) -> BlockHash:
    """Hash of a full block from its parent's hash and its tokens' identity (vLLM's chained hash)."""
    return BlockHash(hash((parent, identity)))


class KVBlock:
    """One KV-cache block slot. ``prev_free``/``next_free`` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with fake head/tail sentinels (LRU order).

    ``popleft`` takes the least recently freed block; ``append`` puts a freed block last; ``remove``
    takes a block out of the middle in O(1) (a prefix hit on a free cached block).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self.num_free_blocks = 0
        prev = self._head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
            self.num_free_blocks += 1
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVBlock:
        """Remove and return the least recently freed block; raises when empty."""
        b = self._head.next_free
        if b is self._tail:
            raise RuntimeError("popleft from an empty free queue")
        nxt = b.next_free
        self._head.next_free = nxt
        nxt.prev_free = self._head
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1
        return b

    def remove(self, b: KVBlock) -> None:
        """Take ``b`` out of the queue wherever it is."""
        prev, nxt = b.prev_free, b.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"remove of {b!r}, which is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append(self, b: KVBlock) -> None:
        """Put ``b`` at the tail (evicted last)."""
        last = self._tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVBlock]:
        """Blocks head to tail (for tests and invariant checks)."""
        out = []
        b = self._head.next_free
        while b is not self._tail:
            out.append(b)
            b = b.next_free
        return out


class BlockPool:
    """All KV blocks of the GPU, the free queue and the hash -> cached block map.

    Args:
        num_blocks: slots including the null block (so ``num_blocks - 1`` are usable).
        on_evict: optional callback ``(block_hash) -> None`` when a cached block is reused.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[BlockHash], None] | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (null + 1), got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_cached_free = 0  # free blocks that still hold a hash (evictable prefix cache)
        self.num_evictions = 0
        self.evicted_log: list[BlockHash] = []  # every evicted hash, in order (lookup memo validation)
        self._on_evict = on_evict

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock] | None:
        """Pop ``num_blocks`` from the free queue (evicting their cached hashes), ref count 1.

        Returns None when fewer are free (an expected shortage, not an error).
        """
        fq = self.free_queue
        if num_blocks > fq.num_free_blocks:
            return None
        # NOTE(perf): FreeBlockQueue.popleft inlined; a recomputed prompt takes thousands at once.
        head = fq._head
        cached = self.cached
        log = self.evicted_log
        on_evict = self._on_evict
        out = []
        b = head.next_free
        for _ in range(num_blocks):
            nxt = b.next_free
            b.prev_free = b.next_free = None
            h = b.block_hash
            if h is not None:
                self.num_cached_free -= 1
                if cached.get(h) is b:
                    del cached[h]
                b.block_hash = None
                log.append(h)
                if on_evict is not None:
                    on_evict(h)
            b.ref_cnt = 1
            out.append(b)
            b = nxt
        head.next_free = b
        b.prev_free = head
        fq.num_free_blocks -= num_blocks
        self.num_evictions = len(log)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones off the free queue."""
        # NOTE(perf): FreeBlockQueue.remove inlined; a turn touches its whole prefix (thousands).
        fq = self.free_queue
        n_removed = n_cached = 0
        for b in blocks:
            if b.ref_cnt == 0:
                prev, nxt = b.prev_free, b.next_free
                if prev is None or nxt is None:
                    raise RuntimeError(f"touch of {b!r}: ref count 0 but not in the free queue")
                prev.next_free = nxt
                nxt.prev_free = prev
                b.prev_free = b.next_free = None
                n_removed += 1
                if b.block_hash is not None:
                    n_cached += 1
            b.ref_cnt += 1
        fq.num_free_blocks -= n_removed
        self.num_cached_free -= n_cached

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue in the given order."""
        # NOTE(perf): FreeBlockQueue.append inlined (a finished turn frees its whole context).
        fq = self.free_queue
        tail = fq._tail
        n_added = n_cached = 0
        for b in ordered:
            rc = b.ref_cnt - 1
            if rc < 0:
                raise RuntimeError(f"free of {b!r} with ref count {b.ref_cnt}")
            b.ref_cnt = rc
            if rc == 0:
                last = tail.prev_free
                last.next_free = b
                b.prev_free = last
                b.next_free = tail
                tail.prev_free = b
                n_added += 1
                if b.block_hash is not None:
                    n_cached += 1
        fq.num_free_blocks += n_added
        self.num_cached_free += n_cached

    def cache_block(self, b: KVBlock, block_hash: BlockHash) -> None:
        """Mark a full, in-use block as holding ``block_hash``.

        If another block already caches that hash (two requests computed the same block at once),
        the first stays the cached one and ``b`` stays uncached, as in vLLM.
        """
        if b.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        b.block_hash = block_hash
        self.cached[block_hash] = b

    def check_invariants(self) -> None:
        """Assert free + used = total, ref counts >= 0, free blocks have ref 0, cache map consistent."""
        free = self.free_queue.get_all_free_blocks()
        assert len(free) == self.free_queue.num_free_blocks, (len(free), self.free_queue.num_free_blocks)
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block appears twice in the free queue"
        used = [b for b in self.blocks[1:] if b.ref_cnt > 0]
        assert len(used) + len(free) == self.num_total_blocks, (len(used), len(free), self.num_total_blocks)
        for b in self.blocks[1:]:
            assert b.ref_cnt >= 0, b
            assert (b.ref_cnt == 0) == (b.block_id in free_ids), b
        for h, b in self.cached.items():
            assert b.block_hash == h, (h, b)
        assert self.num_cached_free == sum(1 for b in free if b.block_hash is not None)
