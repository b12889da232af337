"""The two kinds of engine step the SLO model prices (point 2 of scheduling.slo.model), and the
TPOT a turn sees when some of its decode steps also carry other turns' prefill."""
from __future__ import annotations

import math

import numpy as np

from scheduling.engine.step_cost import StepCost


class Steps:
    """Step times at one running batch: decodes only, and decodes plus prefill chunks (memoized per
    rounded size: the fixed point asks the same few sizes many times)."""

    def __init__(self, cost: StepCost, running: float, ctx_run: float, chunk: float) -> None:
        self.cost, self.decodes, self.ctx_run, self.chunk = cost, max(int(round(running)), 1), ctx_run, chunk
        self.decode_s = self.with_prefill(0)

    def with_prefill(self, tokens: float) -> float:
        p = int(round(min(tokens, self.chunk)))
        return self.cost.step_s(num_prefill_tokens=p, num_prefill_seqs=int(p > 0),
                                prefill_context_tokens=int(self.ctx_run) if p > 0 else 0,
                                num_decode_seqs=self.decodes, decode_context_tokens=int(self.decodes * self.ctx_run))

    def prefill_time(self, uncached: float, shared_tokens: float) -> float:
        """A prefill of ``uncached`` tokens: its chunks, each in a step with at least ``shared_tokens``."""
        k = max(1.0, math.ceil(uncached / self.chunk))
        return k * self.with_prefill(max(uncached / k, shared_tokens))


def step_mix(steps: Steps, turns_per_s: float, unc: float, s: float) -> tuple[float, float, float]:
    """(q, tokens in a prefill-carrying step, s_p) at a turn rate and mean step (point 2)."""
    arriving = turns_per_s * unc * s  # prefill tokens arriving per step
    per_step = min(max(min(unc, steps.chunk), arriving), steps.chunk)
    q = min(1.0, arriving / per_step) if per_step > 0 else 0.0
    return q, per_step, steps.with_prefill(per_step)


def tpot_meet_probability(output: np.ndarray, target: float, *, decode_s: float, prefill_s: float,
                          prefill_share: float) -> np.ndarray:
    """Per turn of ``output`` tokens: P(TPOT <= target) when each of its o - 1 decode steps takes
    ``decode_s``, or ``prefill_s`` with probability ``prefill_share`` (it also carries prefill):
    the count of such steps binomial."""
    from scipy.stats import binom

    m = np.maximum(output - 1.0, 1.0)
    extra = prefill_s - decode_s
    if target < decode_s:
        return np.zeros(len(output))
    if extra <= 0 or prefill_share <= 0:
        return np.ones(len(output))
    allowed = np.floor((target - decode_s) * m / extra + 1e-9)
    return binom.cdf(allowed, m, min(prefill_share, 1.0))
