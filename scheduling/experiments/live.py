"""Live replay: the same agent jobs sent to a real vLLM engine in real time (``replay --engine vllm``).

The jobs go to :mod:`vllmref.worker_replay` (a closed loop in the vLLM environment: turn k+1 is
sent when turn k finished plus its tool gap, prefix caching on); its records become the same
``summary.json`` / ``steps.csv`` / ``turns.csv`` / ``jobs.csv`` the simulator writes, so that
``gpubench compare-replay SIM LIVE`` can put the two side by side.

What the columns mean on the live side: times are seconds since the replay started on the wall
clock; ``first_token_s`` and ``finish_s`` are the end of the engine step that produced the token;
``hit_tokens`` is vLLM's own ``num_cached_tokens`` of the request (the scheduler's view at first
admission is kept as ``scheduler_hit_tokens``); ``kv_used_blocks`` = pool blocks minus vLLM's free
blocks (cached blocks nobody holds count as free in both engines). There is no pin, host pool or
break reason in vLLM's scheduler: those columns are 0 or empty. ``--policy sjf``/``las`` run vLLM's
``priority`` scheduling policy with each turn's priority set as it is sent (``LIVE_POLICIES``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import pandas as pd

from common.errors import ConfigError
from scheduling.engine.outputs import JOB_COLUMNS, STEP_COLUMNS, TURN_COLUMNS, EngineResult
from scheduling.experiments.metrics import summarize
from scheduling.experiments.replay import ReplayResult
from scheduling.slo.spec import DEFAULT_SLO, SLOSpec
from scheduling.workload.traces import Job, job_to_dict
from vllmref.settings import EngineSettings, max_model_len

# The orders a real vLLM engine can serve: its default fcfs, and sjf / las as request priorities under
# its ``priority`` scheduling policy (vllmref.worker_replay.PriorityOrder sets them as the turns are
# sent). jitserve re-ranks the waiting queue as time passes and srtf re-keys running turns as they
# generate, which a priority fixed at arrival cannot say; Continuum's pins and the offload policies change vLLM's block manager.
LIVE_POLICIES = ("fcfs", "sjf", "las")


@dataclass(frozen=True)
class LiveReplayConfig(EngineSettings):
    """The engine settings (:class:`vllmref.settings.EngineSettings`) plus what a live replay adds.

    Args:
        model: ``smollm2-135m`` (the real converted model) or any shipped config / config.json
            (random weights).
        num_gpu_blocks: the KV pool in blocks (``num_gpu_blocks_override``): small enough to evict.
    """

    model: str = "smollm2-135m"
    num_gpu_blocks: int = 64
    engine: str = "vllm"
    policy: str = "fcfs"  # one of LIVE_POLICIES

    def to_dict(self) -> dict:
        return asdict(self)


def validate(config: LiveReplayConfig, jobs: Sequence[Job]) -> None:
    """Every setting and job checked before the engine starts (one line per problem)."""
    config.check()
    if config.policy not in LIVE_POLICIES:
        raise ConfigError(f"--engine vllm serves --policy {', '.join(LIVE_POLICIES)} (sjf and las as request "
                          f"priorities); {config.policy} is simulator-only")
    if config.num_gpu_blocks < 1:
        raise ConfigError(f"--num-gpu-blocks must be >= 1, got {config.num_gpu_blocks}")
    if not jobs:
        raise ConfigError("no jobs to replay")
    pool_tokens = config.num_gpu_blocks * config.block_size
    for job in jobs:
        if job.total_tokens() > pool_tokens:
            raise ConfigError(f"job {job.job_id} needs {job.total_tokens()} tokens of KV cache, more than the whole "
                              f"pool ({config.num_gpu_blocks} blocks x {config.block_size} = {pool_tokens} tokens)")
    # vLLM refuses, after a minute of start-up, a pool that cannot hold one sequence of max_model_len.
    model_len = max_model_len(max(j.total_tokens() for j in jobs), config.block_size)
    if pool_tokens < model_len:
        raise ConfigError(f"vLLM needs the pool to hold one sequence of its max_model_len ({model_len} tokens): "
                          f"--num-gpu-blocks >= {-(-model_len // config.block_size)} with blocks of {config.block_size} "
                          f"(got {config.num_gpu_blocks})")


def run_live_replay(jobs: Sequence[Job], config: LiveReplayConfig, *,
                    progress: Callable[[str], None] | None = None, slo: SLOSpec = DEFAULT_SLO) -> ReplayResult:
    """Replay ``jobs`` through the real engine (``slo``: the targets its summary is scored against)."""
    from common.model_config import load_model_config
    from vllmref import env

    validate(config, jobs)
    model_dir, real_weights, _ = env.resolve_model(config.model)
    cfg = load_model_config(config.model)
    spec = {"vocab_size": cfg.vocab_size, "seed": config.seed, "jobs": [job_to_dict(j) for j in jobs],
            "engine": config.engine_spec(model_dir, real_weights=real_weights,
                                         longest_tokens=max(j.total_tokens() for j in jobs),
                                         num_gpu_blocks=config.num_gpu_blocks)
                       | {"scheduling_policy": "fcfs" if config.policy == "fcfs" else "priority"},
            "order": config.policy}
    t0 = time.perf_counter()
    kv_gib = config.num_gpu_blocks * config.block_size * cfg.kv_bytes_per_token(4) / (1 << 30)
    records = env.run_worker("worker_replay", spec, threads=config.threads, kv_cache_gib=max(1.0, kv_gib * 1.25),
                             on_line=progress)
    wall_s = time.perf_counter() - t0
    return result_from_records(records, jobs, config, wall_s=wall_s, slo=slo)


def result_from_records(records: list[dict], jobs: Sequence[Job], config: LiveReplayConfig, *,
                        wall_s: float, slo: SLOSpec = DEFAULT_SLO) -> ReplayResult:
    """The simulator's output tables from the worker's records."""
    engine = next((r for r in records if r["kind"] == "engine"), {})
    metrics = next((r for r in records if r["kind"] == "metrics"), {})
    step_recs = [r for r in records if r["kind"] == "step"]
    turn_recs = sorted((r for r in records if r["kind"] == "turn"), key=lambda r: (r["job_id"], r["turn"]))
    steps = []
    for r in step_recs:
        prefill = [b for b in r["batch"] if not b["decode"]]
        decode = [b for b in r["batch"] if b["decode"]]
        steps.append((r["step"], r["t_start"], r["t_end"] - r["t_start"], sum(b["num_new_tokens"] for b in prefill),
                      len(decode), len(prefill), len(decode), r["num_running"], r["num_waiting"],
                      r["kv_total_blocks"] - r["kv_free_blocks"], 0, r["kv_cached_blocks"] or 0, r["kv_total_blocks"],
                      0, 0, "", len(r["preempted"]), r["num_prefix_hit_tokens"], 0))
    turns, extra_turn = [], []
    for r in turn_recs:
        computed = r["prompt_tokens"] - r["hit_tokens"]
        recomputed = max(0, r["scheduled_tokens"] - computed - (r["output_tokens"] - 1))
        turns.append((r["job_id"], r["turn"], r["arrival_s"], r["first_scheduled_s"], r["first_token_s"], r["finish_s"],
                      r["first_token_s"] - r["arrival_s"], r["first_scheduled_s"] - r["arrival_s"], r["prompt_tokens"],
                      r["hit_tokens"], 0, computed, r["output_tokens"], r["num_preemptions"], recomputed,
                      r["scheduled_tokens"]))
        extra_turn.append({"job_id": r["job_id"], "turn": r["turn"], "scheduler_hit_tokens": r["scheduler_hit_tokens"],
                           "sent_s": r["sent_s"], "priority": r.get("priority", 0)})
    by_job: dict[str, list[dict]] = {}
    for r in turn_recs:
        by_job.setdefault(r["job_id"], []).append(r)
    job_rows = []
    for job in jobs:
        done = by_job.get(job.job_id, [])
        if len(done) != job.num_turns:
            raise ConfigError(f"live replay: job {job.job_id} finished {len(done)} of {job.num_turns} turns")
        arrival = min(t["arrival_s"] for t in done)
        finish = max(t["finish_s"] for t in done)
        job_rows.append((job.job_id, job.prefix_group, arrival, finish, finish - arrival, job.num_turns))
    res = EngineResult(steps=steps, turns=turns, jobs=job_rows, num_steps=len(steps),
                       num_preemptions=sum(len(r["preempted"]) for r in step_recs),
                       sim_time_s=max((r["t_end"] for r in step_recs), default=0.0), wall_s=wall_s,
                       num_gpu_blocks=engine.get("num_gpu_blocks") or config.num_gpu_blocks,
                       policy_stats={})
    steps_df = pd.DataFrame.from_records(steps, columns=list(STEP_COLUMNS))
    turns_df = pd.DataFrame.from_records(turns, columns=list(TURN_COLUMNS))
    turns_df = turns_df.merge(pd.DataFrame(extra_turn), on=["job_id", "turn"], how="left")
    jobs_df = pd.DataFrame.from_records(job_rows, columns=list(JOB_COLUMNS))
    summary = summarize(res, turns_df, jobs_df, slo)
    summary["step_cost"] = "real vLLM engine steps"
    summary["policy_params"] = {}
    summary["engine"] = engine
    summary["vllm_counters"] = {k: v for k, v in metrics.items() if k != "kind"}
    return ReplayResult(config=config, summary=summary, steps=steps_df, turns=turns_df, jobs=jobs_df)
