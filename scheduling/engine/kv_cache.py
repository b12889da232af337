"""Paged KV cache as in vLLM V1: preallocated blocks, a null block, ref counts, an LRU free queue.

Layout of the pool (``num_blocks`` slots, block 0 reserved as the null placeholder)::

    blocks: [null][1][2] ... [N-1]
    free queue:  HEAD <-> a <-> b <-> ... <-> z <-> TAIL      (intrusive: two int arrays)
                 ^ evicted first (least recently freed)   ^ freed last

Eviction order: a block that reaches ref count 0 is appended at the tail; new blocks are taken
from the head, so the least recently freed block is reused first. A finished request frees its
blocks in *reverse* order (``free_blocks(blocks, reverse=True)``), so within one request its tail
blocks are evicted before its head blocks (heads are shared prefixes, more likely to hit again).
A freed block keeps its hash (stays a prefix-cache hit) until it is popped for reuse; every such
eviction is logged in order (``evicted_since``), which the engine's lookup memo reads.

Duplicate blocks, as vLLM's ``BlockHashToBlockMap``: the pool does not de-duplicate. When a request
computes a full block whose hash another block already holds (two requests computed it at once, or
a prompt that ends on a block boundary recomputes its last block because a hit is capped at known
tokens - 1), that block is hashed and indexed too. A lookup returns the oldest surviving copy; each
copy is evicted on its own (its hash is logged each time), the hash leaving the cache only with its
last copy; a freed copy holds a hash, so it joins the tail of the free queue like any cached block.

Blocks are ints; a request's blocks are a Python list of them. Two implementations with one API:

* ``scheduling._kvpool.BlockPool`` — C++ (csrc/sim/kvpool.cpp), what the engine uses;
* :class:`PyBlockPool` — this file, the readable reference. A differential test drives both with
  the same random operations and compares every observable (tests/scheduling/test_kv_cache.py).

:data:`BlockPool` is the compiled one; the reference only with ``GPUBENCH_PURE_PYTHON=1``, or (with a
RuntimeWarning) when the extension was never built; a built one that fails to import is an error. The same
holds for :data:`HashLRU` / :class:`PyHashLRU`, the cpu-offload policy's host pool.

Only full blocks carry a hash. ``BlockHash`` values are Python ints chained over the parent hash
(see :func:`chain_hash`); they fit in 64 bits (``hash()`` of a tuple).
"""
from __future__ import annotations

from collections import deque
from itertools import islice
from typing import NewType

BlockHash = NewType("BlockHash", int)


def chain_hash(parent: int | None, identity: tuple) -> BlockHash:
    """Hash of a full block from its parent's hash and its tokens' identity (vLLM's chained hash)."""
    return BlockHash(hash((parent, identity)))


class PyBlockPool:
    """All KV blocks of the GPU, the free queue and the hash -> cached block map (pure Python).

    Args:
        num_blocks: slots including the null block (so ``num_blocks - 1`` are usable).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (null + 1), got {num_blocks}")
        n = self._n = num_blocks
        self._head, self._tail = n, n + 1
        self._ref = [0] * n
        self._ref[0] = 1  # the null block: never freed, never handed out
        self._hash: list[int | None] = [None] * n
        # Block b's neighbours in the free queue (-1: not in it). Sentinels HEAD = n, TAIL = n + 1.
        self._prev = [-1] * (n + 2)
        self._next = [-1] * (n + 2)
        chain = [self._head, *range(1, n), self._tail]
        for a, b in zip(chain, chain[1:]):
            self._next[a] = b
            self._prev[b] = a
        self.num_free_blocks = n - 1
        self.num_cached_free = 0  # free blocks that still hold a hash (evictable prefix cache)
        # hash -> its oldest surviving copy (what a lookup returns), and hash -> the later copies in
        # the order they were cached, only for the (rare) hashes held by more than one block.
        self._cached: dict[int, int] = {}
        self._copies: dict[int, list[int]] = {}
        self._evicted: list[int] = []

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self._n - 1

    @property
    def num_used_blocks(self) -> int:
        return self._n - 1 - self.num_free_blocks

    @property
    def num_evictions(self) -> int:
        return len(self._evicted)

    def get_new_blocks(self, num_blocks: int) -> list[int] | None:
        """Pop ``num_blocks`` from the free queue (evicting their cached hashes), ref count 1.

        Returns None when fewer are free (an expected shortage, not an error).
        """
        if num_blocks < 0:
            raise ValueError("negative block count")
        if num_blocks > self.num_free_blocks:
            return None
        nxt_of, prv_of, ref, hsh = self._next, self._prev, self._ref, self._hash
        out = []
        b = nxt_of[self._head]
        for _ in range(num_blocks):
            nxt = nxt_of[b]
            prv_of[b] = nxt_of[b] = -1
            h = hsh[b]
            if h is not None:
                self.num_cached_free -= 1
                self._uncache(b, h)
                hsh[b] = None
                self._evicted.append(h)
            ref[b] = 1
            out.append(b)
            b = nxt
        nxt_of[self._head] = b
        prv_of[b] = self._head
        self.num_free_blocks -= num_blocks
        return out

    def _uncache(self, block: int, block_hash: int) -> None:
        """Take ``block`` out of the hash map; a later copy of its hash, if any, takes its place."""
        later = self._copies.get(block_hash)
        if self._cached[block_hash] == block:
            if later is None:
                del self._cached[block_hash]
                return
            self._cached[block_hash] = later.pop(0)
        else:
            later.remove(block)  # type: ignore[union-attr]  # a copy that is not the oldest
        if not later:
            del self._copies[block_hash]

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones off the free queue."""
        nxt_of, prv_of, ref = self._next, self._prev, self._ref
        for b in blocks:
            if ref[b] == 0:
                p, nx = prv_of[b], nxt_of[b]
                if p < 0 or nx < 0:
                    raise RuntimeError(f"touch of block {b}: ref count 0 but not in the free queue")
                nxt_of[p] = nx
                prv_of[nx] = p
                prv_of[b] = nxt_of[b] = -1
                self.num_free_blocks -= 1
                if self._hash[b] is not None:
                    self.num_cached_free -= 1
            ref[b] += 1

    def free_blocks(self, blocks: list[int], reverse: bool = False) -> None:
        """Drop one reference per block (in list order; ``reverse``: last to first). As vLLM's
        ``BlockPool.free_blocks``: a block reaching 0 with a hash joins the tail of the free queue
        (evicted last, it may still be hit); one without a hash goes to the head (evicted first),
        the hash-less blocks of one call keeping their order there."""
        nxt_of, prv_of, ref, tail, head = self._next, self._prev, self._ref, self._tail, self._head
        uncached = []
        for b in (reversed(blocks) if reverse else blocks):
            if ref[b] <= 0 or b == 0:
                raise RuntimeError(f"free of block {b} with ref count {ref[b]}")
            ref[b] -= 1
            if ref[b] == 0:
                self.num_free_blocks += 1
                if self._hash[b] is None:
                    uncached.append(b)
                    continue
                self.num_cached_free += 1
                last = prv_of[tail]
                nxt_of[last] = b
                prv_of[b] = last
                nxt_of[b] = tail
                prv_of[tail] = b
        for b in reversed(uncached):
            first = nxt_of[head]
            nxt_of[head] = b
            prv_of[b] = head
            nxt_of[b] = first
            prv_of[first] = b

    def count_free(self, blocks: list[int]) -> int:
        """How many of ``blocks`` have ref count 0 (touching them takes them off the free queue)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def cache_block(self, block: int, block_hash: int) -> None:
        """Mark a full, in-use block as holding ``block_hash`` (a block keeps a hash it has).

        If another block already holds that hash, ``block`` is indexed as a later copy: lookups
        go on returning the oldest copy (see the module docstring).
        """
        if self._hash[block] is not None:
            return
        self._hash[block] = block_hash
        first = self._cached.setdefault(block_hash, block)
        if first != block:
            self._copies.setdefault(block_hash, []).append(block)

    def cache_blocks(self, blocks: list[int], hashes: list[int], start: int, stop: int) -> None:
        """:meth:`cache_block` for ``blocks[k]`` with ``hashes[k]``, ``k`` in ``[start, stop)``."""
        if start < 0 or stop > len(blocks) or stop > len(hashes):
            raise IndexError("cache_blocks range outside the lists")
        for k in range(start, stop):
            self.cache_block(blocks[k], hashes[k])

    def lookup(self, hashes: list[int], start: int, stop: int) -> list[int]:
        """Cached blocks for ``hashes[start:stop]``, in order, up to the first miss."""
        if start < 0:
            raise IndexError("negative start")
        out = []
        get = self._cached.get
        for h in hashes[start:stop]:
            b = get(h)
            if b is None:
                break
            out.append(b)
        return out

    def get_cached_block(self, block_hash: int) -> int | None:
        """The oldest surviving block holding ``block_hash`` (None when no block does)."""
        return self._cached.get(block_hash)

    def cached_copies(self, block_hash: int) -> list[int]:
        """Every block holding ``block_hash``, oldest first (for tests and invariant checks)."""
        first = self._cached.get(block_hash)
        return [] if first is None else [first, *self._copies.get(block_hash, ())]

    def evicted_since(self, pos: int) -> list[int]:
        """Hashes evicted since position ``pos`` of the eviction log, in order."""
        return self._evicted[max(pos, 0):]

    def ref_cnt(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> int | None:
        return self._hash[block]

    def free_queue_ids(self) -> list[int]:
        """Blocks head to tail (for tests and invariant checks)."""
        out = []
        b = self._next[self._head]
        while b != self._tail:
            out.append(b)
            b = self._next[b]
        return out

    def check_invariants(self) -> None:
        """Raise RuntimeError unless free + used = total, ref counts >= 0, free blocks have ref 0
        and the cache map agrees with the blocks' hashes."""
        free = self.free_queue_ids()
        free_set = set(free)
        if len(free_set) != len(free) or 0 in free_set:
            raise RuntimeError("free queue corrupt")
        if len(free) != self.num_free_blocks:
            raise RuntimeError(f"free count {self.num_free_blocks} but {len(free)} blocks in the queue")
        if self.num_cached_free != sum(1 for b in free if self._hash[b] is not None):
            raise RuntimeError("cached-free count is off")
        for b in range(1, self._n):
            if self._ref[b] < 0 or (self._ref[b] == 0) != (b in free_set):
                raise RuntimeError(f"block {b}: ref count and free queue disagree")
        indexed = 0
        for h, b in self._cached.items():
            copies = [b, *self._copies.get(h, ())]
            if any(self._hash[c] != h for c in copies) or len(set(copies)) != len(copies):
                raise RuntimeError("hash map corrupt")
            indexed += len(copies)
        if self._copies.keys() - self._cached.keys() or any(not v for v in self._copies.values()):
            raise RuntimeError("hash map corrupt: copies of an uncached hash")
        if indexed != sum(1 for b in range(1, self._n) if self._hash[b] is not None):
            raise RuntimeError("hash map corrupt: a hashed block is not indexed")


class PyHashLRU:
    """An LRU set of block hashes with a fixed capacity (the cpu-offload host pool), reference
    implementation of the compiled ``HashLRU``.

    ``store`` is defined one hash at a time (refresh to the MRU end if held, else insert there and
    evict the LRU entry while over capacity). That always ends as: the entries not stored now, in
    their order, then the stored hashes in order, trimmed from the LRU end to the capacity (the
    stored ones sit at the MRU end and evictions take the LRU end), which is built here with
    C-level bulk dict operations.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("negative capacity")
        self.capacity = capacity
        self._d: dict[int, None] = {}  # insertion order = LRU first

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: int) -> bool:
        return h in self._d

    def store(self, hashes: list[int], n: int) -> int:
        """Store ``hashes[:n]`` in order; return how many were not held before."""
        if n > len(hashes):
            raise IndexError("store past the end of the list")
        d = self._d
        chain = dict.fromkeys(hashes[:n])
        held = list(filter(d.__contains__, chain))
        _drain(map(d.__delitem__, held))
        d.update(chain)
        excess = len(d) - self.capacity
        if excess > 0:
            _drain(map(d.__delitem__, list(islice(d, excess))))
        return len(chain) - len(held)

    def count_prefix(self, hashes: list[int], first: int, last: int) -> int:
        """How many of ``hashes[first:last]`` are held, from ``first`` up to the first miss."""
        if first < 0:
            raise IndexError("negative start")
        n = 0
        for h in hashes[first:last]:
            if h not in self._d:
                break
            n += 1
        return n

    def refresh(self, hashes: list[int], first: int, n: int) -> None:
        """Move ``hashes[first:first + n]`` (all held) to the MRU end, in order."""
        d = self._d
        for h in hashes[first:first + n]:
            if h not in d:
                raise RuntimeError("refresh of a hash the pool does not hold")
            del d[h]
            d[h] = None

    def keys(self) -> list[int]:
        """LRU first."""
        return list(self._d)


def _drain(it) -> None:
    """Run an iterator of side effects to its end at C speed."""
    deque(it, maxlen=0)


def _load_pools():
    """(BlockPool, HashLRU, compiled?, why not compiled).

    The compiled pool unless ``GPUBENCH_PURE_PYTHON=1`` asks for the Python one. A compiled module
    that is there but does not import (a stale or broken build) is an ImportError that says so:
    it used to fall back silently, so CI could test the Python pool while the engine it ships ran
    the compiled one. A module that was never built falls back with a RuntimeWarning.
    """
    import os
    import warnings
    from pathlib import Path

    if os.environ.get("GPUBENCH_PURE_PYTHON") == "1":
        return PyBlockPool, PyHashLRU, False, "GPUBENCH_PURE_PYTHON=1"
    try:
        from scheduling._kvpool import BlockPool, HashLRU  # csrc/sim/kvpool.cpp
    except ImportError as exc:
        built = sorted(Path(__file__).parents[1].glob("_kvpool*.so"))
        if built:
            raise ImportError(f"{built[0]}: the compiled block pool does not import ({exc}); rebuild it "
                              "(pip install -e .) or set GPUBENCH_PURE_PYTHON=1 for the Python pool") from exc
        why = f"scheduling._kvpool is not built ({exc})"
        warnings.warn(f"{why}: using the Python block pool (slower; set GPUBENCH_PURE_PYTHON=1 to choose it "
                      "without this warning)", RuntimeWarning, stacklevel=3)
        return PyBlockPool, PyHashLRU, False, why
    return BlockPool, HashLRU, True, None


BlockPool, HashLRU, COMPILED, PURE_PYTHON_REASON = _load_pools()
