"""Admission: moving the head of the waiting queue into the running batch (scheduling.engine.loop).

What vLLM's ``Scheduler.schedule()`` does for a waiting request, in its order: look its prefix up
in the GPU prefix cache (hit capped at known tokens - 1, whole blocks), ask the connector (the KV
policy) for more, apply the admission gate (the free blocks must hold the whole known sequence by
default), then take the hit blocks off the free queue and allocate the rest. A request whose load
is asynchronous waits for it holding its blocks (``Status.LOADING``).

A mixin of :class:`scheduling.engine.loop.Engine`: these methods run inside the scheduling pass on the
engine's own state.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from scheduling.engine.events import LoadDoneEvent
from scheduling.engine.request import Request, Status

if TYPE_CHECKING:
    from scheduling.engine.engine_config import EngineConfig
    from scheduling.engine.kv_manager import KVCacheManager
    from scheduling.engine.outputs import EngineResult
    from scheduling.policies.base import KVPolicy, KVSource, RequestQueue


class Admission:
    """The admission half of the scheduler (see the module docstring)."""

    # the engine's state these methods use, set by Engine.__init__
    config: EngineConfig
    kv: KVCacheManager
    policy: KVPolicy
    external: KVSource  # where tokens beyond the GPU hit come from: the policy's pool, or a remote prefill
    queue: RequestQueue  # the policy's waiting queue (KVPolicy.make_queue)
    running: list[Request]
    loading: dict[int, Request]
    result: EngineResult
    block_size: int
    _prefilling: list[Request]
    _run_pos: itertools.count

    if TYPE_CHECKING:  # another part of the engine defines these (no runtime stub can shadow them)
        def push(self, event_cls, time_s: float, *payload) -> None: ...  # Engine

    def _admit(self, r: Request, budget: int, now_s: float) -> tuple[int, int, int, float] | None:
        """Try to move the head of the waiting queue into the running batch.

        Returns ``(tokens scheduled now, GPU hit tokens, connector tokens, seconds added to the
        step)``, or None when the blocks it needs are not free (the request stays queued).
        """
        kv, policy, external = self.kv, self.policy, self.external
        pool = kv.pool
        h = e = 0
        hit_blocks: list[int] = []
        if r.status == Status.WAITING:
            if self._surely_short(r):
                return None
            max_tokens = kv.max_hit_tokens(r)
            hit_blocks = kv.get_computed_blocks(r, max_tokens) if self.config.prefix_caching else []
            h = len(hit_blocks) * kv.block_size
            e = external.external_hit(r, h, max_tokens) if h < max_tokens else 0
            c0 = h + e
            is_async = bool(e) and external.asynchronous_load
            n = 0 if is_async else min(r.num_tokens - c0, budget)
            need = kv.blocks_for(c0 + n) - len(hit_blocks)
            # vLLM's admission gate (scheduler_reserve_full_isl, on by default): the free blocks must
            # hold the request's whole known sequence, not only its first chunk.
            gate = kv.blocks_for(r.num_tokens) - len(hit_blocks) if self.config.reserve_full_sequence else need
            if gate > pool.num_free_blocks:
                return None
            if not policy.holds_blocks(r.job_state):
                # NOTE(perf): only shared system-prompt blocks can be in use by others (a job runs one
                # turn at a time), so at least k − system blocks of the hit are free: a cheap bound
                # that rejects a queue head retried every step without counting its whole prefix.
                used_max = min(len(hit_blocks), r.job_state.job.system_tokens // kv.block_size)
                if gate + len(hit_blocks) - used_max > pool.num_free_blocks:
                    return None
            free_hits = pool.count_free(hit_blocks)  # touching takes them off the free queue
            if gate + free_hits > pool.num_free_blocks:
                return None
            r.hit_memo = None  # admitted: the blocks become the request's own
            self.queue.pop()
            kv.take_hit_and_allocate(r, hit_blocks, need)
            r.hit_tokens = min(h, r.prompt_tokens)
            r.pool_hit_tokens = min(c0, r.prompt_tokens) - r.hit_tokens
            r.prompt_computed_tokens = 0
            r.num_computed = h
            if not is_async:
                kv.cache_full_blocks(r, c0 + n)  # at schedule time, as vLLM (see the running loop)
            if r.first_scheduled_s is None:
                r.first_scheduled_s = now_s
            load_s = 0.0
            if e:
                load = external.load_external(r, h, e, now_s)
                if is_async:
                    r.status = Status.LOADING
                    self.loading[r.seq] = r
                    self.push(LoadDoneEvent, now_s + load.load_s, r, c0)
                    return 0, h, e, 0.0
                load_s = load.load_s
                r.num_computed = c0
        else:  # WAITING_LOADED: blocks are held; continue the prefill
            c0 = r.num_computed
            n = min(r.num_tokens - c0, budget)
            need = kv.num_new_blocks(r, c0 + n)
            if need > pool.num_free_blocks:
                return None
            self.queue.pop()
            if need > 0:
                kv.allocate(r, need)
            kv.cache_full_blocks(r, c0 + n)
            load_s = 0.0
        r.status = Status.RUNNING
        r.job_state.waiting_request = None
        r.run_pos = next(self._run_pos)
        self.running.append(r)
        self._prefilling.append(r)
        policy.on_admitted(r, now_s)
        return n, h, e, load_s

    def _surely_short(self, r: Request) -> bool:
        """Whether a waiting request certainly fails the block gates of :meth:`_admit`, whatever its
        prefix hit turns out to be.

        NOTE(perf): a queue head that cannot fit is retried every step, and its lookup is the
        costly part. Under the default gate the free blocks must hold the whole sequence less the
        hit; of the hit, only shared system-prompt blocks can be in use by others (a job that holds
        no blocks runs one turn at a time), so they must hold at least the sequence less its
        system prompt. Failing that bound, both gates fail: the answer is the same, found sooner.
        """
        if not self.config.reserve_full_sequence or self.policy.holds_blocks(r.job_state):
            return False
        kv = self.kv
        return kv.blocks_for(r.num_tokens) - r.job_state.job.system_tokens // kv.block_size > kv.pool.num_free_blocks

    def _release_loaded(self, num_running: int) -> bool:
        """Nothing runs and the queue head cannot get blocks: free the blocks of the last queued
        request that holds loaded KV (it looks its prefix up again later; its blocks stay cached).

        NOTE: without this, requests that each hold loaded blocks and each need more would wait
        for one another forever. With requests running, blocks come back when they finish.
        """
        if num_running:
            return False
        victim = None
        for r in self.queue:
            if r.status == Status.WAITING_LOADED:
                victim = r
        if victim is None:
            return False
        self.kv.free(victim)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.result.num_preemptions += 1
        return True
