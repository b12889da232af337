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
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from scheduling.cluster.pd import PDSettings, PendingKV, RemotePrefill
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

    replicas: list[EngineResult]                  # the decode (or aggregated) instances
    prefill: list[EngineResult] = field(default_factory=list)  # the prefill instances, when disaggregated
    routed: list = field(default_factory=list)    # (job_id, turn, time_s, replica, prefill replica or -1)
    rejected: list = field(default_factory=list)  # (job_id, turn, time_s, replica it picked)
    prefill_turns: list = field(default_factory=list)  # (job_id, turn, replica, first_scheduled_s, finish_s, hit_tokens)
    transfers: list = field(default_factory=list)  # (job_id, turn, bytes, start_s, seconds)
    wall_s: float = 0.0
    sim_time_s: float = 0.0


class ReplicaEngine(Engine):
    """An engine whose next turns and finished turns go through the cluster; on a decode instance of
    a disaggregated cluster, its tokens beyond the GPU hit come from the prefill instance."""

    def __init__(self, cluster: "Cluster", index: int, config: EngineConfig, policy: KVPolicy,
                 step_cost: StepCost, remote: RemotePrefill | None = None) -> None:
        super().__init__([], config, policy, step_cost)
        self.cluster = cluster
        self.index = index
        self.remote = remote
        if remote is not None:
            self.external = remote

    def on_arrival(self, js: JobState, turn: int, now_s: float) -> None:
        super().on_arrival(js, turn, now_s)
        pending = self.remote.pending.get((js.index, turn)) if self.remote is not None else None
        if pending is not None:  # handed over by a prefill instance: the turn arrived at the router
            js.waiting_request.arrival_s = pending.arrival_s  # type: ignore[union-attr]

    def next_turn(self, js: JobState, turn: int, time_s: float) -> None:
        self.cluster.turn_later(js, turn, time_s)

    def _finish_turn(self, r: Request, now_s: float) -> None:
        super()._finish_turn(r, now_s)
        if self.remote is not None:
            self.remote.pending.pop((r.job_state.index, r.turn), None)
        self.cluster.turn_finished(r)


class PrefillEngine(ReplicaEngine):
    """A prefill instance: it computes a turn's prompt and one token, then hands the turn on."""

    def on_arrival(self, js: JobState, turn: int, now_s: float) -> None:
        super().on_arrival(js, turn, now_s)
        js.waiting_request.output_tokens = 1  # type: ignore[union-attr]

    def _finish_turn(self, r: Request, now_s: float) -> None:
        self._release_turn(r, now_s)
        self.cluster.prefill_done(self.index, r, now_s)


class Cluster:
    """``len(policies)`` replicas of one engine config and step cost behind ``router``; with ``pd``,
    they are decode instances and ``pd.prefill_replicas`` prefill instances come before them.

    Args:
        jobs: the workload (arrival times set).
        config, step_cost: every replica's sizes and step time.
        policies: one fresh policy per replica (``pd``: per decode, then per prefill instance).
        router: a fresh router (scheduling.cluster.routers.make_router); ``pd``: the decode
            instances' router, with ``prefill_router`` for the prefill instances.
        stats_interval_s: how often the router's view of the replicas' load is refreshed (0: at
            every routing).
        prefix_ttl_s: how long the router trusts a prefix it sent somewhere.
        max_outstanding: turns in flight on one replica beyond which the router refuses a turn.
        pd, kv_bytes_per_token, num_layers: disaggregation (scheduling.cluster.pd) and what its
            transfers move.
        progress: ``callback(num_jobs_done, num_jobs, now_s)``, every 64 routed turns.
    """

    def __init__(self, jobs: Sequence[Job], config: EngineConfig, step_cost: StepCost, policies: list[KVPolicy],
                 router: Router, *, stats_interval_s: float = 0.0, prefix_ttl_s: float = 120.0,
                 max_outstanding: int | None = None, pd: PDSettings | None = None, prefill_router: Router | None = None,
                 num_layers: int = 1, progress: Callable[[int, int, float], None] | None = None) -> None:
        self.config = config
        self.jobs = [JobState(j, i, config.block_size) for i, j in enumerate(jobs)]
        num_decode = len(policies) - (pd.prefill_replicas if pd else 0)
        self.result = ClusterResult([])
        self.pd = pd
        dcfg = replace(config, prefix_caching=pd.caches("decode")) if pd else config
        self.engines = [ReplicaEngine(self, k, dcfg, p, step_cost, self._remote(pd, config, num_layers))
                        for k, p in enumerate(policies[:num_decode])]
        pcfg = replace(config, prefix_caching=pd.caches("prefill")) if pd else config
        self.prefill_engines = [PrefillEngine(self, k, pcfg, p, step_cost) for k, p in enumerate(policies[num_decode:])]
        self.result.replicas = [e.result for e in self.engines]
        self.result.prefill = [e.result for e in self.prefill_engines]
        self.router, self.prefill_router = router, prefill_router
        self.view = ClusterView(num_decode, prefix_capacity_blocks=[config.num_gpu_blocks] * num_decode,
                                prefix_ttl_s=prefix_ttl_s, stats_interval_s=stats_interval_s)
        n_p = len(self.prefill_engines)
        self.prefill_view = ClusterView(n_p, prefix_capacity_blocks=[config.num_gpu_blocks] * n_p,
                                        prefix_ttl_s=prefix_ttl_s, stats_interval_s=stats_interval_s)
        self.max_outstanding = max_outstanding
        self._arrivals: list = []  # (time_s, seq, job state, turn): turns not routed yet
        self._seq = itertools.count()
        self._current: ReplicaEngine | None = None
        gaps = [t.tool_s for j in jobs for t in j.turns[:-1]]
        self._min_gap_s = min(gaps) if gaps else math.inf
        self._progress = progress
        self._done = 0
        self._turn_blocks: dict[tuple[int, int], int] = {}  # (job, turn) in flight -> its prompt blocks
        self._decode_of: dict[tuple[int, int], int] = {}    # (job, turn) on a prefill instance -> its decode instance
        self._replica_of: dict[tuple[int, int], int] = {}   # (job, turn) in flight -> its decode (or only) instance

    def _remote(self, pd: PDSettings | None, config: EngineConfig, num_layers: int) -> RemotePrefill | None:
        return RemotePrefill(pd, config.kv_bytes_per_token, num_layers, self.result.transfers,
                             config.block_size) if pd else None

    # --- what the engines call ----------------------------------------------------------------
    def turn_later(self, js: JobState, turn: int, time_s: float) -> None:
        heapq.heappush(self._arrivals, (time_s, next(self._seq), js, turn))
        cur = self._current
        if cur is not None and time_s < cur.horizon_s:
            cur.horizon_s = time_s

    def turn_finished(self, r: Request) -> None:
        key = (r.job_state.index, r.turn)
        self.view.finished(self._replica_of.pop(key), self._turn_blocks.pop(key))
        if r.turn + 1 == r.job_state.job.num_turns:
            self._done += 1

    def prefill_done(self, replica: int, r: Request, now_s: float) -> None:
        """A prefill instance computed a turn's prompt: hand the turn to its decode instance."""
        js, key = r.job_state, (r.job_state.index, r.turn)
        self.prefill_view.finished(replica, self._turn_blocks[key])
        self.result.prefill_turns.append((js.job.job_id, r.turn, replica, r.first_scheduled_s, now_s, r.hit_tokens))
        pd, d = self.pd, self.engines[self._decode_of.pop(key)]
        assert pd is not None and d.remote is not None
        pending = PendingKV(r.arrival_s, r.first_scheduled_s if r.first_scheduled_s is not None else now_s, now_s,
                            r.prompt_tokens)
        d.remote.pending[key] = pending
        arrive_s = now_s
        if pd.files is not None:  # the prefill instance's write of the whole-block prompt, if no file of it exists
            seconds = d.remote.write_file_s(r)
            if seconds:
                self.result.transfers.append((js.job.job_id, r.turn, 0, now_s, seconds))
            arrive_s = now_s + seconds
        elif pd.reserve == "after":  # pushed whole to a staging buffer: the turn arrives when it is there
            num_bytes = (r.prompt_tokens - 1) // self.config.block_size * self.config.block_size * self.config.kv_bytes_per_token
            seconds = d.remote.transfer_left_s(num_bytes, pending, now_s)
            self.result.transfers.append((js.job.job_id, r.turn, num_bytes, now_s, seconds))
            arrive_s = now_s + seconds
        d.push(ArrivalEvent, arrive_s, js, r.turn)

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> ClusterResult:
        t0 = time.perf_counter()
        for js in sorted(self.jobs, key=lambda j: (j.job.arrival_s, j.index)):
            heapq.heappush(self._arrivals, (js.job.arrival_s, next(self._seq), js, 0))
        engines: list[ReplicaEngine] = [*self.engines, *self.prefill_engines]
        # after an event of a decode instance, a turn can reach another instance no sooner than the
        # shortest tool gap; a prefill instance hands its turn to a decode instance at once
        gaps = [self._min_gap_s] * len(self.engines) + [0.0] * len(self.prefill_engines)
        arrivals = self._arrivals
        now = 0.0
        while True:
            # the engine whose event is next, and the two earliest times a turn can reach an engine
            first, first_t, first_prio = None, math.inf, 0
            reach = [math.inf, math.inf]  # the two smallest (next event + gap), over all engines
            reach_of = -1                 # the engine with the smallest
            for i, (e, gap) in enumerate(zip(engines, gaps)):
                t, prio = e.next_event()
                if t < first_t or (t == first_t and prio < first_prio):
                    first, first_t, first_prio = e, t, prio
                r = t + gap
                if r < reach[0]:
                    reach, reach_of = [r, reach[0]], i
                elif r < reach[1]:
                    reach[1] = r
            arrival_t = arrivals[0][0] if arrivals else math.inf
            if arrival_t < first_t or (arrival_t == first_t and first_prio > EventPriority.ARRIVAL):
                now = arrival_t
                _, _, js, turn = heapq.heappop(arrivals)
                self._route(js, turn, now)
                continue
            if first is None or first_t == math.inf:
                break
            now = first_t
            others = reach[1] if reach_of >= 0 and engines[reach_of] is first else reach[0]
            first.horizon_s = min(arrival_t, others)
            self._current = first
            first.process_next()
            self._current = None
        self.result.wall_s = time.perf_counter() - t0
        self.result.sim_time_s = now
        for e in engines:
            e.result.sim_time_s = e.now_s
            e.result.policy_stats = e.policy.stats()
            e.result.num_evicted_blocks = e.kv.pool.num_evictions
        abandoned = {job_id for job_id, *_ in self.result.rejected}
        left = [js.job.job_id for js in self.jobs if js.finish_s is None and js.job.job_id not in abandoned]
        if left:  # a cluster bug, not a user error: say which jobs
            raise RuntimeError(f"simulation ended with {len(left)} unfinished jobs: {left[:5]}")
        if self._progress:
            self._progress(self._done + len(abandoned), len(self.jobs), now)
        return self.result

    def _route(self, js: JobState, turn: int, now_s: float) -> None:
        """A turn arrives at the router: pick its replica (and, disaggregated, its prefill instance)."""
        view, router = self.view, self.router
        prompt = js.prompt_tokens(turn)
        num_blocks = prompt // self.config.block_size
        req = TurnToRoute(js.job.job_id, turn, prompt, js.block_hashes(num_blocks)[:num_blocks])
        if router.scrapes_loads and view.needs_scrape(now_s):
            view.set_loads([_load(e) for e in self.engines], now_s)
        k = router.route(req, view, now_s)
        if self.max_outstanding is not None and view.outstanding[k] >= self.max_outstanding:
            self.result.rejected.append((js.job.job_id, turn, now_s, k))
            return
        key = (js.index, turn)
        remote = False
        if self.prefill_engines:  # what the decode instance is likely to miss, by the router's record
            missing = (num_blocks - view.prefixes[k].matched_blocks(req.block_hashes, now_s)) * self.config.block_size
            remote = missing >= self.pd.threshold_tokens  # type: ignore[union-attr]
        view.sent(k, req, now_s)
        self._turn_blocks[key], self._replica_of[key] = num_blocks, k
        p = -1
        if remote:
            pv, pr = self.prefill_view, self.prefill_router
            assert pr is not None
            if pr.scrapes_loads and pv.needs_scrape(now_s):
                pv.set_loads([_load(e) for e in self.prefill_engines], now_s)
            p = pr.route(req, pv, now_s)
            pv.sent(p, req, now_s)
            self._decode_of[key] = k
            self.prefill_engines[p].push(ArrivalEvent, now_s, js, turn)
        else:
            self.engines[k].push(ArrivalEvent, now_s, js, turn)
        self.result.routed.append((js.job.job_id, turn, now_s, k, p))
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
