"""N simulated engines behind a router, on one clock.

Each replica is the single-engine simulator unchanged (scheduling.engine: its own KV pool, queue and
policy); what changes is where a turn goes. A job's first turn arrives at its arrival time and each
later one when its previous turn's tool call ends, and at that moment the router picks a replica
from what it can see (scheduling.cluster.view); the turn then arrives at that engine as it would
alone. Events run in time order across engines; at one instant an engine's step end and loads come
before the router routes, as in one engine, so one replica replays exactly as the engine does.

A router may refuse a turn (``max_outstanding``: the replica it picked already has that many
turns in flight, as a router answers 503): the job is abandoned there, its rejected turn recorded.

NOTE(perf): an engine decodes a run of pure-decode steps inline until an event falls due; here an
event may come from outside (a turn routed to it), so no inline run passes the next turn arrival
known to the router, nor the earliest moment another engine could finish a turn and start a new
tool gap (its next event + the shortest tool gap of the trace).
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from scheduling.cluster.routers import Router
from scheduling.cluster.view import ClusterView, ReplicaLoad, TurnToRoute
from scheduling.engine import Engine, EngineConfig
from scheduling.engine.events import ArrivalEvent, EventPriority
from scheduling.engine.outputs import EngineResult
from scheduling.engine.request import JobState, Request
from scheduling.engine.step_cost import StepCost
from scheduling.policies.base import KVPolicy
from scheduling.workload.traces import Job


@dataclass
class ClusterResult:
    """Per-replica engine results and what the router did."""

    replicas: list[EngineResult]
    routed: list = field(default_factory=list)    # (job_id, turn, time_s, replica) per routed turn
    rejected: list = field(default_factory=list)  # (job_id, turn, time_s, replica it picked)
    wall_s: float = 0.0
    sim_time_s: float = 0.0


class ReplicaEngine(Engine):
    """An engine whose next turns and finished turns go through the cluster."""

    def __init__(self, cluster: "Cluster", index: int, config: EngineConfig, policy: KVPolicy,
                 step_cost: StepCost) -> None:
        super().__init__([], config, policy, step_cost)
        self.cluster = cluster
        self.index = index

    def next_turn(self, js: JobState, turn: int, time_s: float) -> None:
        self.cluster.turn_later(js, turn, time_s)

    def _finish_turn(self, r: Request, now_s: float) -> None:
        super()._finish_turn(r, now_s)
        self.cluster.turn_finished(self.index, r)


class Cluster:
    """``len(policies)`` replicas of one engine config and step cost behind ``router``.

    Args:
        jobs: the workload (arrival times set).
        config, step_cost: every replica's sizes and step time.
        policies: one fresh policy per replica.
        router: a fresh router (scheduling.cluster.routers.make_router).
        stats_interval_s: how often the router's view of the replicas' load is refreshed (0: at
            every routing).
        prefix_ttl_s: how long the router trusts a prefix it sent somewhere.
        max_outstanding: turns in flight on one replica beyond which the router refuses a turn.
        progress: ``callback(num_jobs_done, num_jobs, now_s)``, every 64 routed turns.
    """

    def __init__(self, jobs: Sequence[Job], config: EngineConfig, step_cost: StepCost, policies: list[KVPolicy],
                 router: Router, *, stats_interval_s: float = 0.0, prefix_ttl_s: float = 120.0,
                 max_outstanding: int | None = None, progress: Callable[[int, int, float], None] | None = None) -> None:
        self.config = config
        self.jobs = [JobState(j, i, config.block_size) for i, j in enumerate(jobs)]
        self.engines = [ReplicaEngine(self, k, config, p, step_cost) for k, p in enumerate(policies)]
        self.router = router
        self.view = ClusterView(len(policies), prefix_capacity_blocks=[config.num_gpu_blocks] * len(policies),
                                prefix_ttl_s=prefix_ttl_s, stats_interval_s=stats_interval_s)
        self.max_outstanding = max_outstanding
        self.result = ClusterResult([e.result for e in self.engines])
        self._arrivals: list = []  # (time_s, seq, job state, turn): turns not routed yet
        self._seq = itertools.count()
        self._current: ReplicaEngine | None = None
        gaps = [t.tool_s for j in jobs for t in j.turns[:-1]]
        self._min_gap_s = min(gaps) if gaps else math.inf
        self._progress = progress
        self._done = 0
        self._turn_blocks: dict[tuple[int, int], int] = {}  # (job, turn) in flight -> its prompt blocks

    # --- what the engines call ----------------------------------------------------------------
    def turn_later(self, js: JobState, turn: int, time_s: float) -> None:
        heapq.heappush(self._arrivals, (time_s, next(self._seq), js, turn))
        cur = self._current
        if cur is not None and time_s < cur.horizon_s:
            cur.horizon_s = time_s

    def turn_finished(self, replica: int, r: Request) -> None:
        self.view.finished(replica, self._turn_blocks.pop((r.job_state.index, r.turn)))
        if r.turn + 1 == r.job_state.job.num_turns:
            self._done += 1

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> ClusterResult:
        t0 = time.perf_counter()
        for js in sorted(self.jobs, key=lambda j: (j.job.arrival_s, j.index)):
            heapq.heappush(self._arrivals, (js.job.arrival_s, next(self._seq), js, 0))
        engines, arrivals = self.engines, self._arrivals
        now = 0.0
        while True:
            # the engine whose event is next, and the earliest event of any other engine
            first, first_t, first_prio, second_t = None, math.inf, 0, math.inf
            for e in engines:
                t, prio = e.next_event()
                if t < first_t or (t == first_t and prio < first_prio):
                    if first is not None:
                        second_t = min(second_t, first_t)
                    first, first_t, first_prio = e, t, prio
                elif t < second_t:
                    second_t = t
            arrival_t = arrivals[0][0] if arrivals else math.inf
            if arrival_t < first_t or (arrival_t == first_t and first_prio > EventPriority.ARRIVAL):
                now = arrival_t
                _, _, js, turn = heapq.heappop(arrivals)
                self._route(js, turn, now)
                continue
            if first is None or first_t == math.inf:
                break
            now = first_t
            first.horizon_s = min(arrival_t, second_t + self._min_gap_s)
            self._current = first
            first.process_next()
            self._current = None
        self.result.wall_s = time.perf_counter() - t0
        self.result.sim_time_s = now
        for e in engines:
            e.result.sim_time_s = e.now_s
            e.result.policy_stats = e.policy.stats()
            e.result.num_evicted_blocks = e.kv.pool.num_evictions
        left = [js.job.job_id for js in self.jobs if js.finish_s is None and js.job.job_id not in self._abandoned()]
        if left:  # a cluster bug, not a user error: say which jobs
            raise RuntimeError(f"simulation ended with {len(left)} unfinished jobs: {left[:5]}")
        if self._progress:
            self._progress(self._done + len(self.result.rejected), len(self.jobs), now)
        return self.result

    def _abandoned(self) -> set[str]:
        return {job_id for job_id, *_ in self.result.rejected}

    def _route(self, js: JobState, turn: int, now_s: float) -> None:
        view, router = self.view, self.router
        prompt = js.prompt_tokens(turn)
        hashes = js.block_hashes(prompt // self.config.block_size)[: prompt // self.config.block_size]
        req = TurnToRoute(js.job.job_id, turn, prompt, hashes)
        if router.scrapes_loads and view.needs_scrape(now_s):
            view.set_loads([_load(e) for e in self.engines], now_s)
        k = router.route(req, view, now_s)
        if self.max_outstanding is not None and view.outstanding[k] >= self.max_outstanding:
            self.result.rejected.append((js.job.job_id, turn, now_s, k))
            return
        view.sent(k, req, now_s)
        self.result.routed.append((js.job.job_id, turn, now_s, k))
        e = self.engines[k]
        e.push(ArrivalEvent, now_s, js, turn)
        self._turn_blocks[(js.index, turn)] = len(hashes)
        if self._progress and not len(self.result.routed) & 63:
            self._progress(self._done + len(self.result.rejected), len(self.jobs), now_s)


def check_cluster_settings(replicas: int, router: str, router_params: dict, *, stats_interval_s: float,
                           prefix_ttl_s: float, max_outstanding: int | None) -> None:
    """The cluster's settings (a replay config's, the CLI's, a sweep's): one ConfigError naming the first bad one."""
    from common.errors import ConfigError
    from scheduling.cluster.routers import make_router

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
    make_router(router, replicas, router_params)
    for name, v in (("stats_interval_s", stats_interval_s), ("prefix_ttl_s", prefix_ttl_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == math.inf and name != "prefix_ttl_s":
            raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
    if max_outstanding is not None and (isinstance(max_outstanding, bool) or not isinstance(max_outstanding, int)
                                        or max_outstanding < 1):
        raise ConfigError(f"max_outstanding must be an integer >= 1 (or unset), got {max_outstanding!r}")


def _load(e: Engine) -> ReplicaLoad:
    return ReplicaLoad(len(e.queue) + len(e.loading), len(e.running), e.pool.num_used_blocks, e.config.num_gpu_blocks)
