"""Statistics that can tell a KV protocol apart from ``text`` on the same examples.

Every protocol answers the very same examples as ``text``, so the comparisons here are *paired*:

- ``mcnemar_exact``: the exact McNemar test on exact match. Only discordant examples carry
  information (text right and protocol wrong, or the reverse); under "no difference" each discordant
  example goes either way with probability 1/2, so the two-sided p-value is a binomial tail.
- ``bootstrap_ci`` / ``relative_ci``: percentile bootstrap intervals of a mean and of the accuracy
  ratio Σ protocol / Σ text, the ratio resampling examples jointly (pairs stay together).
- ``first_token_kl``: KL(text receiver || protocol receiver) of the first answer-token distribution, a
  continuous agreement measure: it moves when an import perturbs B's belief even if the greedy answer
  stays the same, which exact match needs hundreds of examples to see.
- ``median_ci``: the median of per-example KLs with a bootstrap interval (KL is heavy-tailed: a few
  broken examples would dominate a mean).
- ``goal_verdict``: "yes" only when the interval's lower bound clears the goal and text was right
  often enough that an exact bound could (``min_text_right_to_pass``), "no" when the whole interval
  is below it, and "n too small to decide" in between, instead of reading a point estimate.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom

NUM_BOOTSTRAP = 2000
GOAL_RELATIVE_ACCURACY = 0.95
GOAL_RECOMPUTE_FRACTION = 0.30
UNDECIDED = "n too small to decide"


def min_text_right_to_pass(goal: float = GOAL_RELATIVE_ACCURACY, confidence: float = 0.95) -> int:
    """The fewest examples ``text`` must get right before any protocol can be said to keep ``goal`` of it.

    A protocol right on all k of text's right examples has the exact (Clopper-Pearson) one-sided
    lower bound (1 - confidence)^(1/k) on the share it keeps; below the k where that bound reaches
    ``goal`` no outcome could show the goal met (59 for 0.95 at 95 %). The percentile bootstrap does
    not know this: with a handful of examples that all agree every resample gives the same ratio and
    the interval collapses to a point.
    """
    return math.ceil(math.log(1.0 - confidence) / math.log(goal))


def discordant_counts(protocol_correct, text_correct) -> tuple[int, int]:
    """(text right and protocol wrong, protocol right and text wrong) over paired 0/1 outcomes."""
    p = np.asarray(protocol_correct, dtype=np.float64) > 0.5
    t = np.asarray(text_correct, dtype=np.float64) > 0.5
    if p.shape != t.shape:
        raise ValueError(f"paired outcomes need the same length (got {p.size} and {t.size})")
    return int((t & ~p).sum()), int((p & ~t).sum())


def mcnemar_exact(text_only: int, protocol_only: int) -> float:
    """Two-sided exact McNemar p-value for the discordant counts.

    With d = text_only + protocol_only discordant examples, p = min(1, 2 · P[Binom(d, 1/2) <= min]).
    No discordant example means no evidence of a difference: p = 1.
    """
    if text_only < 0 or protocol_only < 0:
        raise ValueError("discordant counts must be >= 0")
    total = text_only + protocol_only
    if total == 0:
        return 1.0
    return float(min(1.0, 2.0 * binom.cdf(min(text_only, protocol_only), total, 0.5)))


def bootstrap_ci(values, *, num_resamples: int = NUM_BOOTSTRAP, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95 % percentile-bootstrap interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(num_resamples, x.size))].mean(axis=1)
    return float(x.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def relative_ci(num, den, *, num_resamples: int = NUM_BOOTSTRAP, seed: int = 0) -> tuple[float, float, float]:
    """sum(num) / sum(den) with a paired bootstrap interval (examples resampled jointly).

    Resamples in which the denominator is 0 have no ratio and are left out of the percentiles.
    """
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if a.size == 0 or b.sum() == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(num_resamples, a.size))
    sa, sb = a[idx].sum(axis=1), b[idx].sum(axis=1)
    ratios = np.divide(sa, sb, out=np.full_like(sa, np.nan), where=sb > 0)
    return float(a.sum() / b.sum()), float(np.nanpercentile(ratios, 2.5)), float(np.nanpercentile(ratios, 97.5))


def median_ci(values, *, num_resamples: int = NUM_BOOTSTRAP, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median of the finite values and its 95 % percentile-bootstrap interval."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, x.size, size=(num_resamples, x.size))], axis=1)
    return float(np.median(x)), float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def first_token_kl(reference_logits, other_logits) -> float:
    """KL(softmax(reference) || softmax(other)) in nats, over the full vocabulary.

    Accepts torch tensors or arrays of shape [vocab]; computed in float64 from log-softmax, so a
    distribution compared with itself gives exactly 0.
    """
    ref = _log_softmax(np.asarray(_to_numpy(reference_logits), dtype=np.float64).reshape(-1))
    oth = _log_softmax(np.asarray(_to_numpy(other_logits), dtype=np.float64).reshape(-1))
    if ref.shape != oth.shape:
        raise ValueError(f"logits over different vocabularies ({ref.size} vs {oth.size})")
    support = np.isfinite(ref)  # p == 0 terms contribute 0 (lim p log p); skipping them avoids -inf - -inf
    terms = np.exp(ref[support]) * (ref[support] - oth[support])
    return float(max(0.0, terms.sum()))


def _to_numpy(x):
    detach = getattr(x, "detach", None)
    return detach().cpu().double().numpy() if detach is not None else x


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - math.log(np.exp(shifted).sum())


def goal_verdict(rel_lo: float, rel_hi: float, recompute_fraction: float, *, num_text_right: int,
                 goal: float = GOAL_RELATIVE_ACCURACY, max_recompute: float = GOAL_RECOMPUTE_FRACTION) -> str:
    """"yes", "no" or ``UNDECIDED`` for one protocol's relative-accuracy interval [rel_lo, rel_hi].

    yes: the interval's lower bound is >= goal, at most ``max_recompute`` of the imported tokens
    recomputed, and text right on at least ``min_text_right_to_pass(goal)`` of the paired examples;
    no: recomputes too much, or the whole interval lies below the goal; otherwise (the interval
    straddles the goal, too few examples to pass, or no interval because text answered nothing
    right) the data cannot decide.
    """
    if recompute_fraction > max_recompute:
        return "no"
    if not (math.isfinite(rel_lo) and math.isfinite(rel_hi)):
        return UNDECIDED
    if rel_lo >= goal:
        return "yes" if num_text_right >= min_text_right_to_pass(goal) else UNDECIDED
    if rel_hi < goal:
        return "no"
    return UNDECIDED
