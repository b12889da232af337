"""Discrete-event simulation of a vLLM V1 engine serving multi-turn agent jobs.

The model (as in vLLM's ``Scheduler.schedule``): there is no prefill or decode phase, only
*computed* versus *known* tokens per request. Each step has one token budget
(``max_num_batched_tokens``); running requests are served first (a decode takes 1 token, a
chunked prefill takes what is left of the budget); when a running request cannot get a block,
the policy's victim (FCFS: the last running request) is preempted by recompute, in a loop; waiting
requests are admitted only if nothing was preempted in this step, up to ``max_num_seqs``, each
after a prefix-cache lookup (hit capped at known tokens − 1, whole blocks) and a connector lookup.

Events (``scheduling.events``) are kept in a ``heapq`` as ``(time_s, priority, seq, event)``; ``seq``
comes from this engine's own ``itertools.count()``, so two engines never share a counter.
``run()`` returns an :class:`scheduling.outputs.EngineResult`; sizes come in an
:class:`scheduling.engine_config.EngineConfig`.
"""
from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, Sequence

from gpubench.errors import ConfigError
from scheduling.decode_group import DecodeGroup
from scheduling.engine_config import EngineConfig  # noqa: F401 (re-exported: the engine's own config)
from scheduling.events import ArrivalEvent, BlocksReleaseEvent, Event, LoadDoneEvent, PinExpiryEvent, ScheduleEvent  # noqa: F401 (re-exported)
from scheduling.kv_cache import BlockPool
from scheduling.outputs import JOB_COLUMNS, STEP_COLUMNS, TURN_COLUMNS, EngineResult, JobRecord, StepRecord, TurnRecord  # noqa: F401
from scheduling.policies.base import KVPolicy
from scheduling.request import JobState, Request, Status
from scheduling.step_cost import StepCost
from scheduling.traces import Job


class Engine(DecodeGroup):
    """One replay: jobs in, records out. Not reusable: build a new engine per run. The decode
    group's fast path is in :class:`scheduling.decode_group.DecodeGroup`.

    Args:
        jobs: the workload (arrival times set; see ``traces.with_poisson_arrivals``).
        config: sizes.
        policy: a fresh :class:`KVPolicy` (policies hold per-run state).
        step_cost: seconds per step.
        progress: optional ``callback(num_jobs_done, num_jobs, now_s)``, called every 512 steps.
    """

    def __init__(self, jobs: Sequence[Job], config: EngineConfig, policy: KVPolicy, step_cost: StepCost,
                 progress: Callable[[int, int, float], None] | None = None) -> None:
        if config.num_gpu_blocks < 1:
            raise ConfigError(f"the GPU KV pool has {config.num_gpu_blocks} blocks: the model does not fit")
        self.config = config
        self.policy = policy
        self.step_cost = step_cost
        self.pool = BlockPool(config.num_gpu_blocks + 1)
        self.queue = policy.make_queue()
        self.running: list[Request] = []
        self.loading: dict[int, Request] = {}
        self.block_size = config.block_size
        self.jobs = [JobState(j, i, config.block_size) for i, j in enumerate(jobs)]
        self._progress = progress
        self._heap: list = []
        self._seq = itertools.count()
        self._req_seq = itertools.count()
        self.busy = False
        self.schedule_pending = False
        self.now_s = 0.0
        self.result = EngineResult(num_gpu_blocks=config.num_gpu_blocks)
        self._num_jobs_done = 0
        self._max_request_tokens = config.num_gpu_blocks * config.block_size
        # The batch of the step in flight (reused lists: a step allocates nothing for them).
        self._sched_reqs: list[Request] = []
        self._sched_n: list[int] = []
        self._prefill_memo: dict[int, float] = {}
        # Decode group (see the NOTE in the scheduler section).
        self._g = 0  # index of the next step
        self._dec: dict[int, Request] = {}
        self._prefilling: list[Request] = []  # running requests outside the group, running order
        self._alloc_due: dict[int, list[Request]] = {}
        self._fin_due: dict[int, list[Request]] = {}
        self._lag_sum = 0
        self._dec_max_pos = -1
        self._dec_max_pos_dirty = False
        self._step_fast = False
        self._pass_preempted = 0
        self._step_end: float | None = None  # end of the step in flight (kept off the heap)
        self._run_pos = itertools.count()
        policy.attach(self)

    # --- event plumbing -----------------------------------------------------------------------
    def push(self, event_cls, time_s: float, *payload) -> None:
        """Create an event with this engine's next sequence number and put it on the heap."""
        ev = event_cls(time_s, next(self._seq), *payload)
        heapq.heappush(self._heap, (time_s, ev.priority, ev.seq, ev))

    def wake(self, now_s: float) -> None:
        """Ask for a scheduling pass at ``now_s`` (after every other event of that instant)."""
        if not self.busy and not self.schedule_pending:
            self.schedule_pending = True
            self.push(ScheduleEvent, now_s)

    def run(self) -> EngineResult:
        """Simulate until every job finished; return the records."""
        t0 = time.perf_counter()
        for js in sorted(self.jobs, key=lambda j: (j.job.arrival_s, j.index)):
            self.push(ArrivalEvent, js.job.arrival_s, js, 0)
        heap = self._heap
        pop = heapq.heappop
        while True:
            # NOTE(perf): the step in flight is not on the heap: its end is the one event every step
            # has. It sorts first among events of its instant (EventPriority.STEP_END is the lowest),
            # so ``end <= heap top`` is exactly the order the heap would give.
            end = self._step_end
            if end is not None and (not heap or end <= heap[0][0]):
                self._step_end = None
                self.now_s = end
                self.on_step_end(end)
                continue
            if not heap:
                break
            t, _, _, ev = pop(heap)
            self.now_s = t
            ev.handle(self)
        self.result.wall_s = time.perf_counter() - t0
        self.result.sim_time_s = self.now_s
        self.result.policy_stats = self.policy.stats()
        unfinished = [js.job.job_id for js in self.jobs if js.finish_s is None]
        if unfinished:  # an engine bug, not a user error: say which jobs
            raise RuntimeError(f"simulation ended with {len(unfinished)} unfinished jobs: {unfinished[:5]}")
        if self._progress:
            self._progress(self._num_jobs_done, len(self.jobs), self.now_s)
        return self.result

    # --- event handlers -----------------------------------------------------------------------
    def on_arrival(self, js: JobState, turn: int, now_s: float) -> None:
        prompt = js.prompt_tokens(turn)
        total = prompt + js.job.turns[turn].output_tokens - 1  # the last sampled token gets no KV
        bs = self.block_size
        if -(-total // bs) * bs > self._max_request_tokens:
            raise ConfigError(f"job {js.job.job_id} turn {turn} needs {total} tokens of KV cache, more than the "
                              f"whole GPU pool ({self._max_request_tokens} tokens); use a larger SKU or smaller model")
        req = Request(js, turn, next(self._req_seq), now_s, prompt)
        js.waiting_request = req
        if turn > 0:
            self.policy.on_job_arrival_gap(req, now_s)
        self.policy.on_arrival(req, now_s)
        self.queue.add(req)
        self.wake(now_s)

    def on_load_done(self, req: Request, num_computed: int, now_s: float) -> None:
        del self.loading[req.seq]
        req.num_computed = num_computed
        self._cache_full_blocks(req)
        req.status = Status.WAITING_LOADED
        self.queue.prepend(req)
        self.wake(now_s)

    def on_step_end(self, now_s: float) -> None:
        self._finish_step(now_s)
        self.busy = False
        heap = self._heap
        if heap and heap[0][0] <= now_s:
            self.wake(now_s)  # other events at this instant first
        else:
            self.try_step(now_s)

    def try_step(self, now_s: float) -> None:
        """Schedule a step at ``now_s``; if the batch is empty, stay idle until the next event."""
        dur_s = self._schedule(now_s)
        while dur_s is None and self._pass_preempted:
            dur_s = self._schedule(now_s)
        if dur_s is None:
            return
        self.busy = True
        if self._step_fast and not self._prefilling and not self.queue and not self.loading \
                and not self.config.record_steps:
            self._step_end = self._decode_run(now_s, dur_s)
        else:
            self._step_end = now_s + dur_s

    # --- the scheduler ------------------------------------------------------------------------
    #
    # NOTE(perf): steady decoding must cost little per request. Requests in the decode state
    # (prompt computed, one token per step) form the *decode group*: their counters are kept as
    # offsets from the step index ``_g`` (``num_computed = lag + _g``), so a step touches only
    # the members that need a new block (every block_size steps) or finish, found in ``_alloc_due`` /
    # ``_fin_due`` keyed by step index. A step takes this fast path only when it is provably
    # identical to the exact loop: every decode gets its token (the budget covers them, and the
    # prefills either fit too or all come after the decodes in running order) and every block
    # the step needs is free (so nothing is preempted). Otherwise the group is materialized and
    # the exact vLLM loop below runs over the whole running list.
    def _schedule(self, now_s: float) -> float | None:
        """Build one step's batch; return its duration, or None when there is nothing to run."""
        fast = self.config.fast_path and self._fast_plan()
        if not fast and self._dec:
            self._leave_fast_mode()
        cfg, pool, policy = self.config, self.pool, self.policy
        scheduled_reqs, scheduled_num_tokens = self._sched_reqs, self._sched_n
        scheduled_reqs.clear()
        scheduled_num_tokens.clear()
        budget = cfg.max_num_batched_tokens
        bs = self.block_size
        num_prefill_tokens = num_prefill_seqs = prefill_context_tokens = num_decode_seqs = decode_context_tokens = 0
        extra_s = 0.0
        num_preempted = hit_tokens = pool_tokens = 0
        reason = ""
        if fast:
            g = self._g
            num_decode_seqs = len(self._dec)
            decode_context_tokens = self._lag_sum + num_decode_seqs * g
            budget -= num_decode_seqs
            if g in self._alloc_due:
                self._give_due_blocks(g)
            running = self._prefilling
        else:
            running = self.running

        # 1. Running requests, in order: decodes take 1 token, a chunked prefill what is left.
        i = 0
        while i < len(running):
            if budget == 0:
                reason = "token_budget"
                break
            r = running[i]
            c = r.num_computed
            n = r.num_tokens - c
            if n > budget:
                n = budget
            need = -(-(c + n) // bs) - len(r.blocks)
            if need > 0:
                new = pool.get_new_blocks(need)
                while new is None:
                    assert not fast, "fast path planned blocks that are not free"
                    if policy.relieve_pressure(now_s, len(running) - 1):
                        new = pool.get_new_blocks(need)
                        continue
                    victim = policy.preemption_victim(running)
                    vi = running.index(victim)
                    del running[vi]
                    if vi < i:  # already in this step's batch: take it back out
                        k = scheduled_reqs.index(victim)
                        vn = scheduled_num_tokens[k]
                        del scheduled_reqs[k], scheduled_num_tokens[k]
                        budget += vn
                        vc = victim.num_computed
                        if victim.num_output and vc == victim.num_tokens - 1:
                            num_decode_seqs -= 1
                            decode_context_tokens -= vc
                        else:
                            num_prefill_tokens -= vn
                            num_prefill_seqs -= 1
                            prefill_context_tokens -= vc
                        i -= 1
                    self._preempt(victim)
                    num_preempted += 1
                    if victim is r:
                        break
                    new = pool.get_new_blocks(need)
                if new is None:
                    # r itself was preempted (nothing else was left to preempt): like vLLM, stop
                    # scheduling running requests for this step.
                    reason = "no_blocks"
                    break
                r.blocks.extend(new)
            scheduled_reqs.append(r)
            scheduled_num_tokens.append(n)
            budget -= n
            if r.num_output and n == 1 and c == r.num_tokens - 1:
                num_decode_seqs += 1
                decode_context_tokens += c
            else:
                # vLLM caches a request's full blocks when it allocates them (schedule time), so a
                # request admitted later in this same pass can hit blocks this step computes.
                self._cache_full_blocks(r, c + n)
                num_prefill_tokens += n
                num_prefill_seqs += 1
                prefill_context_tokens += c
                if c + n == r.num_tokens:
                    extra_s += policy.on_prefill_complete(r, c + n)
            i += 1

        # 2. Waiting requests, only if nothing was preempted (vLLM: preemption means no room).
        if num_preempted:
            reason = reason or "preempted"
        else:
            queue = self.queue
            max_seqs = cfg.max_num_seqs
            running = self.running
            while True:
                if budget == 0:
                    reason = "token_budget"
                    break
                if not queue:
                    reason = reason or ("waiting_on_load" if self.loading else "queue_empty")
                    break
                if len(running) >= max_seqs:
                    reason = "max_seqs"
                    break
                r = queue.peek()
                admitted = self._admit(r, budget, now_s)
                if admitted is None:
                    if policy.relieve_pressure(now_s, len(running)) or self._release_loaded(len(running)):
                        continue
                    reason = "no_blocks"
                    break
                n, h, e, load_s = admitted
                hit_tokens += h
                pool_tokens += e
                extra_s += load_s
                if n == 0:
                    continue  # an asynchronous load started; the request waits for it
                c = r.num_computed
                scheduled_reqs.append(r)
                scheduled_num_tokens.append(n)
                budget -= n
                num_prefill_tokens += n
                num_prefill_seqs += 1
                prefill_context_tokens += c
                if c + n == r.num_tokens:
                    extra_s += policy.on_prefill_complete(r, c + n)

        self._step_fast = fast
        if not fast:
            self._prefilling = list(self.running)  # the group is empty in exact mode
        self._pass_preempted = num_preempted
        if not scheduled_reqs and not num_decode_seqs:
            # NOTE: a pass that only preempted (the last running request evicted itself) schedules
            # nothing; like vLLM's next engine iteration, try_step runs another pass at once.
            self.result.num_preemptions += num_preempted
            self._check_step(budget)
            return None
        dur_s = self.step_cost.step_s(
            num_prefill_tokens=num_prefill_tokens, num_prefill_seqs=num_prefill_seqs,
            prefill_context_tokens=prefill_context_tokens, num_decode_seqs=num_decode_seqs,
            decode_context_tokens=decode_context_tokens) + extra_s
        res = self.result
        res.num_steps += 1
        res.num_preemptions += num_preempted
        if cfg.record_steps:
            res.steps.append((
                res.num_steps, now_s, dur_s, num_prefill_tokens, num_decode_seqs, num_prefill_seqs, num_decode_seqs,
                len(self.running),
                len(self.queue) + len(self.loading), pool.num_used_blocks, policy.num_pinned_blocks(),
                pool.num_cached_free, pool.num_total_blocks, policy.pool_used_blocks(), policy.pool_total_blocks(),
                reason, num_preempted, hit_tokens, pool_tokens,
            ))
        if self._progress and not res.num_steps & 511:
            self._progress(self._num_jobs_done, len(self.jobs), now_s)
        return dur_s

    def _check_step(self, budget: int) -> None:
        assert 0 <= budget <= self.config.max_num_batched_tokens, budget
        assert len(self.running) <= self.config.max_num_seqs, len(self.running)

    def _admit(self, r: Request, budget: int, now_s: float) -> tuple[int, int, int, float] | None:
        """Try to move the head of the waiting queue into the running batch.

        Returns ``(tokens scheduled now, GPU hit tokens, connector tokens, seconds added to the
        step)``, or None when the blocks it needs are not free (the request stays queued).
        """
        pool, policy, bs = self.pool, self.policy, self.block_size
        h = e = 0
        hit_blocks: list[int] = []
        if r.status == Status.WAITING:
            max_tokens = (r.num_tokens - 1) // bs * bs  # hit capped at known tokens - 1, whole blocks
            hit_blocks = self._prefix_hit(r, max_tokens)
            h = len(hit_blocks) * bs
            e = policy.external_hit(r, h, max_tokens) if h < max_tokens else 0
            c0 = h + e
            is_async = bool(e) and policy.asynchronous_load
            n = 0 if is_async else min(r.num_tokens - c0, budget)
            need = -(-(c0 + n) // bs) - len(hit_blocks)
            # vLLM's admission gate (scheduler_reserve_full_isl, on by default): the free blocks must
            # hold the request's whole known sequence, not only its first chunk.
            gate = -(-r.num_tokens // bs) - len(hit_blocks) if self.config.reserve_full_sequence else need
            if gate > pool.num_free_blocks:
                return None
            if not policy.holds_blocks(r.job_state):
                # NOTE(perf): only shared system-prompt blocks can be in use by others (a job runs one
                # turn at a time), so at least k − system blocks of the hit are free: a cheap bound
                # that rejects a queue head retried every step without counting its whole prefix.
                used_max = min(len(hit_blocks), r.job_state.job.system_tokens // bs)
                if gate + len(hit_blocks) - used_max > pool.num_free_blocks:
                    return None
            free_hits = pool.count_free(hit_blocks)  # touching takes them off the free queue
            if gate + free_hits > pool.num_free_blocks:
                return None
            r.hit_memo = None  # admitted: the blocks become the request's own
            self.queue.pop()
            pool.touch(hit_blocks)
            r.blocks = hit_blocks + pool.get_new_blocks(need)
            r.num_cached_blocks = len(hit_blocks)
            r.hit_tokens = min(h, r.prompt_tokens)
            r.pool_hit_tokens = min(c0, r.prompt_tokens) - r.hit_tokens
            r.prompt_computed_tokens = 0
            r.num_computed = h
            if not is_async:
                self._cache_full_blocks(r, c0 + n)  # at schedule time, as vLLM (see the running loop)
            if r.first_scheduled_s is None:
                r.first_scheduled_s = now_s
            load_s = 0.0
            if e:
                load = policy.load_external(r, h, e, now_s)
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
            need = -(-(c0 + n) // bs) - len(r.blocks)
            if need > pool.num_free_blocks:
                return None
            self.queue.pop()
            if need > 0:
                r.blocks.extend(pool.get_new_blocks(need))
            self._cache_full_blocks(r, c0 + n)
            load_s = 0.0
        r.status = Status.RUNNING
        r.job_state.waiting_request = None
        r.run_pos = next(self._run_pos)
        self.running.append(r)
        self._prefilling.append(r)
        policy.on_admitted(r, now_s)
        return n, h, e, load_s

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
        self.pool.free_blocks(victim.blocks, True)
        victim.blocks = []
        victim.num_computed = 0
        victim.num_cached_blocks = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.result.num_preemptions += 1
        return True

    def _prefix_hit(self, r: Request, max_tokens: int) -> list[int]:
        """Cached blocks along the request's hash chain, from block 0 until the first miss.

        NOTE(perf): a queue head that cannot be admitted is looked up again every step, and its
        chain can be thousands of blocks. The last result is kept on the request with a position
        in the pool's eviction log; a repeat lookup only truncates it at the first block evicted
        since (a cached block is never replaced while cached, so the others are unchanged), then
        extends it block by block as a fresh lookup would.
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
                cut = len(out)
                for h in pool.evicted_since(r.hit_log_pos):
                    i = index.get(h)
                    if i is not None and i < cut:
                        cut = i
                del out[cut:]
        if len(out) < num:
            out.extend(pool.lookup(hashes, len(out), num))
        r.hit_memo = out
        r.hit_log_pos = num_evicted
        return out

    def _preempt(self, r: Request) -> None:
        """Preemption by recompute: free the blocks (they stay cached), requeue at the front."""
        self.pool.free_blocks(r.blocks, True)
        r.blocks = []
        r.num_computed = 0
        r.num_cached_blocks = 0
        r.num_recomputed_tokens += r.num_admission_tokens
        r.num_admission_tokens = 0
        r.prompt_computed_tokens = 0
        r.num_preemptions += 1
        r.status = Status.WAITING
        self.queue.prepend(r)

    def _cache_full_blocks(self, r: Request, num_tokens: int | None = None) -> None:
        """Give the request's blocks that are full at ``num_tokens`` (default: its computed tokens)
        their hashes (``BlockPool.cache_full_blocks`` semantics)."""
        full = (r.num_computed if num_tokens is None else num_tokens) // self.block_size
        if full > r.num_cached_blocks:
            self.pool.cache_blocks(r.blocks, r.job_state.block_hashes(full), r.num_cached_blocks, full)
            r.num_cached_blocks = full

    # --- step completion ----------------------------------------------------------------------
    def _finish_step(self, now_s: float) -> None:
        """Apply the step in flight: computed tokens, sampled tokens, finished turns."""
        g = self._g
        bs = self.block_size
        finished = None
        joined = None
        for r, n in zip(self._sched_reqs, self._sched_n):
            c = r.num_computed
            if r.num_output and n == 1 and c == r.num_tokens - 1:
                # A decode outside the group (exact mode): one token, a full block every bs steps.
                c += 1
                r.num_computed = c
                r.num_admission_tokens += 1
                if not c % bs:
                    self._cache_full_blocks(r)
            else:
                p = r.prompt_tokens
                if c < p:
                    r.prompt_computed_tokens += (c + n if c + n < p else p) - c
                c += n
                r.num_computed = c
                r.num_admission_tokens += n
                # (its full blocks were hashed when the scheduler allocated them)
                if c < r.num_tokens:
                    continue  # a chunk of a longer prefill: nothing sampled yet
            r.num_output += 1
            r.num_tokens += 1
            if r.first_token_s is None:
                r.first_token_s = now_s
            if r.num_output == r.output_tokens:
                if finished is None:
                    finished = []
                finished.append(r)
            elif self._step_fast:
                if joined is None:
                    joined = []
                joined.append(r)
        if self._step_fast:
            for r in self._fin_due.pop(g, ()):
                self._materialize(r, g + 1)
                del self._dec[r.seq]
                self._lag_sum -= r.lag
                if r.run_pos == self._dec_max_pos:
                    self._dec_max_pos_dirty = True
                if finished is None:
                    finished = []
                finished.append(r)
            if joined:
                for r in joined:
                    self._join_decode_group(r, g + 1)
        if finished:
            for r in finished:
                self._finish_turn(r, now_s)
            self.running[:] = [r for r in self.running if r.status == Status.RUNNING]
        if not self._step_fast or finished or joined:
            if not self._step_fast:  # exact mode: every decoding request joins the group
                for r in self.running:
                    if r.num_output and r.num_computed == r.num_tokens - 1:
                        self._join_decode_group(r, g + 1)
            dec = self._dec
            self._prefilling = [r for r in self.running if r.seq not in dec]
        self._g = g + 1
        self._check_step(0)

    def _finish_turn(self, r: Request, now_s: float) -> None:
        r.status = Status.FINISHED
        r.finish_s = now_s
        if self.policy.on_turn_finish(r, now_s):
            self.pool.free_blocks(r.blocks, True)
        r.blocks = []
        js = r.job_state
        scheduled = r.num_recomputed_tokens + r.num_admission_tokens
        # a finished turn was scheduled and generated its first token
        assert r.first_token_s is not None and r.first_scheduled_s is not None
        self.result.turns.append((
            js.job.job_id, r.turn, r.arrival_s, r.first_scheduled_s, r.first_token_s, now_s,
            r.first_token_s - r.arrival_s, r.first_scheduled_s - r.arrival_s, r.prompt_tokens, r.hit_tokens,
            r.pool_hit_tokens, r.prompt_computed_tokens, r.output_tokens, r.num_preemptions,
            r.num_recomputed_tokens, scheduled,
        ))
        turns = js.job.turns
        if r.turn + 1 < len(turns):
            self.push(ArrivalEvent, now_s + turns[r.turn].tool_s, js, r.turn + 1)
        else:
            js.finish_s = now_s
            self._num_jobs_done += 1
            self.result.jobs.append((js.job.job_id, js.job.prefix_group, js.job.arrival_s, now_s,
                                     now_s - js.job.arrival_s, len(turns)))

    # --- estimates for policies ---------------------------------------------------------------
    def estimate_prefill_s(self, num_tokens: int) -> float:
        """Seconds to recompute ``num_tokens`` of context alone, in budget-sized chunks."""
        key = (num_tokens + 255) >> 8  # 256-token resolution is plenty for a TTL decision
        t = self._prefill_memo.get(key)
        if t is None:
            t, done, left = 0.0, 0, key << 8
            chunk = self.config.max_num_batched_tokens
            while left > 0:
                n = min(chunk, left)
                t += self.step_cost.step_s(num_prefill_tokens=n, num_prefill_seqs=1, prefill_context_tokens=done,
                                           num_decode_seqs=0, decode_context_tokens=0)
                done += n
                left -= n
            self._prefill_memo[key] = t
        return t
