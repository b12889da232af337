"""An analytical SLO model of agent jobs on one engine: attainment without replaying a step.

What it takes: the jobs (turn sizes and tool gaps; their arrival rate), the engine's limits (token
budget, max_num_seqs, KV pool) and the same step cost the simulator uses (the predictor). What it
gives: per-turn TTFT, TPOT and tool-turn latency distributions, attainment of an
:class:`~scheduling.slo.spec.SLOSpec` per kind, per turn and per job, goodputs, and the largest
arrival rate at which a target attainment holds.

The model, and what it assumes (docs/slo.md):

1. **A closed cycle at each load.** With ``n`` jobs in the system each one alternates between the
   engine (one turn: its residence R) and a tool call (the workload's mean gap per turn, G). Turn
   throughput X = n / (R + G) (the interactive response-time law); turns in the engine B = X x
   (its service part of R). R = W + T_pf + (o - 1) s: queueing W, the prefill T_pf and one step s
   per further output token.
2. **One step time for all.** s is the step cost of a batch of B decodes at the mean running context
   plus the prefill tokens arriving per step (X x uncached tokens per turn x s, at most the budget
   left by the decodes): the continuous batch is taken at its mean. T_pf = s x max(1, uncached
   tokens / the budget left by the decodes).
3. **LRU as a characteristic time (Che's approximation).** A finished turn's blocks stay cached
   until the job's next turn takes them or LRU evicts them. Pool tokens not held by running turns
   hold the contexts of jobs in their tool gap for at most T_C seconds: X x E[context x min(gap,
   T_C)] = free tokens. A turn whose gap was shorter than T_C finds its whole context cached (a
   hit), otherwise recomputes all of it; a job's first turn finds its group's system prompt cached.
4. **Capacity.** B is capped by max_num_seqs and by the pool (B x running context <= pool); the
   jobs beyond wait, and W follows from the cycle: W = n / X - G - (service part of R).
5. **Load over time.** The replay serves a finite set of jobs: the load n(t) rises while they
   arrive and falls as they finish. Each job progresses at 1 / (its turns x R(n) + its tool time)
   per second; n(t) is the count not yet done. A turn's figures are those of the load when it runs,
   weighted by the turns run at each load; a job meets the SLO with the product of its turns'
   chances (turns independent), and its deadline with the time its progress took.

Fixed point per load (1-4) by damped iteration; (5) by stepping time. Nothing here schedules a step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from scheduling.engine.step_cost import StepCost
from scheduling.slo.spec import SLOSpec
from scheduling.workload.traces import Job

MAX_ITER = 200
DAMPING = 0.5


@dataclass(frozen=True)
class Workload:
    """Per-turn arrays of a set of jobs, and their means."""

    uncached_hit: np.ndarray   # new tokens a turn prefills when its context is cached
    context_prev: np.ndarray   # tokens of context a later turn may find cached (0 on a first turn)
    gap_prev: np.ndarray       # the tool gap before the turn (inf on a first turn: never "just used")
    output: np.ndarray         # output tokens
    has_tool: np.ndarray       # the turn triggers a tool (not its job's last)
    prompt: np.ndarray         # prompt tokens
    job_turns: np.ndarray      # per job: turns
    job_tool_s: np.ndarray     # per job: total tool time
    job_arrival_s: np.ndarray  # per job: arrival
    mean_gap_per_turn: float = field(init=False)

    later: "_GapTable" = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean_gap_per_turn", float(self.job_tool_s.sum() / max(self.job_turns.sum(), 1)))
        object.__setattr__(self, "later", _GapTable(self.context_prev, self.gap_prev))

    @classmethod
    def of(cls, jobs: Sequence[Job]) -> "Workload":
        unc, ctx, gap, out, tool, prompt = [], [], [], [], [], []
        for j in jobs:
            context = 0
            for k, t in enumerate(j.turns):
                first = k == 0
                unc.append(t.input_tokens)  # a first turn finds its group's system prompt cached
                ctx.append(0 if first else context)
                gap.append(math.inf if first else j.turns[k - 1].tool_s)
                out.append(t.output_tokens)
                tool.append(k < len(j.turns) - 1)
                prompt.append(j.prompt_tokens(k))
                context = j.prompt_tokens(k) + t.output_tokens
        return cls(np.array(unc, float), np.array(ctx, float), np.array(gap, float), np.array(out, float),
                   np.array(tool, bool), np.array(prompt, float), np.array([j.num_turns for j in jobs], float),
                   np.array([sum(t.tool_s for t in j.turns) for j in jobs], float),
                   np.array([j.arrival_s for j in jobs], float))


@dataclass(frozen=True)
class Limits:
    token_budget: int
    max_num_seqs: int
    pool_tokens: int


@dataclass(frozen=True)
class LoadState:
    """The fixed point at one load ``n`` (jobs in the system)."""

    n: float
    step_s: float          # s: one step (the TPOT of every streamed turn)
    running: float         # B: turns in the engine
    wait_s: float          # W: queueing before admission
    hit_prob: np.ndarray   # per turn: its context found cached
    turns_per_s: float     # X
    residence_s: float     # R (mean over turns)
    chunk_tokens: float    # prefill tokens one turn gets per step


def engine_limits_and_cost(sku: str, model: str, calibration: str | None = None,
                           num_gpu_blocks: int | None = None) -> tuple[Limits, StepCost]:
    """The limits and the step cost a replay of ``model`` on ``sku`` runs with (vLLM's server defaults,
    the KV pool from the SKU's memory, the predictor's step time)."""
    from scheduling.engine.step_cost import make_step_cost
    from scheduling.experiments.replay import ReplayConfig, engine_config

    e = engine_config(ReplayConfig(sku=sku, model=model, calibration=calibration, num_gpu_blocks=num_gpu_blocks))
    cost = make_step_cost("predictor", sku=sku, model=model, calibration=calibration)
    return Limits(e.max_num_batched_tokens, e.max_num_seqs, e.num_gpu_blocks * e.block_size), cost


class _GapTable:
    """The later turns' (context, gap before them), sorted by gap once, so that mean(context x
    min(gap, T)) over all turns is two lookups at any T (the characteristic-time search asks it
    thousands of times per prediction)."""

    def __init__(self, ctx: np.ndarray, gap: np.ndarray) -> None:
        later = np.isfinite(gap)
        order = np.argsort(gap[later], kind="stable")
        self.gap = gap[later][order]
        c = ctx[later][order]
        self.below = np.concatenate([[0.0], np.cumsum(c * self.gap)])    # sum of ctx x gap of the first i
        self.above = np.concatenate([np.cumsum(c[::-1])[::-1], [0.0]])  # sum of ctx from i on
        self.num_turns = len(gap)

    def held(self, t_c: float) -> float:
        """mean over all turns of context x min(gap, t_c) (0 for first turns)."""
        i = int(np.searchsorted(self.gap, t_c, side="left"))
        return (self.below[i] + t_c * self.above[i]) / max(self.num_turns, 1)


def _che_time(free_tokens: float, rate: float, table: _GapTable) -> float:
    """T_C with rate x mean(context x min(gap, T_C)) = free tokens (inf when everything fits)."""
    if not len(table.gap) or free_tokens <= 0:
        return 0.0
    top = float(table.gap[-1])
    if rate * table.held(top) <= free_tokens:
        return math.inf
    lo, hi = 0.0, top
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rate * table.held(mid) <= free_tokens else (lo, mid)
    return lo


def solve_load(n: float, w: Workload, lim: Limits, cost: StepCost) -> LoadState:
    """The fixed point of (1)-(4) at ``n`` jobs in the system (module docstring)."""
    G = w.mean_gap_per_turn
    o = float(w.output.mean())
    ctx_run = float(w.prompt.mean() + 0.5 * o)
    hit = np.ones_like(w.gap_prev)
    s, B = 0.01, max(1.0, 0.1 * n)
    for _ in range(MAX_ITER):
        unc = float(np.mean(w.uncached_hit + (1.0 - hit) * w.context_prev))
        chunk = max(1.0, lim.token_budget - B)
        t_pf = s * max(1.0, unc / chunk)
        serve = t_pf + max(o - 1.0, 0.0) * s
        cap = min(float(lim.max_num_seqs), lim.pool_tokens / ctx_run, n)
        B_new = min(n * serve / (serve + G), cap)
        X = B_new / serve if serve > 0 else 0.0
        prefill = min(X * unc * s, max(lim.token_budget - B_new, 0.0))
        p_tok = int(round(prefill))
        s_new = cost.step_s(num_prefill_tokens=p_tok, num_prefill_seqs=int(p_tok > 0),
                            prefill_context_tokens=int(ctx_run) if p_tok > 0 else 0,
                            num_decode_seqs=max(int(round(B_new)), 1), decode_context_tokens=int(B_new * ctx_run))
        t_c = _che_time(lim.pool_tokens - B_new * ctx_run, X, w.later)
        hit_new = np.where(np.isfinite(w.gap_prev), (w.gap_prev < t_c).astype(float), 1.0)
        done = abs(s_new - s) <= 1e-6 * s and abs(B_new - B) <= 1e-3 * max(B, 1.0)
        s, B = DAMPING * s + (1 - DAMPING) * s_new, DAMPING * B + (1 - DAMPING) * B_new
        hit = DAMPING * hit + (1 - DAMPING) * hit_new
        if done:
            break
    unc = float(np.mean(w.uncached_hit + (1.0 - hit) * w.context_prev))
    chunk = max(1.0, lim.token_budget - B)
    serve = s * max(1.0, unc / chunk) + max(o - 1.0, 0.0) * s
    X = B / serve if serve > 0 else 0.0
    wait = max(n / X - G - serve, 0.0) if X > 0 else 0.0
    return LoadState(n=n, step_s=s, running=B, wait_s=wait, hit_prob=hit, turns_per_s=X, residence_s=wait + serve,
                     chunk_tokens=chunk)


def turn_figures(st: LoadState, w: Workload) -> dict[str, np.ndarray]:
    """Per turn of the workload at this load, each as (value on a hit, value on a miss) mixed by
    ``hit_prob``: TTFT, TPOT and latency (arrival to last token)."""
    def ttft(uncached):
        return st.wait_s + st.step_s * np.maximum(1.0, uncached / st.chunk_tokens)

    hit_ttft, miss_ttft = ttft(w.uncached_hit), ttft(w.uncached_hit + w.context_prev)
    decode = np.maximum(w.output - 1.0, 0.0) * st.step_s
    return {"p_hit": st.hit_prob, "ttft_hit": hit_ttft, "ttft_miss": miss_ttft,
            "latency_hit": hit_ttft + decode, "latency_miss": miss_ttft + decode, "tpot": np.full(len(w.output), st.step_s)}


def turn_meet_prob(f: dict, w: Workload, slo: SLOSpec) -> dict[str, np.ndarray]:
    """Per turn: the probability it meets each kind and all of them (hit/miss mixed)."""
    p = f["p_hit"]

    def mix(ok_hit, ok_miss):
        return p * ok_hit + (1 - p) * ok_miss

    one = np.ones(len(p))
    ttft = one if slo.ttft_s is None else mix(f["ttft_hit"] <= slo.ttft_s, f["ttft_miss"] <= slo.ttft_s)
    tpot = one if slo.tpot_s is None else np.where(w.output > 1, f["tpot"] <= slo.tpot_s, True).astype(float)
    tool = one if slo.tool_turn_s is None else np.where(
        w.has_tool, mix(f["latency_hit"] <= slo.tool_turn_s, f["latency_miss"] <= slo.tool_turn_s), 1.0)
    ok_hit = ((slo.ttft_s is None) | (f["ttft_hit"] <= (slo.ttft_s or math.inf))) & \
        (~w.has_tool | (f["latency_hit"] <= (slo.tool_turn_s or math.inf)))
    ok_miss = ((slo.ttft_s is None) | (f["ttft_miss"] <= (slo.ttft_s or math.inf))) & \
        (~w.has_tool | (f["latency_miss"] <= (slo.tool_turn_s or math.inf)))
    return {"ttft": ttft, "tpot": tpot, "tool_turn": tool, "turn": mix(ok_hit, ok_miss) * tpot}


@dataclass
class Prediction:
    """What the model predicts for one replay (the keys of ``slo_attainment``, and percentiles)."""

    attainment: dict
    percentiles: dict
    loads: list = field(default_factory=list)  # (time_s, n, step_s, wait_s, mean hit prob)


def predict(jobs: Sequence[Job], lim: Limits, cost: StepCost, slo: SLOSpec, *, dt_s: float | None = None) -> Prediction:
    """Attainment and latency percentiles of replaying ``jobs`` (with their arrival times)."""
    w = Workload.of(jobs)
    arrivals = w.job_arrival_s
    span_in = float(arrivals.max() - arrivals.min()) if len(arrivals) else 0.0
    dt = dt_s or max(0.05, min(1.0, (span_in + 60.0) / 2000.0))
    cache: dict[int, tuple[LoadState, dict, dict]] = {}

    def at(n: int):
        if n not in cache:
            st = solve_load(float(n), w, lim, cost)
            f = turn_figures(st, w)
            cache[n] = (st, f, turn_meet_prob(f, w, slo))
        return cache[n]

    progress = np.zeros(len(arrivals))
    log_ok = np.zeros(len(arrivals))  # per job: sum over its turns of log P(turn meets)
    weights: dict[int, float] = {}    # load -> turns run at it
    t = float(arrivals.min()) if len(arrivals) else 0.0
    finish = np.full(len(arrivals), np.nan)
    loads = []
    while np.isnan(finish).any():
        inside = (arrivals <= t) & np.isnan(finish)
        n = int(inside.sum())
        if n == 0:
            t = float(arrivals[np.isnan(finish)].min())
            continue
        st, f, meet = at(n)
        rate = 1.0 / (w.job_turns[inside] * st.residence_s + w.job_tool_s[inside])
        step = np.minimum(rate * dt, 1.0 - progress[inside])
        progress[inside] += step
        turns_run = step * w.job_turns[inside]
        weights[n] = weights.get(n, 0.0) + float(turns_run.sum())
        log_ok[inside] += turns_run * float(np.log(max(meet["turn"].mean(), 1e-300)))
        t += dt
        done = inside & (progress >= 1.0 - 1e-12)
        finish[done] = t
        loads.append((t, n, st.step_s, st.wait_s, float(st.hit_prob.mean())))
    return _summarize(w, cache, weights, finish, log_ok, slo, loads)


def _summarize(w: Workload, cache, weights, finish, log_ok, slo: SLOSpec, loads) -> Prediction:
    total = sum(weights.values())
    share = {n: v / total for n, v in weights.items()} if total else {}
    att = {k: sum(share[n] * float(cache[n][2][k].mean()) for n in share) for k in ("ttft", "tpot", "turn")}
    tool = w.has_tool
    att["tool_turn"] = sum(share[n] * float(cache[n][2]["tool_turn"][tool].mean()) for n in share) if tool.any() else None
    jct = finish - w.job_arrival_s
    job_ok = np.exp(log_ok) * (jct <= slo.job_s if slo.job_s is not None else 1.0)
    span = float(np.nanmax(finish) - w.job_arrival_s.min()) if len(finish) else 1.0
    out_tok = float(w.output.mean())
    att.update(job_deadline=float(np.mean(jct <= slo.job_s)) if slo.job_s is not None else None,
               job=float(job_ok.mean()), job_goodput_per_s=float(job_ok.sum()) / span,
               token_goodput_per_s=sum(share[n] * float(cache[n][2]["turn"].mean()) for n in share) * total * out_tok / span,
               turns=int(len(w.output)), jobs=int(len(w.job_turns)), slo=slo.to_dict())
    pct = _percentiles(cache, share)
    pct.update(jct_mean_s=float(np.mean(jct)), makespan_s=span)
    return Prediction(attainment=att, percentiles=pct, loads=loads)


def _percentiles(cache, share) -> dict:
    """TTFT and TPOT p50/p90 over turns, weighted by the turns run at each load (hit/miss mixed)."""
    vals, wts, tpots, twts = [], [], [], []
    for n, sh in share.items():
        _, f, _ = cache[n]
        p = f["p_hit"]
        m = len(p)
        vals += [f["ttft_hit"], f["ttft_miss"]]
        wts += [sh * p / m, sh * (1 - p) / m]
        tpots.append(f["tpot"][:1])
        twts.append(np.array([sh]))
    v, wt = np.concatenate(vals), np.concatenate(wts)
    tv, tw = np.concatenate(tpots), np.concatenate(twts)
    ttft, tpot = _wq(v, wt, (0.5, 0.9)), _wq(tv, tw, (0.5, 0.9))
    return {"ttft_p50_s": ttft[0], "ttft_p90_s": ttft[1], "tpot_p50_s": tpot[0], "tpot_p90_s": tpot[1]}


def _wq(values: np.ndarray, weights: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """Weighted quantiles ``qs`` of ``values`` (one sort for all of them: the TTFT array holds every
    turn at every load, millions of values)."""
    order = np.argsort(values)
    c = np.cumsum(weights[order])
    ranked = values[order]
    return [float(ranked[min(int(np.searchsorted(c, q * c[-1])), len(c) - 1)]) for q in qs]


def max_rate(jobs_at, lim: Limits, cost: StepCost, slo: SLOSpec, *, target: float = 0.9, of: str = "turn",
             lo: float = 0.01, hi: float = 100.0, iterations: int = 10, progress=None) -> tuple[float | None, Prediction | None]:
    """The largest arrival rate (jobs/s) at which the predicted ``of`` attainment ("turn" or "job")
    is at least ``target``: bisection in log-rate between ``lo`` and ``hi`` (attainment falls with
    the rate). ``jobs_at(jps)`` gives the jobs with arrivals at that rate. (None, None) when even
    ``lo`` misses; (hi, its prediction) when ``hi`` still meets it."""
    def ok(jps: float) -> tuple[bool, Prediction]:
        pred = predict(jobs_at(jps), lim, cost, slo)
        if progress:
            progress(f"  {jps:.4g} jobs/s: {of} attainment {pred.attainment[of]:.1%}")
        return pred.attainment[of] >= target, pred

    good, pred_hi = ok(hi)
    if good:
        return hi, pred_hi
    good, best = ok(lo)
    if not good:
        return None, None
    a, b = math.log(lo), math.log(hi)
    for _ in range(iterations):
        mid = 0.5 * (a + b)
        good, pred = ok(math.exp(mid))
        if good:
            a, best = mid, pred
        else:
            b = mid
    return math.exp(a), best
