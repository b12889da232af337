"""Discrete-event simulation of a vLLM V1 engine serving multi-turn agent jobs.

The model (as in vLLM's ``Scheduler.schedule``): there is no prefill or decode phase, only
*computed* versus *known* tokens per request. Each step has one token budget
(``max_num_batched_tokens``); running requests are served first (a decode takes 1 token, a
chunked prefill takes what is left of the budget); when a running request cannot get a block,
the policy's victim (FCFS: the last running request) is preempted by recompute, in a loop; waiting
requests are admitted only if nothing was preempted in this step, up to ``max_num_seqs``, each
after a prefix-cache lookup (hit capped at known tokens − 1, whole blocks) and a connector lookup.

Events (``scheduling.engine.events``) are kept in a ``heapq`` as ``(time_s, priority, seq, event)``; ``seq``
comes from this engine's own ``itertools.count()``, so two engines never share a counter.
``run()`` returns an :class:`scheduling.engine.outputs.EngineResult`; sizes come in an
:class:`scheduling.engine.engine_config.EngineConfig`.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import Callable, Sequence

from common.errors import ConfigError
from scheduling.engine.admission import Admission
from scheduling.engine.batch_tally import BatchTally
from scheduling.engine.decode_group import DecodeGroup
from scheduling.engine.engine_config import EngineConfig  # noqa: F401 (re-exported: the engine's own config)
from scheduling.engine.events import ArrivalEvent, BlocksReleaseEvent, Event, EventPriority, LoadDoneEvent, PinExpiryEvent, ScheduleEvent  # noqa: F401 (re-exported)
from scheduling.engine.kv_manager import KVCacheManager
from scheduling.engine.outputs import JOB_COLUMNS, STEP_COLUMNS, TURN_COLUMNS, EngineResult, JobRecord, StepRecord, TurnRecord  # noqa: F401
from scheduling.engine.request import JobState, Request, Status
from scheduling.engine.step_cost import StepCost
from scheduling.engine.step_output import StepOutput
from scheduling.policies.base import KVPolicy, KVSource, PolicyContext
from scheduling.workload.traces import Job


class Engine(Admission, StepOutput, DecodeGroup):
    """One replay: jobs in, records out. Not reusable: build a new engine per run.

    This module holds the event loop and the scheduling pass; its parts live beside it, on the same
    state: admission of waiting requests (:class:`scheduling.engine.admission.Admission`), applying a
    finished step (:class:`scheduling.engine.step_output.StepOutput`) and the decode group, the one
    representation of decoding requests between steps (:class:`scheduling.engine.decode_group.DecodeGroup`).

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
        self.kv = KVCacheManager(config.num_gpu_blocks, config.block_size)
        self.pool = self.kv.pool  # for policies and the step log; the engine's blocks go through self.kv
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
        self._tally = BatchTally()
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
        # No inline decode run passes this time: an event from outside the engine may fall due then
        # (scheduling.cluster routes turns to engines that share one clock).
        self.horizon_s = math.inf
        self.external: KVSource = policy  # tokens beyond the GPU hit: the policy's pool (a cluster may set another)
        policy.attach(PolicyContext(config=config, push=self.push, free_blocks=self._free_held_blocks,
                                    estimate_prefill_s=self.estimate_prefill_s))

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
        process_next = self.process_next
        while process_next():
            pass
        self.result.wall_s = time.perf_counter() - t0
        self.result.sim_time_s = self.now_s
        self.result.policy_stats = self.policy.stats()
        self.result.num_evicted_blocks = self.kv.pool.num_evictions
        unfinished = [js.job.job_id for js in self.jobs if js.finish_s is None]
        if unfinished:  # an engine bug, not a user error: say which jobs
            raise RuntimeError(f"simulation ended with {len(unfinished)} unfinished jobs: {unfinished[:5]}")
        if self._progress:
            self._progress(self._num_jobs_done, len(self.jobs), self.now_s)
        return self.result

    def next_event(self) -> tuple[float, int]:
        """``(time, EventPriority)`` of this engine's next event (``(inf, 0)`` when it has none)."""
        end, heap = self._step_end, self._heap
        if end is not None and (not heap or end <= heap[0][0]):
            return end, EventPriority.STEP_END
        return (heap[0][0], heap[0][1]) if heap else (math.inf, 0)

    def process_next(self) -> bool:
        """Handle the next event; False when there is none."""
        # NOTE(perf): the step in flight is not on the heap: its end is the one event every step
        # has. It sorts first among events of its instant (EventPriority.STEP_END is the lowest),
        # so ``end <= heap top`` is exactly the order the heap would give.
        end, heap = self._step_end, self._heap
        if end is not None and (not heap or end <= heap[0][0]):
            self._step_end = None
            self.now_s = end
            self.on_step_end(end)
            return True
        if not heap:
            return False
        t, _, _, ev = heapq.heappop(heap)
        self.now_s = t
        ev.handle(self)
        return True

    def next_turn(self, js: JobState, turn: int, time_s: float) -> None:
        """A finished turn's tool call ends at ``time_s``: the job's next turn arrives here then (a
        cluster routes it instead)."""
        self.push(ArrivalEvent, time_s, js, turn)

    # --- event handlers -----------------------------------------------------------------------
    def on_arrival(self, js: JobState, turn: int, now_s: float) -> None:
        prompt = js.prompt_tokens(turn)
        total = prompt + js.job.turns[turn].output_tokens - 1  # the last sampled token gets no KV
        if self.kv.blocks_for(total) > self.config.num_gpu_blocks:
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
        self.kv.cache_full_blocks(req)
        req.status = Status.WAITING_LOADED
        self.queue.prepend(req)
        self.wake(now_s)

    def on_step_end(self, now_s: float) -> None:
        self._finish_step(now_s)
        self.busy = False
        heap = self._heap
        if heap and heap[0][0] <= now_s or self.horizon_s <= now_s:
            self.wake(now_s)  # other events at this instant first (the horizon: one from outside)
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
        # After the step's allocations (and an inline decode run's, which only allocate): the peak.
        pool = self.kv.pool
        held = pool.num_used_blocks + pool.num_cached_free
        if held > self.result.peak_kv_blocks:
            self.result.peak_kv_blocks = held

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
        self._sched_reqs.clear()
        self._sched_n.clear()
        tally = self._tally
        tally.reset()
        budget = self.config.max_num_batched_tokens
        if fast:  # every decode-group member gets its token; the loop below sees the rest
            tally.add_decodes(len(self._dec), self._group_step(self._g))
            budget -= len(self._dec)
        budget, reason = self._schedule_running(self._prefilling if fast else self.running, budget, fast, now_s)
        if tally.num_preempted:  # vLLM: preemption means no room, so nothing waiting is admitted
            reason = reason or "preempted"
        else:
            budget, reason = self._schedule_waiting(budget, reason, now_s)
        self._step_fast = fast
        if not fast:
            self._prefilling = list(self.running)  # the group is empty in exact mode
        self._pass_preempted = tally.num_preempted
        if not self._sched_reqs and not tally.num_decode_seqs:
            # NOTE: a pass that only preempted (the last running request evicted itself) schedules
            # nothing; like vLLM's next engine iteration, try_step runs another pass at once.
            self.result.num_preemptions += tally.num_preempted
            self._check_step(budget)
            return None
        dur_s = tally.step_s(self.step_cost)
        res = self.result
        res.num_steps += 1
        res.num_preemptions += tally.num_preempted
        if self.config.record_steps:
            self._record_step(now_s, dur_s, reason)
        if self._progress and not res.num_steps & 511:
            self._progress(self._num_jobs_done, len(self.jobs), now_s)
        return dur_s

    def _schedule_running(self, running: list[Request], budget: int, fast: bool, now_s: float) -> tuple[int, str]:
        """Running requests, in order: a decode takes 1 token, a chunked prefill what is left of the
        budget; a request that cannot get its blocks preempts the policy's victim until it can (or
        is the victim). Returns the budget left and why the loop stopped early ("" if it did not)."""
        kv, policy, tally = self.kv, self.policy, self._tally
        scheduled_reqs, scheduled_num_tokens = self._sched_reqs, self._sched_n
        i = 0
        while i < len(running):
            if budget == 0:
                return budget, "token_budget"
            r = running[i]
            c = r.num_computed
            n = r.num_tokens - c
            if n > budget:
                n = budget
            need = kv.num_new_blocks(r, c + n)
            if need > 0:
                got = kv.allocate(r, need)
                if not got:
                    self.result.num_block_shortages += 1
                while not got:
                    assert not fast, "fast path planned blocks that are not free"
                    if policy.relieve_pressure(now_s, len(running) - 1):
                        got = kv.allocate(r, need)
                        continue
                    victim = policy.preemption_victim(running)
                    vi = running.index(victim)
                    del running[vi]
                    if vi < i:  # already in this step's batch: take it back out
                        k = scheduled_reqs.index(victim)
                        vn = scheduled_num_tokens[k]
                        del scheduled_reqs[k], scheduled_num_tokens[k]
                        budget += vn
                        tally.remove(victim, vn, victim.num_computed)
                        i -= 1
                    self._preempt(victim)
                    tally.num_preempted += 1
                    if victim is r:
                        break
                    got = kv.allocate(r, need)
                if not got:
                    # r itself was preempted (nothing else was left to preempt): like vLLM, stop
                    # scheduling running requests for this step.
                    return budget, "no_blocks"
            scheduled_reqs.append(r)
            scheduled_num_tokens.append(n)
            budget -= n
            # vLLM caches a request's full blocks when it allocates them (schedule time), so a
            # request admitted later in this same pass can hit blocks this step computes.
            kv.cache_full_blocks(r, c + n)
            if not tally.add(r, n, c) and c + n == r.num_tokens:
                tally.extra_s += policy.on_prefill_complete(r, c + n)
            i += 1
        return budget, ""

    def _schedule_waiting(self, budget: int, reason: str, now_s: float) -> tuple[int, str]:
        """Waiting requests from the head of the policy's queue while the budget, max_num_seqs and
        the free blocks allow. Returns the budget left and why admission stopped."""
        queue, policy, tally, running = self.queue, self.policy, self._tally, self.running
        max_seqs = self.config.max_num_seqs
        if queue:
            policy.before_admission(now_s)
        while True:
            if budget == 0:
                return budget, "token_budget"
            if not queue:
                return budget, reason or ("waiting_on_load" if self.loading else "queue_empty")
            if len(running) >= max_seqs:
                return budget, "max_seqs"
            r = queue.peek()
            admitted = self._admit(r, budget, now_s)
            if admitted is None:
                self.result.num_block_shortages += 1
                if policy.relieve_pressure(now_s, len(running)) or self._release_loaded(len(running)):
                    continue
                return budget, "no_blocks"
            n, h, e, load_s = admitted
            tally.num_hit_tokens += h
            tally.num_pool_tokens += e
            tally.extra_s += load_s
            if n == 0:
                continue  # an asynchronous load started; the request waits for it
            c = r.num_computed
            self._sched_reqs.append(r)
            self._sched_n.append(n)
            budget -= n
            # one rule with the running loop: a re-admitted preempted request with only its
            # last token left is a decode (scheduling.engine.batch_tally)
            if not tally.add(r, n, c) and c + n == r.num_tokens:
                tally.extra_s += policy.on_prefill_complete(r, c + n)

    def _record_step(self, now_s: float, dur_s: float, reason: str) -> None:
        """Append the step just scheduled to the step log (``outputs.StepRecord``'s columns)."""
        tally, pool, policy, res = self._tally, self.kv.pool, self.policy, self.result
        res.steps.append((
            res.num_steps, now_s, dur_s, tally.num_prefill_tokens, tally.num_decode_seqs, tally.num_prefill_seqs,
            tally.num_decode_seqs, len(self.running), len(self.queue) + len(self.loading), pool.num_used_blocks,
            policy.num_pinned_blocks(), pool.num_cached_free, pool.num_total_blocks, policy.pool_used_blocks(),
            policy.pool_total_blocks(), reason, tally.num_preempted, tally.num_hit_tokens, tally.num_pool_tokens,
        ))

    def _free_held_blocks(self, blocks: list[int]) -> None:
        """A policy's blocks back to the pool, last first (PolicyContext.free_blocks)."""
        self.kv.pool.free_blocks(blocks, True)

    def _check_step(self, budget: int) -> None:
        assert 0 <= budget <= self.config.max_num_batched_tokens, budget
        assert len(self.running) <= self.config.max_num_seqs, len(self.running)

    def _preempt(self, r: Request) -> None:
        """Preemption by recompute: free the blocks (they stay cached), requeue at the front."""
        self.kv.free(r)
        r.num_computed = 0
        r.num_recomputed_tokens += r.num_admission_tokens
        r.num_admission_tokens = 0
        r.prompt_computed_tokens = 0
        r.num_preemptions += 1
        r.status = Status.WAITING
        self.queue.prepend(r)

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
                t += self.step_cost.expected().step_s(num_prefill_tokens=n, num_prefill_seqs=1,  # no jitter: a guess
                                                      prefill_context_tokens=done, num_decode_seqs=0, decode_context_tokens=0)
                done += n
                left -= n
            self._prefill_memo[key] = t
        return t
