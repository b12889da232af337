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
- ``retention_ci``: the share of text's right answers the protocol also gets right (both right /
  text right). Unlike the ratio of summed accuracies (``relative_ci``, still reported), a lucky gain
  cannot cancel a real loss: 54 right under text and 43 of them kept reads 0.80, however many of
  text's wrong answers the protocol happened to get right.
- ``simultaneous_level``: Bonferroni: with m protocols compared against text in one table, each
  interval the verdict reads is taken at 1 - 0.05 / m, so all m hold together at 95 %.
- ``above_chance``: text's accuracy must beat the task's chance rate by its exact (Clopper-Pearson)
  one-sided 95 % bound before any protocol is judged against it (a protocol cannot "keep" answers
  text got by luck).
- ``goal_verdict``: "yes" only when retention is at least the goal (0.95), its simultaneous lower
  bound at least the bound goal (0.90), text right often enough that such a bound could be shown
  (``min_text_right_to_pass``), at most 15 % of imported tokens recomputed, and text above chance;
  "no" when too much is recomputed or the whole simultaneous interval lies below the goal; "n too
  small to decide" otherwise, instead of reading a point estimate.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom

NUM_BOOTSTRAP = 2000
GOAL_RELATIVE_ACCURACY = 0.95   # retention the goal asks for (point)
GOAL_LOWER_BOUND = 0.90         # ... and its simultaneous lower bound (stretch: 0.95)
GOAL_RECOMPUTE_FRACTION = 0.15  # at most this share of the imported tokens recomputed
UNDECIDED = "n too small to decide"
NOT_ABOVE_CHANCE = "text not above chance"


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


def bootstrap_ci(values, *, num_resamples: int = NUM_BOOTSTRAP, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its percentile-bootstrap interval at ``level`` (95 %)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(num_resamples, x.size))].mean(axis=1)
    tail = 50.0 * (1.0 - level)
    return float(x.mean()), float(np.percentile(means, tail)), float(np.percentile(means, 100.0 - tail))


def relative_ci(num, den, *, num_resamples: int = NUM_BOOTSTRAP, seed: int = 0,
                level: float = 0.95) -> tuple[float, float, float]:
    """sum(num) / sum(den) with a paired bootstrap interval at ``level`` (examples resampled jointly).

    Resamples in which the denominator is 0 have no ratio and are left out of the percentiles.
    """
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if a.size == 0 or b.sum() == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(num_resamples, a.size))
    sa, sb = a[idx].sum(axis=1), b[idx].sum(axis=1)
    ratios = np.divide(sa, sb, out=np.full_like(sa, np.nan), where=sb > 0)
    tail = 50.0 * (1.0 - level)
    return float(a.sum() / b.sum()), float(np.nanpercentile(ratios, tail)), float(np.nanpercentile(ratios, 100.0 - tail))


def retention_ci(protocol_correct, text_correct, **kw) -> tuple[float, float, float]:
    """(kept, low, high): the share of text's right answers the protocol also got right, with a paired
    bootstrap interval (``relative_ci`` of both-right over text-right; ``level`` etc. pass through)."""
    p = np.asarray(protocol_correct, dtype=np.float64) > 0.5
    t = np.asarray(text_correct, dtype=np.float64) > 0.5
    return relative_ci((p & t).astype(float), t.astype(float), **kw)


def simultaneous_level(num_compared: int, family: float = 0.95) -> float:
    """Each interval's level so that ``num_compared`` of them hold together at ``family`` (Bonferroni)."""
    return 1.0 - (1.0 - family) / max(1, num_compared)


def above_chance(num_right: int, n: int, chance: float | None, confidence: float = 0.95) -> bool:
    """Whether ``num_right`` of ``n`` beats ``chance`` by the exact one-sided lower bound (True when the
    task has no chance rate, e.g. free text scored by ROUGE-L)."""
    if chance is None:
        return True
    if n <= 0 or num_right <= 0:
        return False
    from scipy.stats import beta

    return float(beta.ppf(1.0 - confidence, num_right, n - num_right + 1)) > chance


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


def goal_verdict(kept: float, lo: float, hi: float, recompute_fraction: float, *, num_text_right: int,
                 text_above_chance: bool = True, goal: float = GOAL_RELATIVE_ACCURACY,
                 bound: float = GOAL_LOWER_BOUND, max_recompute: float = GOAL_RECOMPUTE_FRACTION) -> str:
    """"yes", "no", ``UNDECIDED`` or ``NOT_ABOVE_CHANCE`` for one protocol's retention ``kept`` with its
    simultaneous interval [lo, hi] (see the module docstring).

    yes: kept >= goal and lo >= bound, at most ``max_recompute`` of the imported tokens recomputed, and
    text right on at least ``min_text_right_to_pass(bound)`` of the paired examples (fewer could not
    show the bound even if every answer were kept); no: recomputes too much, or the whole interval
    lies below the goal; otherwise the data cannot decide. Nothing is judged when text itself does
    not beat chance.
    """
    if not text_above_chance:
        return NOT_ABOVE_CHANCE
    if recompute_fraction > max_recompute:
        return "no"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return UNDECIDED
    if kept >= goal and lo >= bound:
        return "yes" if num_text_right >= min_text_right_to_pass(bound) else UNDECIDED
    if hi < goal:
        return "no"
    return UNDECIDED
