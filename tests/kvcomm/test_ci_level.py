"""The bootstraps' interval is the 95 % one: each is checked against the exact bootstrap
distribution of a case where it is known in closed form (binomial), so a 90 % or 99 % level fails."""
from __future__ import annotations

import numpy as np
from scipy.stats import binom

from kvcomm.metrics import bootstrap_ci, median_ci, relative_ci

N, K, R = 26, 13, 20000  # 26 examples, 13 correct; 20,000 resamples
# (no binomial CDF value lies within 0.01 of 0.025 or 0.975 here: 20,000 resamples decide each percentile)


def _exact_mean_interval(level: float) -> tuple[float, float]:
    """The resampled mean of K ones among N is Binomial(N, K/N) / N: its percentiles exactly."""
    a = (1 - level) / 2
    return binom.ppf(a, N, K / N) / N, binom.ppf(1 - a, N, K / N) / N


def test_the_levels_differ_in_this_case():
    assert _exact_mean_interval(0.95) != _exact_mean_interval(0.90) and _exact_mean_interval(0.95) != _exact_mean_interval(0.99)


def test_bootstrap_ci_is_95_percent():
    x = np.r_[np.ones(K), np.zeros(N - K)]
    mean, lo, hi = bootstrap_ci(x, num_resamples=R, seed=1)
    assert mean == K / N and (lo, hi) == _exact_mean_interval(0.95)


def test_relative_ci_is_95_percent():
    x = np.r_[np.ones(K), np.zeros(N - K)]
    rel, lo, hi = relative_ci(x, np.ones(N), num_resamples=R, seed=2)  # sum(x)/N: the same binomial
    assert rel == K / N and (lo, hi) == _exact_mean_interval(0.95)


def test_median_ci_is_95_percent():
    n = 39  # distinct values 1..n: the resampled median is <= k iff at least 20 draws are <= k
    # (n chosen so that no P(median <= k) lies within 0.009 of 0.025 or 0.975: 20,000 resamples decide)
    x = np.arange(1, n + 1, dtype=float)
    cdf = [binom.sf((n + 1) // 2 - 1, n, k / n) for k in range(1, n + 1)]  # P(median <= k)
    lo_exact = 1 + next(i for i, c in enumerate(cdf) if c >= 0.025)
    hi_exact = 1 + next(i for i, c in enumerate(cdf) if c >= 0.975)
    lo90 = 1 + next(i for i, c in enumerate(cdf) if c >= 0.05)
    assert lo90 != lo_exact
    med, lo, hi = median_ci(x, num_resamples=R, seed=3)
    assert med == 20 and (lo, hi) == (lo_exact, hi_exact)
