"""Summary statistics of per-repetition times, shared by every probe and the reporters."""
from __future__ import annotations

import numpy as np


def summarize(times_s, discard_first: bool = True) -> dict:
    """n, min, p20, median, p80, max, mean and coefficient of variation of times in seconds.

    The first repetition is dropped by default (it pays page faults, cold caches, clock ramp), as
    BabelStream and STREAM do; the raw list including it is kept by the caller.
    """
    t = np.asarray(times_s, dtype=np.float64)
    if discard_first and t.size > 1:
        t = t[1:]
    if t.size == 0:
        raise ValueError("no repetitions to summarize")
    mean = float(t.mean())
    return {
        "n": int(t.size),
        "t_min_s": float(t.min()),
        "t_p20_s": float(np.percentile(t, 20)),
        "t_median_s": float(np.median(t)),
        "t_p80_s": float(np.percentile(t, 80)),
        "t_max_s": float(t.max()),
        "t_mean_s": mean,
        "cv": float(t.std(ddof=1) / mean) if t.size > 1 and mean > 0 else 0.0,
    }


def rates(summary: dict, *, bytes_moved: float | None = None, flops: float | None = None) -> dict:
    """GB/s and TFLOP/s at the median (headline) and at the min time (best), in float64."""
    out = {}
    if bytes_moved:
        out["gbps_median"] = bytes_moved / summary["t_median_s"] / 1e9
        out["gbps_best"] = bytes_moved / summary["t_min_s"] / 1e9
    if flops:
        out["tflops_median"] = flops / summary["t_median_s"] / 1e12
        out["tflops_best"] = flops / summary["t_min_s"] / 1e12
    return out
