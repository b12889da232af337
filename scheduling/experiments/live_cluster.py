"""Live replicas behind the router: N real vLLM engines on this host, one process each, and the
project's own router classes in front of them (``replay --engine vllm --replicas N --router R``).

The closed loop of the single-engine live replay (scheduling.experiments.live), with routing: a
job's turn k is sent when it arrives (the job's arrival; turn k-1's finish plus its tool gap), with
the prompt an agent would send (its group's system prompt, every earlier input and the tokens the
model really generated, its new input), to the replica the router picks. The router sees what a
real one sees (scheduling.cluster.view): its own traffic, each replica's load as that replica last
reported it after a step (waiting, running, KV blocks in use; what a scrape of its metrics would
read), and its own record of the prefixes it sent where.

Each replica is ``vllmref.worker_serve``: a real vLLM V1 engine (the recording scheduler, prefix
caching on) fed over a pipe, not an HTTP server: on two cores the API server processes would take
CPU from the engines they front. Times are the system's monotonic clock, the same in every
process; the records become the tables a replay writes, with a ``replica`` column, and a
``cluster`` block in the summary.
"""
from __future__ import annotations

import heapq
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd

from common.errors import ConfigError
from scheduling.experiments.live import LiveReplayConfig, result_from_records, validate
from scheduling.experiments.replay import ReplayResult
from scheduling.slo.spec import DEFAULT_SLO, SLOSpec
from scheduling.workload.traces import Job

READY_TIMEOUT_S = 900.0  # engines start one after another on a loaded 2-core host: minutes


@dataclass(frozen=True)
class LiveClusterConfig(LiveReplayConfig):
    """A live replay's settings (one engine's, for every replica) plus the router's."""

    replicas: int = 2
    router: str = "round-robin"
    router_params: dict = field(default_factory=dict)
    stats_interval_s: float = 0.0
    prefix_ttl_s: float = 120.0


def run_live_cluster(jobs: Sequence[Job], config: LiveClusterConfig, *, progress: Callable[[str], None] | None = None,
                     slo: SLOSpec = DEFAULT_SLO) -> ReplayResult:
    from common.model_config import load_model_config
    from scheduling.cluster.routers import make_router
    from vllmref import env

    validate(config, jobs)
    if config.policy != "fcfs":
        raise ConfigError("--engine vllm with --replicas serves fcfs on each replica")
    router = make_router(config.router, config.replicas, config.router_params, seed=config.seed)
    model_dir, real_weights, _ = env.resolve_model(config.model)
    cfg = load_model_config(config.model)
    spec = {"vocab_size": cfg.vocab_size, "seed": config.seed,
            "engine": config.engine_spec(model_dir, real_weights=real_weights,
                                         longest_tokens=max(j.total_tokens() for j in jobs),
                                         num_gpu_blocks=config.num_gpu_blocks)}
    kv_gib = config.num_gpu_blocks * config.block_size * cfg.kv_bytes_per_token(4) / (1 << 30)
    with tempfile.TemporaryDirectory(prefix="gpubench-cluster-") as tmp, env.vllmref_path() as pythonpath:
        procs = [env.spawn_worker("worker_serve", spec, Path(tmp), threads=config.threads,
                                  kv_cache_gib=max(1.0, kv_gib * 1.25), pythonpath=pythonpath)
                 for _ in range(config.replicas)]
        try:
            loop = _Loop(jobs, config, router, procs, cfg.vocab_size, progress)
            facts = loop.wait_ready(Path(tmp))
            t0 = time.perf_counter()
            records = loop.run(t0)
            wall_s = time.perf_counter() - t0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    result = result_from_records([{"kind": "engine", **facts[0]}, *records], jobs, config, wall_s=wall_s, slo=slo)
    return _with_replicas(result, loop, facts, router)


class _Loop:
    """The closed loop: arrivals, routing, the replicas' events."""

    def __init__(self, jobs: Sequence[Job], config: LiveClusterConfig, router, procs: list, vocab_size: int,
                 progress: Callable[[str], None] | None) -> None:
        from scheduling.cluster.view import ClusterView, ReplicaLoad
        from scheduling.engine.request import JobState

        self.jobs, self.config, self.router, self.procs = list(jobs), config, router, procs
        self.vocab_size, self.progress = vocab_size, progress
        n = len(procs)
        self.view = ClusterView(n, prefix_capacity_blocks=[config.num_gpu_blocks] * n,
                                prefix_ttl_s=config.prefix_ttl_s, stats_interval_s=config.stats_interval_s)
        self.loads = [ReplicaLoad(0, 0, 0, config.num_gpu_blocks)] * n
        self.reported_s = 0.0  # when a replica last reported its load (seconds since the replay began)
        self.states = [JobState(j, i, config.block_size) for i, j in enumerate(jobs)]  # the router's block hashes
        self.events: queue.Queue = queue.Queue()
        for k, p in enumerate(procs):
            threading.Thread(target=self._read, args=(k, p), daemon=True).start()
        self.history: dict[int, list[int]] = {}
        self.inflight: dict[str, dict] = {}
        self.replica_of: dict[tuple[str, int], int] = {}
        self.step_replicas: list[int] = []

    def _read(self, k: int, proc) -> None:
        import json

        for line in proc.stdout:
            if line.startswith("{"):
                self.events.put((k, json.loads(line)))
        self.events.put((k, {"ev": "exit", "code": proc.wait()}))

    def wait_ready(self, logs: Path) -> list[dict]:
        facts: dict[int, dict] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(facts) < len(self.procs):
            try:
                k, ev = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise ConfigError(f"the vLLM replicas did not start within {READY_TIMEOUT_S:.0f} s") from None
            if ev["ev"] == "exit":
                tail = [ln for f in logs.glob("*.log") for ln in f.read_text(errors="replace").splitlines() if ln.strip()]
                raise ConfigError(f"vLLM replica {k} exited while starting (code {ev['code']}): "
                                  f"{tail[-1][:300] if tail else 'no output'}")
            if ev["ev"] == "ready":
                facts[k] = ev
                if self.progress:
                    self.progress(f"replica {k} ready ({len(facts)}/{len(self.procs)})")
        return [facts[k] for k in range(len(self.procs))]

    def _send(self, k: int, command: dict) -> None:
        import json

        stdin = self.procs[k].stdin
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def _route(self, arrival_s: float, j: int, turn: int, now_s: float) -> None:
        from scheduling.cluster.view import TurnToRoute
        from vllmref.worker_replay import token_ids

        job, seed = self.jobs[j], self.config.seed
        if turn == 0:
            self.history[j] = token_ids(f"system:{job.prefix_group}", job.system_tokens, seed=seed, vocab_size=self.vocab_size)
        spec = job.turns[turn]
        prompt = self.history[j] + token_ids(f"input:{job.job_id}:{turn}", spec.input_tokens, seed=seed,
                                             vocab_size=self.vocab_size)
        self.history[j] = prompt
        blocks = len(prompt) // self.config.block_size
        req = TurnToRoute(job.job_id, turn, len(prompt), self.states[j].block_hashes(blocks)[:blocks])
        if self.router.scrapes_loads and self.view.needs_scrape(now_s) and self.reported_s > self.view.scraped_s:
            # only numbers a replica reported since the router last read them are new to it (vLLM's
            # balancer keeps counting what it sent until its engines publish again)
            self.view.set_loads(list(self.loads), self.reported_s)
        k = self.router.route(req, self.view, now_s)
        self.view.sent(k, req, now_s)
        req_id = f"{j}#{turn}"
        self.inflight[req_id] = {"job": j, "turn": turn, "replica": k, "blocks": blocks, "arrival_s": arrival_s,
                                 "sent_s": now_s, "prompt_tokens": len(prompt), "first_scheduled_s": None,
                                 "first_token_s": None, "scheduled_tokens": 0, "num_preemptions": 0,
                                 "scheduler_hit_tokens": None}
        self.replica_of[(job.job_id, turn)] = k
        self._send(k, {"op": "add", "id": req_id, "prompt": prompt, "n_out": spec.output_tokens})

    def run(self, t0: float) -> list[dict]:
        from scheduling.cluster.view import ReplicaLoad

        heap = [(j.arrival_s, i, 0) for i, j in enumerate(self.jobs)]
        heapq.heapify(heap)
        records: list[dict] = []
        jobs_done = 0
        while heap or self.inflight:
            now = time.perf_counter() - t0
            while heap and heap[0][0] <= now:
                arrival_s, j, turn = heapq.heappop(heap)
                self._route(arrival_s, j, turn, now)
            wait = min(heap[0][0] - now, 0.5) if heap else 0.5
            try:
                k, ev = self.events.get(timeout=max(wait, 0.0))
            except queue.Empty:
                continue
            kind = ev["ev"]
            if kind == "exit":
                raise ConfigError(f"vLLM replica {k} exited during the replay (code {ev['code']})")
            if kind == "load":
                self.loads[k] = ReplicaLoad(int(ev["waiting"]), int(ev["running"]), int(ev["kv_used_blocks"]),
                                            int(ev["kv_total_blocks"]))
                self.reported_s = ev["t"] - t0
            elif kind == "step":
                records.append(self._step_record(ev, t0))
                self.step_replicas.append(k)
            elif kind == "first":
                self.inflight[ev["id"]]["first_token_s"] = ev["t"] - t0
            elif kind == "done":
                st = self.inflight.pop(ev["id"])
                j, turn = st["job"], st["turn"]
                job = self.jobs[j]
                end_s = ev["t"] - t0
                self.history[j] = self.history[j] + list(ev["tokens"])
                self.view.finished(k, st["blocks"])
                records.append({"kind": "turn", "job_id": job.job_id, "prefix_group": job.prefix_group, "finish_s": end_s,
                                "output_tokens": len(ev["tokens"]), "hit_tokens": int(ev["cached_tokens"]), "priority": 0,
                                **{key: st[key] for key in ("turn", "arrival_s", "sent_s", "prompt_tokens",
                                                            "first_scheduled_s", "first_token_s", "scheduled_tokens",
                                                            "num_preemptions", "scheduler_hit_tokens")}})
                if turn + 1 < job.num_turns:
                    heapq.heappush(heap, (end_s + job.turns[turn].tool_s, j, turn + 1))
                else:
                    jobs_done += 1
                    if self.progress:
                        self.progress(f"{jobs_done}/{len(self.jobs)} jobs, {end_s:.1f} s")
        for k in range(len(self.procs)):
            self._send(k, {"op": "stop"})
        return records

    def _step_record(self, ev: dict, t0: float) -> dict:
        """The step as the single-engine live replay records it; the first scheduling of each turn."""
        from vllmref.worker_replay import account_step

        rec = {key: v for key, v in ev.items() if key != "ev"}
        rec["t_start"] -= t0
        rec["t_end"] -= t0
        hit = account_step(rec, self.inflight)
        rec.update(kind="step", step=len(self.step_replicas) + 1, num_prefix_hit_tokens=hit)
        return rec


def _with_replicas(result: ReplayResult, loop: _Loop, facts: list[dict], router) -> ReplayResult:
    """The replica of every turn and step, and the summary's ``cluster`` block."""
    turns = result.turns
    turns["replica"] = [loop.replica_of[(j, t)] for j, t in zip(turns["job_id"], turns["turn"])]
    result.steps["replica"] = loop.step_replicas
    from scheduling.cluster.results import REJECT_COLUMNS, cluster_summary

    extra = [{"steps": loop.step_replicas.count(k)} for k in range(len(facts))]
    result.summary["num_gpu_blocks"] = sum(int(f["num_gpu_blocks"]) for f in facts)
    result.summary["cluster"] = cluster_summary(turns, extra, router.name, router.params())
    result.summary["engines"] = facts
    result.rejected = pd.DataFrame(columns=list(REJECT_COLUMNS))  # a live router refuses nothing
    return result
