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
2. **Two kinds of step.** A step runs the B decodes at the mean running context (s_d) and, in a
   share q of the steps, prefill chunks as well (s_p). Prefill arrives at X x (uncached tokens per
   turn) per second; a step that carries prefill carries one turn's chunk at low load and the
   arriving tokens per step (at most the budget left by the decodes) at high load, and q is what
   makes the two agree. The mean step s = q s_p + (1 - q) s_d. A turn's prefill takes
   ceil(uncached / chunk) steps, each pricing the decodes plus its chunk (or the mean prefill step,
   if larger: it shares the step); TTFT adds the residual of the step running when it arrives.
   A turn's TPOT is s_d plus the extra time of the prefill steps among its (o - 1) decode steps, a
   binomial count with probability q, over o - 1: where one prefill step costs several decode
   steps (on a CPU), a few turns see one and miss a TPOT target the mean would meet.
3. **LRU as a characteristic time (Che's approximation), eaten from the tail** (scheduling.slo.lru).
   A finished turn's blocks stay cached, free, until the job's next turn takes them back. LRU eats
   a freed context from its tail at the rate new tokens are written; its tail survives T_C, where
   the contexts held over their tool gap and then their queueing (exponential, mean W) fill the
   free pool. A returning turn recomputes what was eaten. Every turn finds its group's system
   prompt cached; only whole blocks are. When the pool bounds the batch, half a prompt stays free
   on average (the next turn waits for room for its prompt): the room cached contexts have.
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

from common.errors import ConfigError
from scheduling.engine.step_cost import StepCost
from scheduling.slo.lru import GapTable, che_time, kept_share, queue_points
from scheduling.slo.spec import SLOSpec
from scheduling.slo.steps import Steps, step_mix, tpot_meet_probability
from scheduling.workload.traces import Job

MAX_ITER = 200
DAMPING = 0.5


@dataclass(frozen=True)
class Workload:
    """Per-turn arrays of a set of jobs, and their means."""

    uncached_hit: np.ndarray   # new tokens a turn prefills when its context is cached
    context_prev: np.ndarray   # tokens of its job's own context a later turn may find cached (0 on a
    #                            first turn): the earlier turns' tokens after the group's system prompt,
    #                            which the group's jobs share and keep cached (a hit on every turn)
    gap_prev: np.ndarray       # the tool gap before the turn (inf on a first turn: never "just used")
    output: np.ndarray         # output tokens
    has_tool: np.ndarray       # the turn triggers a tool (not its job's last)
    prompt: np.ndarray         # prompt tokens
    job_turns: np.ndarray      # per job: turns
    job_tool_s: np.ndarray     # per job: total tool time
    job_arrival_s: np.ndarray  # per job: arrival
    mean_gap_per_turn: float = field(init=False)

    later: GapTable = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean_gap_per_turn", float(self.job_tool_s.sum() / max(self.job_turns.sum(), 1)))
        object.__setattr__(self, "later", GapTable(self.context_prev, self.gap_prev))

    @classmethod
    def of(cls, jobs: Sequence[Job], block_size: int = 16) -> "Workload":
        """Prefix caching keeps whole blocks only: a turn recomputes the partial last block of what it
        finds cached (up to ``block_size`` - 1 tokens; 64 on average with vLLM's CPU blocks of 128)."""
        def whole_blocks(tokens: int) -> int:
            return tokens // block_size * block_size

        unc, ctx, gap, out, tool, prompt = [], [], [], [], [], []
        for j in jobs:
            context = 0
            shared = whole_blocks(j.system_tokens)
            for k, t in enumerate(j.turns):
                first = k == 0
                # every turn finds its group's system prompt cached; a later turn, on a hit, its context too
                unc.append(j.prompt_tokens(k) - (shared if first else whole_blocks(context)))
                ctx.append(0 if first else whole_blocks(context) - shared)
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
    block_size: int = 16


@dataclass(frozen=True)
class LoadState:
    """The fixed point at one load ``n`` (jobs in the system)."""

    n: float
    step_s: float          # s: one step (the TPOT of every streamed turn)
    running: float         # B: turns in the engine
    wait_s: float          # W: queueing before admission (mean)
    kept: np.ndarray       # per turn: the share of its earlier context found cached (mean over queueing)
    turns_per_s: float     # X
    residence_s: float     # R (mean over turns)
    chunk_tokens: float    # prefill tokens one turn gets per step
    decode_step_s: float = 0.0    # s_d: a step of decodes only
    prefill_step_s: float = 0.0   # s_p: a step that also carries prefill
    prefill_share: float = 0.0    # q: the share of steps that carry prefill
    residual_s: float = 0.0       # the mean remainder of the step a new turn arrives in
    chunk_grid: tuple = ((1.0,), (0.0,))  # (prefill tokens of one chunk, its step time): for interpolation
    che_time_s: float = math.inf  # T_C: how long a freed context's tail survives (lru)
    evict_rate: float = 0.0       # new tokens written to the pool per second


def engine_limits_and_cost(sku: str, model: str, calibration: str | None = None,
                           num_gpu_blocks: int | None = None) -> tuple[Limits, StepCost]:
    """The limits and the step cost a replay of ``model`` on ``sku`` runs with (vLLM's server defaults,
    the KV pool from the SKU's memory, the predictor's step time)."""
    from scheduling.engine.step_cost import make_step_cost
    from scheduling.experiments.replay import ReplayConfig, engine_config

    e = engine_config(ReplayConfig(sku=sku, model=model, calibration=calibration, num_gpu_blocks=num_gpu_blocks))
    cost = make_step_cost("predictor", sku=sku, model=model, calibration=calibration)
    return limits_of(e), cost


def limits_of(e) -> Limits:
    """The model's limits of a simulated engine's sizes (scheduling.engine.EngineConfig)."""
    return Limits(e.max_num_batched_tokens, e.max_num_seqs, e.num_gpu_blocks * e.block_size, e.block_size)


def solve_load(n: float, w: Workload, lim: Limits, cost: StepCost) -> LoadState:
    """The fixed point of (1)-(4) at ``n`` jobs in the system (module docstring)."""
    G = w.mean_gap_per_turn
    o = float(w.output.mean())
    ctx_run = float(w.prompt.mean() + 0.5 * o)
    # When the pool bounds the batch, the next turn waits for room for its prompt: on average half
    # of a prompt's tokens stay free (and hold cached contexts) beside the running ones.
    reserve = min(0.5 * float(w.prompt.mean()), 0.5 * lim.pool_tokens)
    mean_hit_unc = float(w.uncached_hit.mean())
    lost = 0.0  # mean context tokens a turn recomputes (what LRU ate), over the gap table's bins
    s, B, wait = 0.01, max(1.0, 0.1 * n), 0.0
    for _ in range(MAX_ITER):
        unc = mean_hit_unc + lost
        steps = Steps(cost, B, ctx_run, max(1.0, lim.token_budget - B))
        serve = steps.prefill_time(unc, 0.0) + max(o - 1.0, 0.0) * s
        cap = min(float(lim.max_num_seqs), (lim.pool_tokens - reserve) / ctx_run, n)
        B_new = min(n * serve / (serve + G), cap)
        X = B_new / serve if serve > 0 else 0.0
        q, _, s_p = step_mix(steps, X, unc, s)
        s_new = q * s_p + (1 - q) * steps.decode_s
        wait_new = max(n / X - G - serve, 0.0) if X > 0 else 0.0
        waits = queue_points(wait)
        evict = X * (unc + o)
        t_c = che_time(lim.pool_tokens - B_new * ctx_run, X, w.later, waits, evict)
        lost_new = w.later.lost(t_c, waits, evict)
        done = abs(s_new - s) <= 1e-6 * s and abs(B_new - B) <= 1e-3 * max(B, 1.0) and abs(wait_new - wait) <= 1e-3 * max(wait, 1.0)
        s, B = DAMPING * s + (1 - DAMPING) * s_new, DAMPING * B + (1 - DAMPING) * B_new
        wait = DAMPING * wait + (1 - DAMPING) * wait_new
        lost = DAMPING * lost + (1 - DAMPING) * lost_new
        if done:
            break
    unc = mean_hit_unc + lost
    steps = Steps(cost, B, ctx_run, max(1.0, lim.token_budget - B))
    serve = steps.prefill_time(unc, 0.0) + max(o - 1.0, 0.0) * s
    X = B / serve if serve > 0 else 0.0
    q, per_step, s_p = step_mix(steps, X, unc, s)
    wait = max(n / X - G - serve, 0.0) if X > 0 else 0.0
    evict = X * (unc + o)
    t_c = che_time(lim.pool_tokens - B * ctx_run, X, w.later, queue_points(wait), evict)
    kept = kept_share(w.context_prev, w.gap_prev, queue_points(wait), t_c, evict).mean(axis=0)
    residual = (q * s_p ** 2 + (1 - q) * steps.decode_s ** 2) / (2 * s) if s > 0 else 0.0
    grid = np.unique(np.geomspace(1.0, steps.chunk, 24).round())
    chunk_s = np.array([steps.with_prefill(max(g, per_step if q >= 1 else 0.0)) for g in grid])
    return LoadState(n=n, step_s=s, running=B, wait_s=wait, kept=kept, turns_per_s=X, residence_s=wait + serve,
                     chunk_tokens=steps.chunk, decode_step_s=steps.decode_s, prefill_step_s=s_p, prefill_share=q,
                     residual_s=residual, chunk_grid=(tuple(grid), tuple(chunk_s)), che_time_s=t_c, evict_rate=evict)


def turn_figures(st: LoadState, w: Workload) -> dict:
    """Per queueing point and turn (arrays of shape (points, turns)), at this load: TTFT and latency
    (arrival to last token); and a function giving each turn's chance of meeting a TPOT target."""
    grid, chunk_s = (np.asarray(a, float) for a in st.chunk_grid)
    waits = queue_points(st.wait_s)
    kept = kept_share(w.context_prev, w.gap_prev, waits, st.che_time_s, st.evict_rate)
    uncached = w.uncached_hit[None, :] + (1.0 - kept) * w.context_prev[None, :]
    k = np.maximum(1.0, np.ceil(uncached / st.chunk_tokens))
    ttft = waits[:, None] + st.residual_s + k * np.interp(uncached / k, grid, chunk_s)
    decode = np.maximum(w.output - 1.0, 0.0) * st.step_s
    return {"ttft": ttft, "latency": ttft + decode[None, :],
            "tpot_ok": lambda target: tpot_meet_probability(w.output, target, decode_s=st.decode_step_s,
                                                            prefill_s=st.prefill_step_s, prefill_share=st.prefill_share)}


def turn_meet_prob(f: dict, w: Workload, slo: SLOSpec) -> dict[str, np.ndarray]:
    """Per turn: the probability it meets each kind and all of them (over the queueing points)."""
    inf = math.inf
    ttft_ok = f["ttft"] <= (slo.ttft_s if slo.ttft_s is not None else inf)
    tool_ok = ~w.has_tool[None, :] | (f["latency"] <= (slo.tool_turn_s if slo.tool_turn_s is not None else inf))
    tpot = np.ones(len(w.output)) if slo.tpot_s is None else np.where(w.output > 1, f["tpot_ok"](slo.tpot_s), 1.0)
    return {"ttft": ttft_ok.mean(axis=0), "tpot": tpot, "tool_turn": tool_ok.mean(axis=0),
            "turn": (ttft_ok & tool_ok).mean(axis=0) * tpot}


# TTFT percentiles come from a histogram accumulated over loads (every turn at every queueing point
# at every load would be tens of millions of values): log-spaced bins, 1.2 % wide.
TTFT_EDGES = np.geomspace(1e-4, 1e6, 2001)


@dataclass(frozen=True)
class LoadFigures:
    """What a prediction keeps of one load: mean chances per kind, and the TTFT histogram."""

    state: LoadState
    meet: dict             # kind -> mean chance over the turns it applies to
    ttft_hist: np.ndarray  # turns (weight 1 / points each) per TTFT_EDGES bin


def load_figures(st: LoadState, w: Workload, slo: SLOSpec) -> LoadFigures:
    f = turn_figures(st, w)
    meet = turn_meet_prob(f, w, slo)
    means: dict[str, float | None] = {k: float(v.mean()) for k, v in meet.items()}
    means["tool_turn"] = float(meet["tool_turn"][w.has_tool].mean()) if w.has_tool.any() else None
    ttft = f["ttft"]
    hist, _ = np.histogram(np.clip(ttft, TTFT_EDGES[0], TTFT_EDGES[-1]), bins=TTFT_EDGES)
    return LoadFigures(st, means, hist / (ttft.shape[0] * ttft.shape[1]))


@dataclass
class Prediction:
    """What the model predicts for one replay (the keys of ``slo_attainment``, and percentiles)."""

    attainment: dict
    percentiles: dict
    loads: list = field(default_factory=list)  # (time_s, n, step_s, wait_s, mean hit prob)


def predict(jobs: Sequence[Job], lim: Limits, cost: StepCost, slo: SLOSpec, *, dt_s: float | None = None) -> Prediction:
    """Attainment and latency percentiles of replaying ``jobs`` (with their arrival times)."""
    w = Workload.of(jobs, lim.block_size)
    _check_fits(jobs, w, lim)
    arrivals = w.job_arrival_s
    span_in = float(arrivals.max() - arrivals.min()) if len(arrivals) else 0.0
    dt = dt_s or max(0.05, min(1.0, (span_in + 60.0) / 2000.0))
    cache: dict[int, LoadFigures] = {}

    def at(n: int) -> LoadFigures:
        if n not in cache:
            cache[n] = load_figures(solve_load(float(n), w, lim, cost), w, slo)
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
        figures = at(n)
        st = figures.state
        rate = 1.0 / (w.job_turns[inside] * st.residence_s + w.job_tool_s[inside])
        step = np.minimum(rate * dt, 1.0 - progress[inside])
        progress[inside] += step
        turns_run = step * w.job_turns[inside]
        weights[n] = weights.get(n, 0.0) + float(turns_run.sum())
        log_ok[inside] += turns_run * float(np.log(max(figures.meet["turn"], 1e-300)))
        t += dt
        done = inside & (progress >= 1.0 - 1e-12)
        finish[done] = t
        loads.append((t, n, st.step_s, st.wait_s, float(st.kept.mean())))
    return _summarize(w, cache, weights, finish, log_ok, slo, loads)


def _check_fits(jobs: Sequence[Job], w: Workload, lim: Limits) -> None:
    """The engine cannot run a turn whose KV (prompt and output but the last token) is larger than
    its whole pool: refused as a replay refuses it, rather than predicted."""
    need = np.ceil((w.prompt + w.output - 1.0) / lim.block_size) * lim.block_size
    too_big = np.flatnonzero(need > lim.pool_tokens)
    if len(too_big):
        i = int(too_big[0])
        ends = np.cumsum(w.job_turns.astype(int))
        j = int(np.searchsorted(ends, i, side="right"))
        turn = i - (int(ends[j - 1]) if j else 0)
        raise ConfigError(f"job {jobs[j].job_id} turn {turn} needs {int(w.prompt[i] + w.output[i] - 1)} tokens of "
                          f"KV cache, more than the whole GPU pool ({lim.pool_tokens} tokens); use a larger SKU or "
                          "smaller model")


def _summarize(w: Workload, cache, weights, finish, log_ok, slo: SLOSpec, loads) -> Prediction:
    total = sum(weights.values())
    share = {n: v / total for n, v in weights.items()} if total else {}
    # shares of turns: a weighted mean of values <= 1 can round past 1 by an ulp
    att = {k: min(1.0, sum(share[n] * cache[n].meet[k] for n in share)) for k in ("ttft", "tpot", "turn")}
    att["tool_turn"] = min(1.0, sum(share[n] * cache[n].meet["tool_turn"] for n in share)) if w.has_tool.any() else None
    for k in ("ttft", "tpot", "tool_turn"):  # a kind the SLO leaves out has no attainment, as a replay reports it
        if getattr(slo, f"{k}_s") is None:
            att[k] = None
    jct = finish - w.job_arrival_s
    job_ok = np.exp(log_ok) * (jct <= slo.job_s if slo.job_s is not None else 1.0)
    span = float(np.nanmax(finish) - w.job_arrival_s.min()) if len(finish) else 1.0
    out_tok = float(w.output.mean())
    att.update(job_deadline=float(np.mean(jct <= slo.job_s)) if slo.job_s is not None else None,
               job=float(job_ok.mean()), job_goodput_per_s=float(job_ok.sum()) / span,
               token_goodput_per_s=sum(share[n] * cache[n].meet["turn"] for n in share) * total * out_tok / span,
               turns=int(len(w.output)), jobs=int(len(w.job_turns)), slo=slo.to_dict())
    pct = _percentiles(cache, share)
    pct.update(jct_mean_s=float(np.mean(jct)), makespan_s=span)
    return Prediction(attainment=att, percentiles=pct, loads=loads)


def _percentiles(cache, share) -> dict:
    """TTFT p50/p90 over turns (their histograms weighted by the turns run at each load) and TPOT
    p50/p90 (the mean step at each load, so weighted)."""
    hist = sum(sh * cache[n].ttft_hist for n, sh in share.items())
    c = np.cumsum(hist)

    def ttft_q(q: float) -> float:
        i = min(int(np.searchsorted(c, q * c[-1])), len(c) - 1)
        below = c[i - 1] if i else 0.0
        frac = (q * c[-1] - below) / hist[i] if hist[i] > 0 else 0.5
        return float(TTFT_EDGES[i] * (TTFT_EDGES[i + 1] / TTFT_EDGES[i]) ** frac)  # log-interpolated in the bin

    tv = np.array([cache[n].state.step_s for n in share])
    tw = np.array(list(share.values()))
    tpot = _wq(tv, tw, (0.5, 0.9))
    return {"ttft_p50_s": ttft_q(0.5), "ttft_p90_s": ttft_q(0.9), "tpot_p50_s": tpot[0], "tpot_p90_s": tpot[1]}


def _wq(values: np.ndarray, weights: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """Weighted quantiles ``qs`` of ``values`` (one sort for all of them)."""
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
