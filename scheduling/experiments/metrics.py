"""Replay metrics: tables from the engine's records and the summary (docs/scheduling.md).

Definitions (all over the whole replay):
- JCT: a job's last finish − its arrival. TTFT: a turn's first token − its arrival (the end of the
  step that completes its prefill). Queueing delay: first scheduled − arrival.
- GPU prefix-hit rate: Σ hit tokens / Σ prompt tokens (hits of each turn's final admission,
  prompt positions only).
- Pool hit rate (cpu-offload, lmcache): Σ tokens supplied by the pool / Σ prompt tokens the GPU
  cache missed (so 1.0 means every GPU miss was found in the pool).
- Throughput: output tokens and processed tokens (every scheduled token, recomputation included)
  per second of simulated time from the first arrival to the last finish; jobs/s likewise.
- TPOT (time per output token, the turn's mean inter-token latency): (finish − first token) /
  (output tokens − 1), over turns with at least two output tokens.
- ``num_jobs`` and ``arrival_span_s`` (first to last job arrival) belong to every result: at a
  high arrival rate a finite set of jobs arrives at once and the result becomes a drain time.
- Goodput under an SLO (TTFT ≤ 2 s and TPOT ≤ 0.1 s by default, a common interactive target;
  stated in the summary): the share of turns that meet both, and their output tokens per second
  over the same span as the throughput. ``slo_attainment`` adds the agent kinds (a deadline on a
  turn that triggers a tool, on the whole job), job goodput and per-kind attainment
  (scheduling.slo.attainment); ``replay --slo`` sets the targets.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from scheduling.engine.outputs import JOB_COLUMNS, STEP_COLUMNS, TURN_COLUMNS, EngineResult
from scheduling.slo.attainment import attainment, turn_checks
from scheduling.slo.spec import DEFAULT_SLO, SLOSpec


def frames(res: EngineResult) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(steps, turns, jobs)`` DataFrames with the column names of the replay output contract."""
    steps = pd.DataFrame.from_records(res.steps, columns=list(STEP_COLUMNS))
    turns = pd.DataFrame.from_records(res.turns, columns=list(TURN_COLUMNS))
    jobs = pd.DataFrame.from_records(res.jobs, columns=list(JOB_COLUMNS))
    return steps, turns, jobs




SLO_TTFT_S = DEFAULT_SLO.ttft_s  # the default targets (scheduling.slo.spec); replay --slo changes them
SLO_TPOT_S = DEFAULT_SLO.tpot_s


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _mean(values: np.ndarray) -> float | None:
    return float(np.mean(values)) if len(values) else None


def summarize(res: EngineResult, turns: pd.DataFrame, jobs: pd.DataFrame, slo: SLOSpec = DEFAULT_SLO) -> dict:
    """The metrics block of ``summary.json``."""
    jct = jobs["jct_s"].to_numpy(float)
    ttft = turns["ttft_s"].to_numpy(float)
    steps_after_first = (turns["output_tokens"] - 1).to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot_all = (turns["finish_s"] - turns["first_token_s"]).to_numpy(float) / steps_after_first
    tpot = tpot_all[steps_after_first > 0]
    # the SLO's per-turn checks once, for the TTFT-and-TPOT goodput and the agent kinds alike (a
    # one-token turn has no inter-token time: it meets the TPOT target by definition)
    checks = turn_checks(turns, jobs, slo) if len(turns) and len(jobs) else None
    meets = (checks["ttft_ok"] & checks["tpot_ok"]).to_numpy(bool) if checks is not None else np.zeros(0, dtype=bool)
    queue = turns["queue_s"].to_numpy(float)
    prompt = int(turns["prompt_tokens"].sum())
    hit = int(turns["hit_tokens"].sum())
    pool_hit = int(turns["pool_hit_tokens"].sum())
    output = int(turns["output_tokens"].sum())
    scheduled = int(turns["scheduled_tokens"].sum())
    start_s = float(jobs["arrival_s"].min()) if len(jobs) else 0.0
    end_s = float(jobs["finish_s"].max()) if len(jobs) else 0.0
    span_s = max(end_s - start_s, 1e-12)
    arrival_span_s = float(jobs["arrival_s"].max() - jobs["arrival_s"].min()) if len(jobs) else 0.0
    return {
        "num_jobs": int(len(jobs)),
        "num_turns": int(len(turns)),
        # A replay serves a finite set of jobs: when they all arrive within a short span, what it
        # measures is the time to drain that batch. Keep both next to every other figure.
        "arrival_span_s": arrival_span_s,
        "jct_mean_s": _mean(jct), "jct_p50_s": _pct(jct, 50), "jct_p90_s": _pct(jct, 90), "jct_p99_s": _pct(jct, 99),
        "ttft_mean_s": _mean(ttft), "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_mean_s": _mean(tpot), "tpot_p50_s": _pct(tpot, 50), "tpot_p90_s": _pct(tpot, 90),
        "tpot_p99_s": _pct(tpot, 99),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "slo_turn_share": float(meets.mean()) if len(meets) else None,
        "goodput_tok_per_s": float(turns["output_tokens"].to_numpy()[meets].sum()) / span_s,
        "queue_mean_s": _mean(queue), "queue_p50_s": _pct(queue, 50), "queue_p90_s": _pct(queue, 90),
        "output_tok_per_s": output / span_s,
        "processed_tok_per_s": scheduled / span_s,
        "jobs_per_s": len(jobs) / span_s,
        "gpu_prefix_hit_rate": hit / prompt if prompt else None,
        "pool_hit_rate": pool_hit / (prompt - hit) if prompt > hit else None,
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "pool_hit_tokens": pool_hit,
        "computed_prompt_tokens": int(turns["computed_tokens"].sum()),
        "output_tokens": output,
        "preemptions": int(res.num_preemptions),
        "recomputed_tokens": int(turns["recomputed_tokens"].sum()),
        "makespan_s": span_s,
        "sim_time_s": float(res.sim_time_s),
        "sim_wall_s": float(res.wall_s),
        "steps": int(res.num_steps),
        "steps_per_wall_s": res.num_steps / res.wall_s if res.wall_s > 0 else None,
        "num_gpu_blocks": int(res.num_gpu_blocks),
        # Did the pool ever run short? (replay's note: if not, the KV policies had nothing to do)
        "kv_peak_blocks": int(res.peak_kv_blocks),
        "kv_evicted_blocks": int(res.num_evicted_blocks),
        "kv_block_shortages": int(res.num_block_shortages),
        "policy_stats": res.policy_stats,
        "slo_attainment": attainment(turns, jobs, slo, checks=checks),
    }
