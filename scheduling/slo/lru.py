"""LRU prefix caching as a characteristic time (Che's approximation), for the SLO model.

A finished turn's blocks stay cached, free, until its job's next turn takes them back or LRU
evicts them. vLLM frees a request's blocks tail first, so a freed context sits in the free queue
as a run of tokens whose tail goes first: LRU eats it from its end, at the rate new tokens are
allocated (``evict_rate``: the prefill and output tokens written per second), and a turn that comes
back finds the part that is left (a partial hit).

With free pool tokens F and turns arriving at X per second, every context's tail survives the same
time T_C after its turn ends; its last token, c / evict_rate later. T_C is the time at which the
contexts held fill the free pool: X x E[tokens of its context held, integrated over the time until
its turn takes it back] = F. The time until a turn takes its context back is its tool gap plus its
queueing, the queueing exponential with the load's mean wait (a few equally likely points).
"""
from __future__ import annotations

import math

import numpy as np

QUEUE_POINTS = 8


def queue_points(wait_s: float) -> np.ndarray:
    """``QUEUE_POINTS`` equally likely waits of an exponential queueing with mean ``wait_s`` (its
    mid-quantiles, scaled so that their mean is ``wait_s``); zeros without queueing."""
    if wait_s <= 0:
        return np.zeros(1)
    q = (np.arange(QUEUE_POINTS) + 0.5) / QUEUE_POINTS
    points = -np.log1p(-q)
    return points * (wait_s / points.mean())


def kept_tokens(context: np.ndarray, t: np.ndarray, t_c: float, evict_rate: float) -> np.ndarray:
    """Tokens of a freed ``context`` still cached ``t`` seconds after its turn ended."""
    return np.clip(context - evict_rate * (t - t_c), 0.0, context)


def kept_integral(context: np.ndarray, t: np.ndarray, t_c: float, evict_rate: float) -> np.ndarray:
    """The integral of :func:`kept_tokens` from 0 to ``t``: what the context held of the free pool."""
    lo = max(t_c, 0.0)
    whole = context * np.minimum(t, lo)  # t >= 0
    hi = np.maximum(lo, np.minimum(t, t_c + context / evict_rate))
    eaten = (hi - lo) * (context - 0.5 * evict_rate * (hi + lo - 2.0 * t_c))  # the trapezoid's area
    return whole + eaten


class GapTable:
    """The later turns (context, tool gap before them) in a few hundred bins by gap, so that the
    characteristic-time search (thousands of evaluations per prediction) sums over bins, not turns."""

    BINS = 256

    def __init__(self, ctx: np.ndarray, gap: np.ndarray) -> None:
        later = np.isfinite(gap)
        order = np.argsort(gap[later], kind="stable")
        g, c = gap[later][order], ctx[later][order]
        self.num_turns = len(gap)
        edges = np.linspace(0, len(g), min(self.BINS, len(g)) + 1).astype(int)
        starts = edges[:-1][np.diff(edges) > 0]
        self.count = np.diff(np.append(starts, len(g))).astype(float)
        self.gap = np.add.reduceat(g, starts) / self.count if len(g) else np.zeros(0)
        self.ctx = np.add.reduceat(c, starts) / self.count if len(g) else np.zeros(0)
        self.max_ctx = float(c.max()) if len(c) else 0.0
        self.max_gap = float(g.max()) if len(g) else 0.0

    def held(self, t_c: float, waits: np.ndarray, evict_rate: float) -> float:
        """Mean over all turns (0 for first turns) of the context-seconds held in the free pool."""
        t = self.gap[:, None] + waits[None, :]
        held = kept_integral(self.ctx[:, None], t, t_c, evict_rate)
        return float((self.count[:, None] * held).sum()) / waits.size / max(self.num_turns, 1)


    def lost(self, t_c: float, waits: np.ndarray, evict_rate: float) -> float:
        """Mean over all turns (0 for first turns) of the context tokens evicted before the turn returns."""
        if math.isinf(t_c):
            return 0.0
        t = self.gap[:, None] + waits[None, :]
        kept = kept_tokens(self.ctx[:, None], t, t_c, max(evict_rate, 1e-9))
        return float((self.count[:, None] * (self.ctx[:, None] - kept)).sum()) / waits.size / max(self.num_turns, 1)


def che_time(free_tokens: float, rate: float, table: GapTable, waits: np.ndarray, evict_rate: float) -> float:
    """T_C with rate x held(T_C) = free tokens (inf when every context survives its gap and queueing)."""
    if not len(table.gap):
        return math.inf
    evict_rate = max(evict_rate, 1e-9)
    top = table.max_gap + float(waits.max())
    if rate * table.held(top, waits, evict_rate) <= free_tokens:
        return math.inf
    lo, hi = -table.max_ctx / evict_rate, top  # lo: every context gone as soon as it is freed
    for _ in range(36):  # 2^-36 of the bracket: far below a step
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rate * table.held(mid, waits, evict_rate) <= free_tokens else (lo, mid)
    return lo


def kept_share(context_prev: np.ndarray, gap_prev: np.ndarray, waits: np.ndarray, t_c: float,
               evict_rate: float) -> np.ndarray:
    """(waits, turns): the share of each turn's earlier context still cached when it is admitted,
    at each queueing point (1 for a first turn: its group's system prompt is cached)."""
    if math.isinf(t_c):
        return np.ones((waits.size, len(gap_prev)))
    later = np.isfinite(gap_prev)
    t = np.where(later, gap_prev, 0.0)[None, :] + waits[:, None]
    ctx = np.maximum(context_prev, 1.0)[None, :]
    share = kept_tokens(ctx, t, t_c, max(evict_rate, 1e-9)) / ctx
    return np.where(later[None, :], share, 1.0)
