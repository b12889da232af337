"""The engine's KV cache manager over the block pool, in vLLM's shape (``KVCacheManager``).

vLLM's ``Scheduler`` never touches its ``BlockPool`` directly: a ``KVCacheManager`` finds a
request's computed (prefix-cached) blocks, allocates the slots a step needs, caches full blocks
and frees a request's blocks. This class is that layer for the replay engine: every block
computation of the engine (how many blocks a token count needs, the hit cap, allocation, caching,
freeing) is here, once. Requests hold their blocks as a list of ints (``Request.blocks``) and the
count of those already hashed (``Request.num_cached_blocks``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from scheduling.engine.kv_cache import BlockPool

if TYPE_CHECKING:
    from scheduling.engine.request import Request


class KVCacheManager:
    """Blocks of ``block_size`` tokens from a pool of ``num_gpu_blocks`` usable blocks (+ the null block)."""

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_gpu_blocks + 1)
        self.block_size = block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, r: Request, num_tokens: int) -> int:
        """Blocks ``r`` must be given to hold ``num_tokens`` (<= 0 when it holds enough)."""
        return -(-num_tokens // self.block_size) - len(r.blocks)

    def max_hit_tokens(self, r: Request) -> int:
        """The most tokens a prefix hit may cover: known tokens - 1 (at least one token is computed,
        for its logits), rounded down to whole blocks (vLLM's ``max_cache_hit_length``)."""
        return (r.num_tokens - 1) // self.block_size * self.block_size

    def allocate(self, r: Request, num_blocks: int) -> bool:
        """Append ``num_blocks`` new blocks to ``r``; False (nothing taken) when too few are free."""
        new = self.pool.get_new_blocks(num_blocks)
        if new is None:
            return False
        r.blocks.extend(new)
        return True

    def take_hit_and_allocate(self, r: Request, hit_blocks: list[int], num_new_blocks: int) -> None:
        """Admission: ``r`` takes a reference on its prefix hit and ``num_new_blocks`` new blocks
        after it (the caller checked that they are free)."""
        self.pool.touch(hit_blocks)
        new = self.pool.get_new_blocks(num_new_blocks)
        assert new is not None, "admission checked the free blocks"
        r.blocks = hit_blocks + new
        r.num_cached_blocks = len(hit_blocks)

    def cache_full_blocks(self, r: Request, num_tokens: int | None = None) -> None:
        """Give ``r``'s blocks that are full at ``num_tokens`` (default: its computed tokens) their
        hashes (vLLM's ``cache_full_blocks``: at schedule time, for the tokens the step computes)."""
        full = (r.num_computed if num_tokens is None else num_tokens) // self.block_size
        if full > r.num_cached_blocks:
            self.pool.cache_blocks(r.blocks, r.job_state.block_hashes(full), r.num_cached_blocks, full)
            r.num_cached_blocks = full

    def free(self, r: Request) -> None:
        """Drop ``r``'s blocks, last block first (its tail is evicted before its shared head); they
        stay cached until reused."""
        self.pool.free_blocks(r.blocks, True)
        r.blocks = []
        r.num_cached_blocks = 0

    def get_computed_blocks(self, r: Request, max_tokens: int) -> list[int]:
        """Cached blocks along ``r``'s hash chain, from block 0 until the first miss, covering at
        most ``max_tokens``.

        NOTE(perf): a queue head that cannot be admitted is looked up again every step, and its
        chain can be thousands of blocks. The last result is kept on the request with a position
        in the pool's eviction log; a repeat lookup only truncates it at the first hash evicted
        since, then extends it block by block as a fresh lookup would. That is exact with duplicate
        blocks too: a lookup's answer for a hash changes only when a copy of it is evicted (caching
        another copy leaves the oldest the answer), and every evicted copy logs its hash.
        """
        num = max_tokens // self.block_size
        if num == 0:
            return []
        js = r.job_state
        hashes = js.block_hashes(num)
        pool = self.pool
        num_evicted = pool.num_evictions
        out = r.hit_memo
        if out is None:
            out = []
        else:
            if len(out) > num:
                del out[num:]
            if r.hit_log_pos < num_evicted and out:
                index = js.hash_index
                # the chain's hashes evicted since, found at C speed (the log can be long when
                # another request was the queue's head for a while)
                hit = index.keys() & pool.evicted_since(r.hit_log_pos)
                if hit:
                    del out[min(map(index.__getitem__, hit)):]
        if len(out) < num:
            out.extend(pool.lookup(hashes, len(out), num))
        r.hit_memo = out
        r.hit_log_pos = num_evicted
        return out
