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

With ``prefill_replicas`` P (a live prefill/decode pair), P more engines are KV producers and the
replicas KV consumers of vLLM's ExampleConnector (vllmref.kv_timing: one safetensors file per layer
under a shared directory, the only connector this CPU build can run). A turn is routed to its decode
instance, then (unless the router's record says it would miss fewer than ``pd_threshold_tokens``)
to a prefill instance with one output token, as vLLM's disaggregation proxy does; when that ends it
goes to its decode instance, which finds the producer's file as an external hit, reads it, computes
the prompt's last partial block and decodes. The connector's file I/O is synchronous inside the two
engines' steps; the workers time it, and each turn's ``kv_transfer_s`` is its share (by tokens) of
its producer step's write and its consumer step's read.
"""
from __future__ import annotations

import heapq
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from common.errors import ConfigError
from scheduling.experiments.live import LiveReplayConfig, result_from_records, validate
from scheduling.experiments.replay import ReplayResult
from scheduling.slo.spec import DEFAULT_SLO, SLOSpec
from scheduling.workload.traces import Job
from vllmref import env

READY_TIMEOUT_S = 900.0  # engines start one after another on a loaded 2-core host: minutes
LIVE_LINK = "file (vLLM ExampleConnector: safetensors per layer in a shared directory)"


@dataclass(frozen=True)
class LiveClusterConfig(LiveReplayConfig):
    """A live replay's settings (one engine's, for every replica) plus the router's."""

    replicas: int = 2
    router: str = "round-robin"
    router_params: dict = field(default_factory=dict)
    stats_interval_s: float = 0.0
    prefix_ttl_s: float = 120.0
    prefill_replicas: int = 0
    pd_threshold_tokens: int = 0
    kv_dir: str = "auto"  # where a live pair's engines exchange KV files (vllmref.env.kv_exchange_parent)


def run_live_cluster(jobs: Sequence[Job], config: LiveClusterConfig, *, progress: Callable[[str], None] | None = None,
                     slo: SLOSpec = DEFAULT_SLO) -> ReplayResult:
    from common.model_config import load_model_config
    from scheduling.cluster.routers import make_router

    validate(config, jobs)
    if config.policy != "fcfs":
        raise ConfigError("--engine vllm with --replicas serves fcfs on each replica")
    router = make_router(config.router, config.replicas, config.router_params, seed=config.seed)
    # the simulator's seeds: its prefill router draws its ties from the next seed
    prefill_router = (make_router(config.router, config.prefill_replicas, config.router_params, seed=config.seed + 1)
                      if config.prefill_replicas else None)
    model_dir, real_weights, _ = env.resolve_model(config.model)
    cfg = load_model_config(config.model)
    spec: dict[str, Any] = {"vocab_size": cfg.vocab_size, "seed": config.seed,
                            "engine": config.engine_spec(model_dir, real_weights=real_weights,
                                                         longest_tokens=max(j.total_tokens() for j in jobs),
                                                         num_gpu_blocks=config.num_gpu_blocks)}
    kv_gib = config.num_gpu_blocks * config.block_size * cfg.kv_bytes_per_token(4) / (1 << 30)
    kv_parent, kv_medium = env.kv_exchange_parent(config.kv_dir)
    with tempfile.TemporaryDirectory(prefix="gpubench-cluster-") as tmp, env.vllmref_path() as pythonpath, \
            tempfile.TemporaryDirectory(prefix="gpubench-kv-", dir=kv_parent) as kv_tmp:
        roles = ["kv_consumer" if config.prefill_replicas else None] * config.replicas
        roles += ["kv_producer"] * config.prefill_replicas
        # one spec per process, all alive until every process has started (a spec's file is named by
        # its id, which a collected dict would hand on to the next one)
        specs = [spec | {"engine": spec["engine"] | ({"kv_transfer": {"role": role, "path": str(Path(kv_tmp) / "kv")}}
                                                      if role else {})} for role in roles]
        procs = [env.spawn_worker("worker_serve", s, Path(tmp), threads=config.threads,
                                  kv_cache_gib=max(1.0, kv_gib * 1.25), pythonpath=pythonpath) for s in specs]
        try:
            loop = _Loop(jobs, config, router, procs, cfg.vocab_size, progress, prefill_router=prefill_router,
                         kv_bytes_per_token=cfg.kv_bytes_per_token(4))
            loop.kv_exchange = {"kv_dir": kv_parent, "kv_medium": kv_medium}
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
                 progress: Callable[[str], None] | None, *, prefill_router=None, kv_bytes_per_token: int = 0) -> None:
        from scheduling.cluster.view import ClusterView, ReplicaLoad

        self.jobs, self.config, self.router, self.procs = list(jobs), config, router, procs
        self.vocab_size, self.progress = vocab_size, progress
        self.prefill_router, self.kv_bytes_per_token = prefill_router, kv_bytes_per_token
        self.kv_exchange: dict = {}  # where the pair's KV files went (run_live_cluster sets it)
        n, n_p = config.replicas, config.prefill_replicas  # procs: the n decode (or only) replicas, then the prefill ones
        self.num_decode = n
        def view(m: int) -> ClusterView:
            return ClusterView(m, prefix_capacity_blocks=[config.num_gpu_blocks] * m, prefix_ttl_s=config.prefix_ttl_s,
                               stats_interval_s=config.stats_interval_s)
        self.view = view(n)
        self.prefill_view = view(n_p) if n_p else None  # the prefill side's, with prefill replicas only
        self.loads = [ReplicaLoad(0, 0, 0, config.num_gpu_blocks)] * len(procs)
        self.reported_s = [0.0, 0.0]  # when a decode / prefill replica last reported its load (s since the start)
        self._init_state(jobs)

    def _init_state(self, jobs: Sequence[Job]) -> None:
        from scheduling.engine.request import JobState

        config = self.config
        self.states = [JobState(j, i, config.block_size) for i, j in enumerate(jobs)]  # the router's block hashes
        self.events: queue.Queue = queue.Queue()
        for k, p in enumerate(self.procs):
            threading.Thread(target=env.pump_events, args=(p, lambda ev, k=k: self.events.put((k, ev))),
                             daemon=True).start()
        self.history: dict[int, list[int]] = {}
        self.inflight: dict[str, dict] = {}      # turns sent to (or waiting for) their decode replica
        self.prefilling: dict[str, dict] = {}    # turns on a prefill replica
        self.replica_of: dict[tuple[str, int], int] = {}
        self.step_replicas: list[int] = []       # each step's replica (procs index)
        self.pd_turns: dict[tuple[str, int], dict] = {}  # prefill replica, KV bytes and transfer seconds per turn
        self.prefill_turns: list[dict] = []
        self.decode_side_saves = [0, 0.0]        # requests a consumer stored itself (no producer file), seconds

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
        env.send_command(self.procs[k], command)

    def _route(self, arrival_s: float, j: int, turn: int, now_s: float) -> None:
        from scheduling.cluster.view import TurnToRoute
        from vllmref.worker_replay import token_ids

        job, seed, bs = self.jobs[j], self.config.seed, self.config.block_size
        if turn == 0:
            self.history[j] = token_ids(f"system:{job.prefix_group}", job.system_tokens, seed=seed, vocab_size=self.vocab_size)
        spec = job.turns[turn]
        prompt = self.history[j] + token_ids(f"input:{job.job_id}:{turn}", spec.input_tokens, seed=seed,
                                             vocab_size=self.vocab_size)
        self.history[j] = prompt
        blocks = len(prompt) // bs
        req = TurnToRoute(job.job_id, turn, len(prompt), self.states[j].block_hashes(blocks)[:blocks])
        k = self._pick(self.router, self.view, 0, req, now_s)
        remote = False
        if self.prefill_router is not None:  # what the decode replica is likely to miss, by the router's record
            missing = (blocks - self.view.prefixes[k].matched_blocks(req.block_hashes, now_s)) * bs
            remote = missing >= self.config.pd_threshold_tokens
        self.view.sent(k, req, now_s)
        req_id = f"{j}#{turn}"
        self.inflight[req_id] = {"job": j, "turn": turn, "replica": k, "blocks": blocks, "arrival_s": arrival_s,
                                 "sent_s": now_s, "prompt_tokens": len(prompt), "first_scheduled_s": None,
                                 "first_token_s": None, "scheduled_tokens": 0, "num_preemptions": 0,
                                 "scheduler_hit_tokens": None, "prompt": prompt, "n_out": spec.output_tokens,
                                 "kv_load_s": 0.0, "kv_load_tokens": 0}
        self.replica_of[(job.job_id, turn)] = k
        if not remote:
            self.pd_turns[(job.job_id, turn)] = {"prefill_replica": -1, "kv_bytes": 0, "kv_transfer_s": 0.0}
            self._send(k, {"op": "add", "id": req_id, "prompt": prompt, "n_out": spec.output_tokens})
            return
        assert self.prefill_view is not None  # remote only with prefill replicas
        p = self._pick(self.prefill_router, self.prefill_view, 1, req, now_s)
        self.prefill_view.sent(p, req, now_s)
        self.prefilling[req_id] = {"replica": p, "blocks": blocks, "first_scheduled_s": None, "scheduled_tokens": 0,
                                   "num_preemptions": 0, "scheduler_hit_tokens": None, "kv_save_s": 0.0}
        self._send(self.num_decode + p, {"op": "add", "id": req_id, "prompt": prompt, "n_out": 1})

    def _pick(self, router, view, side: int, req, now_s: float) -> int:
        """``router``'s replica for ``req`` on one side (0: decode or aggregated, 1: prefill)."""
        if router.scrapes_loads and view.needs_scrape(now_s) and self.reported_s[side] > view.scraped_s:
            # only numbers a replica reported since the router last read them are new to it (vLLM's
            # balancer keeps counting what it sent until its engines publish again)
            first = self.num_decode if side else 0
            view.set_loads(list(self.loads[first:first + view.num_replicas]), self.reported_s[side])
        return router.route(req, view, now_s)

    def run(self, t0: float) -> list[dict]:
        heap = [(j.arrival_s, i, 0) for i, j in enumerate(self.jobs)]
        heapq.heapify(heap)
        records: list[dict] = []
        self.jobs_done = 0
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
            if ev["ev"] == "exit":
                raise ConfigError(f"vLLM replica {k} exited during the replay (code {ev['code']})")
            if k >= self.num_decode:
                self._on_prefill_event(k, ev, t0, records)
            else:
                self._on_decode_event(k, ev, t0, records, heap)
        for k in range(len(self.procs)):
            self._send(k, {"op": "stop"})
        return records

    def _on_load(self, k: int, ev: dict, t0: float) -> None:
        from scheduling.cluster.view import ReplicaLoad

        self.loads[k] = ReplicaLoad(int(ev["waiting"]), int(ev["running"]), int(ev["kv_used_blocks"]),
                                    int(ev["kv_total_blocks"]))
        self.reported_s[int(k >= self.num_decode)] = ev["t"] - t0

    def _on_decode_event(self, k: int, ev: dict, t0: float, records: list[dict], heap: list) -> None:
        kind = ev["ev"]
        if kind == "load":
            self._on_load(k, ev, t0)
        elif kind == "step":
            records.append(self._step_record(ev, t0, self.inflight))
            self.step_replicas.append(k)
        elif kind == "kv":
            for req_id, op, seconds, tokens in _kv_shares(ev):
                if op == "load" and req_id in self.inflight:
                    self.inflight[req_id]["kv_load_s"] += seconds
                    self.inflight[req_id]["kv_load_tokens"] += tokens
                elif op == "save":  # no producer file for this prompt: the consumer stored it itself
                    self.decode_side_saves[0] += 1
                    self.decode_side_saves[1] += seconds
        elif kind == "first":
            self.inflight[ev["id"]]["first_token_s"] = ev["t"] - t0
        elif kind == "done":
            st = self.inflight.pop(ev["id"])
            j, turn = st["job"], st["turn"]
            job = self.jobs[j]
            end_s = ev["t"] - t0
            self.history[j] = self.history[j] + list(ev["tokens"])
            self.view.finished(k, st["blocks"])
            pd_turn = self.pd_turns[(job.job_id, turn)]
            if pd_turn["prefill_replica"] >= 0:
                pd_turn["kv_bytes"] = st["kv_load_tokens"] * self.kv_bytes_per_token
                pd_turn["kv_transfer_s"] += st["kv_load_s"]
            records.append({"kind": "turn", "job_id": job.job_id, "prefix_group": job.prefix_group, "finish_s": end_s,
                            "output_tokens": len(ev["tokens"]), "hit_tokens": int(ev["cached_tokens"]), "priority": 0,
                            **{key: st[key] for key in ("turn", "arrival_s", "sent_s", "prompt_tokens",
                                                        "first_scheduled_s", "first_token_s", "scheduled_tokens",
                                                        "num_preemptions", "scheduler_hit_tokens")}})
            if turn + 1 < job.num_turns:
                heapq.heappush(heap, (end_s + job.turns[turn].tool_s, j, turn + 1))
            else:
                self.jobs_done += 1
                if self.progress:
                    self.progress(f"{self.jobs_done}/{len(self.jobs)} jobs, {end_s:.1f} s")

    def _on_prefill_event(self, k: int, ev: dict, t0: float, records: list[dict]) -> None:
        """A prefill replica's event: its steps, its load, its write of a turn's KV, and the end of a
        turn's prefill, which sends the turn on to its decode replica."""
        kind = ev["ev"]
        if kind == "load":
            self._on_load(k, ev, t0)
        elif kind == "step":
            rec = self._step_record(ev, t0, self.prefilling)
            records.append(rec)
            self.step_replicas.append(k)
        elif kind == "kv":
            for req_id, op, seconds, _ in _kv_shares(ev):
                if op == "save" and req_id in self.prefilling:
                    self.prefilling[req_id]["kv_save_s"] += seconds
        elif kind == "done":
            st = self.prefilling.pop(ev["id"])
            d = self.inflight[ev["id"]]
            assert self.prefill_view is not None  # events of a prefill replica
            self.prefill_view.finished(st["replica"], st["blocks"])
            job = self.jobs[d["job"]]
            self.pd_turns[(job.job_id, d["turn"])] = {"prefill_replica": st["replica"], "kv_bytes": 0,
                                                      "kv_transfer_s": st["kv_save_s"]}
            self.prefill_turns.append({"job_id": job.job_id, "turn": d["turn"], "replica": st["replica"],
                                       "first_scheduled_s": st["first_scheduled_s"], "finish_s": ev["t"] - t0,
                                       "hit_tokens": int(ev["cached_tokens"])})
            self._send(d["replica"], {"op": "add", "id": ev["id"], "prompt": d["prompt"], "n_out": d["n_out"]})

    def _step_record(self, ev: dict, t0: float, state: dict[str, dict]) -> dict:
        """The step as the single-engine live replay records it; the first scheduling of each turn."""
        from vllmref.worker_replay import account_step

        rec = {key: v for key, v in ev.items() if key != "ev"}
        rec["t_start"] -= t0
        rec["t_end"] -= t0
        hit = account_step(rec, state)
        rec.update(kind="step", step=len(self.step_replicas) + 1, num_prefix_hit_tokens=hit)
        return rec


def _kv_shares(ev: dict) -> list[tuple[str, str, float, int]]:
    """``(request id, op, seconds, tokens)`` per request of a step's ``kv`` event: the step's save
    (load) seconds split over the requests it stored (loaded) by their tokens."""
    out = []
    for op in ("save", "load"):
        mine = [r for r in ev["requests"] if r["op"] == op]
        total = sum(r["tokens"] for r in mine)
        for r in mine:
            out.append((r["id"], op, ev[f"{op}_s"] * (r["tokens"] / total if total else 1 / len(mine)), r["tokens"]))
    return out


def _with_replicas(result: ReplayResult, loop: _Loop, facts: list[dict], router) -> ReplayResult:
    """The replica of every turn and step, and the summary's ``cluster`` block (and, with prefill
    replicas, the simulator's P/D columns and ``cluster.pd`` block)."""
    from scheduling.cluster.results import REJECT_COLUMNS, cluster_summary

    turns, n = result.turns, loop.num_decode
    turns["replica"] = [loop.replica_of[(j, t)] for j, t in zip(turns["job_id"], turns["turn"])]
    result.steps["replica"] = [k - n if k >= n else k for k in loop.step_replicas]
    extra = [{"steps": loop.step_replicas.count(k)} for k in range(n)]
    result.summary["num_gpu_blocks"] = sum(int(f["num_gpu_blocks"]) for f in facts)
    result.summary["cluster"] = cluster_summary(turns, extra, router.name, router.params())
    if loop.prefill_router is not None:
        result.steps["role"] = ["prefill" if k >= n else "decode" for k in loop.step_replicas]
        for col in ("prefill_replica", "kv_bytes", "kv_transfer_s"):
            turns[col] = [loop.pd_turns[(j, t)][col] for j, t in zip(turns["job_id"], turns["turn"])]
        result.summary["cluster"]["pd"] = _live_pd_block(loop, turns)
    result.summary["engines"] = facts
    result.rejected = pd.DataFrame(columns=list(REJECT_COLUMNS))  # a live router refuses nothing
    return result


def _live_pd_block(loop: _Loop, turns: pd.DataFrame) -> dict:
    """The simulator's ``cluster.pd`` block for the live pair: its connector, the KV it moved and the
    transfer times measured."""
    remote = turns[turns["prefill_replica"] >= 0]
    secs = remote["kv_transfer_s"]
    return {"prefill_replicas": loop.config.prefill_replicas, "decode_replicas": loop.num_decode, "link": "file",
            "link_source": LIVE_LINK, **loop.kv_exchange,
            "reserve": "before", "threshold_tokens": loop.config.pd_threshold_tokens, "prefix_caching": "both",
            "turns_prefilled_remotely": int(len(remote)), "turns_prefilled_locally": int(len(turns) - len(remote)),
            "kv_bytes_total": int(remote["kv_bytes"].sum()),
            "kv_bytes_per_remote_turn": float(remote["kv_bytes"].mean()) if len(remote) else None,
            "kv_transfer_p50_s": float(secs.median()) if len(remote) else None,
            "kv_transfer_p90_s": float(secs.quantile(0.9)) if len(remote) else None,
            "prefill_steps": sum(1 for k in loop.step_replicas if k >= loop.num_decode),
            "prefill_hit_tokens": int(sum(t["hit_tokens"] for t in loop.prefill_turns)),
            "decode_side_stores": loop.decode_side_saves[0], "decode_side_store_s": loop.decode_side_saves[1]}
