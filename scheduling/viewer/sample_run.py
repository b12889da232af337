"""Write a small replay directory in the step-log format without the engine (a fixture).

The viewer is developed and tested against this when no real replay output is at hand. The numbers
come from a deliberately crude queue model (fixed block pool, whole-job prefix caching, LRU eviction
of finished jobs' caches, preemption of the newest running request when blocks run out) — enough
for every chart to have something real to show and for the totals in ``summary.json`` to agree
with the step log. It is NOT the simulator: use ``gpubench replay`` for numbers.
"""
from __future__ import annotations

import csv
import json
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from scheduling.trace_synth import DEFAULT_TOOL_MODELS, SyntheticParams, synthetic_jobs
from scheduling.traces import Job, with_poisson_arrivals
from scheduling.viewer.data import JOB_COLUMNS, STEP_COLUMNS, TURN_COLUMNS

BLOCK = 16


@dataclass
class _Req:
    job: Job
    turn: int
    arrival_s: float
    prompt: int
    hit: int = 0
    done_prefill: int = 0
    done_out: int = 0
    first_sched_s: float | None = None
    first_tok_s: float | None = None
    preempts: int = 0
    computed: int = 0

    def blocks(self) -> int:
        return math.ceil((self.done_prefill + self.done_out) / BLOCK)


@dataclass
class _State:
    t_s: float = 0.0
    cache: "OrderedDict[str, int]" = field(default_factory=OrderedDict)  # job -> cached blocks (LRU)


def write_sample_run(out_dir: str | Path, *, num_jobs: int = 30, seed: int = 0, jps: float = 3.0,
                     total_blocks: int = 420, token_budget: int = 512, max_seqs: int = 10) -> Path:
    """Write summary.json, steps.csv, turns.csv, jobs.csv under ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = SyntheticParams(turns_mean=6, turns_min=2, turns_max=10, system_tokens_min=400, system_tokens_max=800,
                             obs_tokens_median=150, obs_tokens_max=1500, task_tokens_median=200,
                             out_tokens_median=60, out_tokens_max=200, num_prefix_groups=2,
                             tool_models={k: replace(m, max_s=8.0) for k, m in DEFAULT_TOOL_MODELS.items()})
    jobs = with_poisson_arrivals(synthetic_jobs(num_jobs, seed, params), jps, seed)
    events = sorted(((j.arrival_s, 0, j) for j in jobs), key=lambda e: (e[0], e[2].job_id))
    pending: deque = deque()  # (time, turn, job) future arrivals, kept sorted
    for e in events:
        pending.append((e[0], 0, e[2]))
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    st = _State()
    steps, turn_rows, job_finish = [], [], {}
    step = 0
    while pending or waiting or running:
        pending = deque(sorted(pending, key=lambda e: (e[0], e[2].job_id)))
        while pending and pending[0][0] <= st.t_s:
            arr, k, job = pending.popleft()
            waiting.append(_Req(job, k, arr, job.prompt_tokens(k)))
        if not waiting and not running:
            st.t_s = pending[0][0]
            continue
        budget, num_pre = token_budget, 0
        num_pf_tok = num_dec_tok = num_pf_seqs = num_dec_seqs = hit_tok = 0
        for r in running:  # decodes first
            if r.done_prefill >= r.prompt and budget > 0:
                budget -= 1
                num_dec_tok += 1
                num_dec_seqs += 1
        reason = "queue_empty"
        used = sum(r.blocks() for r in running)
        while waiting:
            if len(running) >= max_seqs:
                reason = "max_seqs"
                break
            if budget <= 0:
                reason = "token_budget"
                break
            r = waiting[0]
            cached = st.cache.pop(r.job.job_id, 0) * BLOCK
            if r.first_sched_s is None:
                r.hit = min(cached, r.prompt - 1)
            need = math.ceil(r.prompt / BLOCK)
            if used + need > total_blocks:
                reason = "no_blocks"
                break
            waiting.popleft()
            r.done_prefill = r.hit
            r.first_sched_s = st.t_s if r.first_sched_s is None else r.first_sched_s
            hit_tok += r.hit
            running.append(r)
            used += need
        for r in running:  # prefill chunks with what is left of the budget
            left = r.prompt - r.done_prefill
            if left > 0 and budget > 0:
                chunk = min(left, budget)
                budget -= chunk
                r.done_prefill += chunk
                r.computed += chunk
                num_pf_tok += chunk
                num_pf_seqs += 1
        dur = 0.004 + 2.5e-5 * num_pf_tok + 3e-4 * num_dec_tok
        end = st.t_s + dur
        # decode progress, finish, preemption when the pool overflows
        for r in list(running):
            if r.done_prefill >= r.prompt:
                r.done_out += 1
                if r.first_tok_s is None:
                    r.first_tok_s = end
                if r.done_out >= r.job.turns[r.turn].output_tokens:
                    running.remove(r)
                    st.cache[r.job.job_id] = r.blocks()
                    turn_rows.append(r)
                    if r.turn + 1 < r.job.num_turns:
                        pending.append((end + r.job.turns[r.turn].tool_s, r.turn + 1, r.job))
                    else:
                        job_finish[r.job.job_id] = end
        while sum(r.blocks() for r in running) + sum(st.cache.values()) > total_blocks and st.cache:
            st.cache.popitem(last=False)  # LRU eviction of cached finished turns
        while sum(r.blocks() for r in running) > total_blocks and len(running) > 1:
            victim = running.pop()
            victim.done_prefill, victim.done_out, victim.hit = 0, 0, 0
            victim.preempts += 1
            num_pre += 1
            waiting.appendleft(victim)
        used_blocks = sum(r.blocks() for r in running)
        cached_blocks = sum(st.cache.values())
        steps.append([step, round(st.t_s, 6), round(dur, 6), num_pf_tok, num_dec_tok, num_pf_seqs, num_dec_seqs,
                      len(running), len(waiting), used_blocks, 0, cached_blocks, total_blocks, 0, 0, reason, num_pre,
                      hit_tok, 0])
        step += 1
        st.t_s = end
    _write(out, jobs, steps, turn_rows, job_finish, dict(num_jobs=num_jobs, seed=seed, jps=jps,
                                                          total_blocks=total_blocks,
                                                          max_num_batched_tokens=token_budget))
    return out


def _write(out: Path, jobs, steps, turn_rows, job_finish, config) -> None:
    with open(out / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(STEP_COLUMNS)
        w.writerows(steps)
    turns = []
    for r in sorted(turn_rows, key=lambda r: (r.job.job_id, r.turn)):
        out_tok = r.job.turns[r.turn].output_tokens
        turns.append([r.job.job_id, r.turn, round(r.arrival_s, 6), round(r.first_sched_s, 6), round(r.first_tok_s, 6),
                      round(job_finish.get(r.job.job_id, r.first_tok_s), 6) if r.turn == r.job.num_turns - 1
                      else round(r.first_tok_s + 0.0003 * out_tok, 6),
                      round(r.first_tok_s - r.arrival_s, 6), round(r.first_sched_s - r.arrival_s, 6),
                      r.prompt, r.hit, 0, r.computed, out_tok, r.preempts])
    with open(out / "turns.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TURN_COLUMNS)
        w.writerows(turns)
    job_rows = [[j.job_id, j.prefix_group, round(j.arrival_s, 6), round(job_finish[j.job_id], 6),
                 round(job_finish[j.job_id] - j.arrival_s, 6), j.num_turns] for j in jobs]
    with open(out / "jobs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(JOB_COLUMNS)
        w.writerows(job_rows)
    jcts = sorted(r[4] for r in job_rows)
    ttfts = sorted(t[6] for t in turns)

    def pct(xs, q):  # numpy's default (linear) percentile, as the metrics module uses
        return float(np.percentile(xs, 100 * q))

    summary = {
        "config": {"policy": "sample-fixture", "sku": "none", "model": "none", **config},
        "metrics": {
            "num_jobs": len(job_rows), "num_turns": len(turns), "steps": len(steps),
            "jct_mean_s": sum(jcts) / len(jcts), "jct_p50_s": pct(jcts, 0.5), "jct_p90_s": pct(jcts, 0.9),
            "jct_p99_s": pct(jcts, 0.99), "ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p50_s": pct(ttfts, 0.5),
            "ttft_p90_s": pct(ttfts, 0.9),
            "preemptions": sum(s[16] for s in steps),
            "gpu_prefix_hit_rate": sum(t[9] for t in turns) / max(1, sum(t[8] for t in turns)),
            "pool_hit_rate": None,  # share of GPU misses served by a pool: no pool here
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
