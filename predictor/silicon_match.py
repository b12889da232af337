"""GemmGrid: a measured GEMM table looked up at a model's (M, N, K), exactly or interpolated along N and K.

The tables sweep M densely (every M up to 17, then steps of 16 to 256 and of 256 to 4352, then
8192-32768) but N and K on a coarse grid (..., 4096, 5120, 6144, 7168, 8192, 10240, 12288, 16384,
51200, 65536). A model's projection is often between grid points (Llama-3.1-8B's gate_up has
N = 28672, its down K = 14336), so:

- M is never interpolated: only the table's own M values are scored.
- Along N or K the latency is interpolated linearly between the two grid points around the size
  (bilinearly when both are off the grid). Linear, not log-log: at fixed M and K a GEMM's time is
  close to affine in N (a fixed part plus output tiles that each cost the same), and likewise in K.
- How well that holds is measured, not assumed (``interpolation_check``): every interior grid point
  is predicted from its two neighbours as if it were missing, and the error is reported beside the
  scores, per direction and by how wide the bracket was.
"""
from __future__ import annotations

import bisect

import numpy as np
import pandas as pd

EXACT = "exact"


def _bracket(grid: list[int], x: int):
    """[(grid value, weight)] that interpolates ``x`` linearly on ``grid``, or None outside it."""
    i = bisect.bisect_left(grid, x)
    if i < len(grid) and grid[i] == x:
        return [(x, 1.0)]
    if i == 0 or i == len(grid):
        return None
    lo, hi = grid[i - 1], grid[i]
    w = (x - lo) / (hi - lo)
    return [(lo, 1.0 - w), (hi, w)]


class GemmGrid:
    """The bf16 GEMM table of one system (rows m, n, k, latency_s)."""

    def __init__(self, rows: pd.DataFrame):
        self.rows = rows
        self._lat = {(int(m), int(n), int(k)): float(t)
                     for m, n, k, t in zip(rows["m"], rows["n"], rows["k"], rows["latency_s"])}
        self.m_values = sorted({int(m) for m in rows["m"]})
        self.n_grid = sorted({int(n) for n in rows["n"]})
        self.k_grid = sorted({int(k) for k in rows["k"]})

    def lookup(self, m: int, n: int, k: int) -> tuple[float, str] | None:
        """(latency in seconds, how it was matched: "exact", "interp-n", "interp-k" or "interp-nk"),
        or None when M is not measured or N/K lie outside the grid or a corner is missing."""
        if (m, n, k) in self._lat:
            return self._lat[(m, n, k)], EXACT
        bn, bk = _bracket(self.n_grid, n), _bracket(self.k_grid, k)
        if bn is None or bk is None:
            return None
        total = 0.0
        for nn, wn in bn:
            for kk, wk in bk:
                t = self._lat.get((m, nn, kk))
                if t is None:
                    return None
                total += wn * wk * t
        how = "interp-" + ("n" if len(bn) == 2 else "") + ("k" if len(bk) == 2 else "")
        return total, how

    def interpolation_check(self, *, max_m: int | None = None) -> pd.DataFrame:
        """Leave-one-out along each direction: every interior grid point of N (of K) predicted from its
        two neighbours at the same M and K (M and N). Columns: direction, m, n, k, bracket_ratio
        (upper neighbour / lower), measured_s, interpolated_s, signed_pct."""
        out = []
        for direction, grid in (("n", self.n_grid), ("k", self.k_grid)):
            for i in range(1, len(grid) - 1):
                lo, mid, hi = grid[i - 1], grid[i], grid[i + 1]
                w = (mid - lo) / (hi - lo)
                for (m, n, k), t in self._lat.items():
                    if (n if direction == "n" else k) != mid or (max_m is not None and m > max_m):
                        continue
                    key_lo = (m, lo, k) if direction == "n" else (m, n, lo)
                    key_hi = (m, hi, k) if direction == "n" else (m, n, hi)
                    if key_lo in self._lat and key_hi in self._lat:
                        est = (1 - w) * self._lat[key_lo] + w * self._lat[key_hi]
                        out.append((direction, m, n, k, hi / lo, t, est))
        df = pd.DataFrame(out, columns=["direction", "m", "n", "k", "bracket_ratio", "measured_s", "interpolated_s"])
        df["signed_pct"] = (df["interpolated_s"] - df["measured_s"]) / df["measured_s"] * 100
        return df


def interpolation_summary(check: pd.DataFrame, used_ratios: dict[str, float]) -> pd.DataFrame:
    """MAPE, median and p90 of the leave-one-out check per direction: over every interior point, and
    over those whose bracket is at least as wide as the widest one a scored shape needed
    (``used_ratios``: direction -> that ratio; the wider the bracket, the larger the error)."""
    rows = []
    for direction, g in check.groupby("direction"):
        ape = g["signed_pct"].abs()
        widest = used_ratios.get(str(direction))
        rows.append({"direction": direction, "subset": "all", "n": len(g), "mape_pct": ape.mean(),
                     "median_ape_pct": ape.median(), "p90_ape_pct": ape.quantile(0.9)})
        if widest:
            wide = g[g["bracket_ratio"] >= widest * 0.999]
            if len(wide):
                a = wide["signed_pct"].abs()
                rows.append({"direction": direction, "subset": f"bracket >= x{widest:.2f}", "n": len(wide),
                             "mape_pct": a.mean(), "median_ape_pct": a.median(), "p90_ape_pct": a.quantile(0.9)})
    return pd.DataFrame(rows, columns=["direction", "subset", "n", "mape_pct", "median_ape_pct", "p90_ape_pct"])


def bracket_ratio(grid: list[int], x: int) -> float:
    """Upper / lower grid point around ``x`` (1.0 on the grid, inf outside it)."""
    b = _bracket(grid, x)
    if b is None:
        return float(np.inf)
    return b[-1][0] / b[0][0]
