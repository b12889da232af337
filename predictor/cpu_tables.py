"""CPU op-cost tables: a step's time from the ``torch_ops`` probe rows alone (nothing fitted on steps).

``gpubench fit`` builds them from a run's ``torch_ops`` rows into the calibration's ``cpu_ops``
block (per dtype); ``StepModel`` on the CPU uses them when they are there. A step is priced op by
op as an eager PyTorch engine issues it (docs/predictor.md, "CPU op tables")::

    step = embed(T) + L x [2 rmsnorm(T,h) + linears + rope(T,q) + rope(T,kv) + kv_write(T,kv)
                           + attention + 2 residual_add(T,h) + silu_mul(T,ff)]
           + rmsnorm(S,h) + linear(S, vocab, h) + argmax(S, vocab)

- ``linear(M, N, K)``: the probe's thread-CPU seconds per weight element g = t / (N K) at its
  measured (K, N) nodes, interpolated in (log K, log N) and *linearly in M between the measured M*
  (the grid is dense; MKL is not monotone in M and no envelope is imposed). Past the largest
  measured M of a node, g grows in proportion to M (compute-bound); N and K outside the grid are
  clamped (a larger matrix streams at the same rate per element). ``layout`` says how the engine
  issues the projections: ``separate`` (q, k, v and gate, up as their own calls, as transformers
  and this project's torch engine do) or ``fused`` (one qkv and one gate_up call, as vLLM does).
- attention: laws fitted (non-negative least squares on relative error) to the probe's SDPA rows,
  so any head configuration can be priced. Decode, per step with B decode sequences of L_i keys::

      t = a + sum_i (b + c * H * d * L_i + e * Hkv * d * L_i)

  (CPU SDPA with grouped-query attention behaves as if it re-reads the cache per query head: c
  carries that; e the per-KV-head part). Prefill, per sequence of n new tokens over c cached::

      t = a + b * H * d * n + e * Hkv * d * (c + n) + p * H * d * pairs

  with pairs = n(n+1)/2 (causal, no cache) or n(c+n) (a boolean mask; every pair is computed),
  one coefficient set per mode. Each law is also fitted per probed head configuration (query heads
  per KV head 1, 3, 4, 7; head_dim 64, 128) and a model's coefficients are interpolated in
  log(group) between those of its head_dim (``config_coef``); the single law is the fallback.
- segments (rmsnorm, residual_add, silu_mul, rope, kv_write, embed, argmax): the probe's times
  at T rows of width W, taken after a 16 MiB weight-streaming GEMV, interpolated in (log T, log W),
  proportional to T past the largest T. What the op before a segment streamed sets its fixed cost
  (an RMSNorm of one row: ~40 us hot, ~150 us after 16 MiB here), so the probe also times T = 1
  after context GEMVs of 0..16 MiB and a segment at context c costs
  ``t(T, W, c) = t(T, W, 16 MiB) - (t(1, W, 16 MiB) - t(1, W, c))``, c linear between the nodes.

Machine phases: rows of the streaming families carry a reference GEMV timed with them; a row's
time enters the tables as (row / its reference) x (the run's median reference), so a table taken
over minutes on a shared host describes the run's typical phase, not whichever phase each row hit.

Uncertainty: every table keeps the probe's spread (p20..p80 over repetitions, relative), every law
its fit's relative residuals, and the run its reference GEMV's 10th and 90th percentile relative
to the median (how far the machine's phases moved a streaming op during the run);
:meth:`CpuOpTables.interval_factors` combines them into an 80 % interval for a step.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from common.errors import ConfigError

SCHEMA = "gpubench.cpu_ops/1"
LAYOUTS = ("separate", "fused")
SEGMENTS = ("rmsnorm", "residual_add", "silu_mul", "rope", "kv_write", "embed", "argmax")
DECODE_TERMS = ("a", "b", "c_q", "e_kv")
MAIN_CONTEXT_ELEMENTS = 1 << 22  # the segment grid's context GEMV (16 MiB of fp32)
PREFILL_TERMS = ("a", "b_new", "e_kv", "p_pairs")


def _interp_1d(xs, ys, x: float, *, proportional_past_end: bool) -> float:
    """Linear interpolation of ys over increasing xs; clamped below; past the end either clamped or
    scaled by x / xs[-1] (work proportional to x)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * (x / xs[-1]) if proportional_past_end else ys[-1]
    j = bisect.bisect_right(xs, x)
    w = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    return ys[j - 1] + w * (ys[j] - ys[j - 1])


def _bracket(grid: list, v: float) -> tuple[int, int, float]:
    """Indices (i, j) and weight w of v between grid[i] and grid[j] in log space (clamped)."""
    if v <= grid[0]:
        return 0, 0, 0.0
    if v >= grid[-1]:
        n = len(grid) - 1
        return n, n, 0.0
    j = bisect.bisect_right(grid, v)
    w = (math.log(v) - math.log(grid[j - 1])) / (math.log(grid[j]) - math.log(grid[j - 1]))
    return j - 1, j, w


@dataclass(frozen=True)
class Curve1D:
    """Seconds (or seconds per element) at increasing x; see _interp_1d."""

    x: tuple
    y: tuple

    def at(self, v: float, *, proportional_past_end: bool = True) -> float:
        return _interp_1d(self.x, self.y, v, proportional_past_end=proportional_past_end)


class _Grid2D:
    """Curves over x on a (u, v) grid: value(u, v, x) = bilinear in (log u, log v) of curve(x)."""

    def __init__(self, nodes: dict):
        # nodes: (u, v) -> Curve1D. Missing (u, v) combinations are filled from the nearest u row.
        self.nodes = nodes
        self.us = sorted({u for u, _ in nodes})
        self.vs = sorted({v for _, v in nodes})

    def _curve(self, u, v) -> Curve1D:
        if (u, v) in self.nodes:
            return self.nodes[(u, v)]
        # nearest measured v at this u (shapes over the size cap were not measured)
        vs = [vv for uu, vv in self.nodes if uu == u]
        best = min(vs, key=lambda vv: abs(math.log(vv) - math.log(v)))
        return self.nodes[(u, best)]

    def curve_at(self, u: float, v: float, xs: list) -> Curve1D:
        """The interpolated curve at (u, v), sampled at xs (and past them by each node's rule)."""
        iu, ju, wu = _bracket(self.us, u)
        iv, jv, wv = _bracket(self.vs, v)
        corners = [((iu, iv), (1 - wu) * (1 - wv)), ((iu, jv), (1 - wu) * wv),
                   ((ju, iv), wu * (1 - wv)), ((ju, jv), wu * wv)]
        ys = []
        for x in xs:
            tot = 0.0
            for (a, b), w in corners:
                if w:
                    tot += w * self._curve(self.us[a], self.vs[b]).at(x)
            ys.append(tot)
        return Curve1D(tuple(xs), tuple(ys))


def config_coef(law: dict, heads: int, kv_heads: int, head_dim: int) -> dict:
    """A law's coefficients for a head configuration: interpolated in log(group) between the probed
    configurations of the nearest head_dim (clamped outside them); the single law without any."""
    entries = law.get("by_config") or []
    if not entries:
        return dict(law["coef"])
    dims = sorted({e["head_dim"] for e in entries})
    best_dim = min(dims, key=lambda v: (abs(math.log(v) - math.log(head_dim)), -v))
    rows = sorted((e for e in entries if e["head_dim"] == best_dim), key=lambda e: e["group"])
    i, j, w = _bracket([e["group"] for e in rows], heads / kv_heads)
    return {k: (1 - w) * rows[i]["coef"][k] + w * rows[j]["coef"][k] for k in rows[i]["coef"]}


class CpuOpTables:
    """The fitted tables for one dtype; ``to_dict``/``from_dict`` are the calibration's ``cpu_ops.<dtype>``."""

    def __init__(self, d: dict):
        self.d = d
        lin = d["linear"]
        self.linear = _Grid2D({(int(n["k"]), int(n["n"])): Curve1D(tuple(n["m"]), tuple(n["s_per_element"]))
                               for n in lin["nodes"]})
        self.linear_m = sorted({m for n in lin["nodes"] for m in n["m"]})
        # vLLM's own linear (oneDNN, prepacked weights; the vllm_ops probe), when the run had it
        vl = d.get("linear_vllm")
        self.linear_vllm = None if not vl else _Grid2D(
            {(int(n["k"]), int(n["n"])): Curve1D(tuple(n["m"]), tuple(n["s_per_element"])) for n in vl["nodes"]})
        self.linear_vllm_m = sorted({m for n in vl["nodes"] for m in n["m"]}) if vl else []
        self.segments = {name: _Grid2D({(int(n["w"]), 1): Curve1D(tuple(n["t"]), tuple(n["s"])) for n in nodes})
                         for name, nodes in d["segments"].items()}
        # per segment and width: the T = 1 cost as a function of the context's bytes
        self.segment_context = {name: {int(n["w"]): Curve1D(tuple(n.get("context_bytes") or ()), tuple(n.get("s_at_t1") or ()))
                                       for n in nodes} for name, nodes in d["segments"].items()}
        self.itemsize = 2 if d.get("dtype") == "bf16" else 4
        self.decode = d["attn_decode"]["coef"]
        self.prefill = {mode: d["attn_prefill"][mode]["coef"] for mode in ("causal", "masked")}

    def to_dict(self) -> dict:
        return self.d

    @classmethod
    def from_dict(cls, d, where: str) -> "CpuOpTables":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object")
        for key in ("linear", "attn_decode", "attn_prefill", "segments"):
            if key not in d:
                raise ConfigError(f"{where}: missing '{key}'")
        try:
            tables = cls(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: malformed cpu_ops table ({type(e).__name__}: {e})") from None
        missing = [s for s in SEGMENTS if s not in tables.segments]
        if missing:
            raise ConfigError(f"{where}: segments lack {', '.join(missing)}")
        return tables

    # ------------------------------------------------------------------ use
    def linear_curve(self, n: int, k: int, ms: list, engine: str = "torch") -> Curve1D:
        """Seconds of one ``linear(M, n, k)`` call at each M in ``ms`` (then proportional past them);
        ``engine="vllm"``: vLLM's oneDNN linear (``linear_vllm``; ConfigError without it)."""
        if engine == "vllm":
            if self.linear_vllm is None:
                raise ConfigError("these cpu_ops tables have no vLLM linear rows (run the vllm_ops probe)")
            per_element = self.linear_vllm.curve_at(k, n, ms)
            return Curve1D(per_element.x, tuple(v * n * k for v in per_element.y))
        per_element = self.linear.curve_at(k, n, ms)
        return Curve1D(per_element.x, tuple(v * n * k for v in per_element.y))

    def segment_curve(self, name: str, width: int, ts: list, context_bytes: float | None = None) -> Curve1D:
        """Seconds of segment ``name`` at each T in ``ts`` for ``width``; after a GEMV that streamed
        ``context_bytes`` (None: the grid's 16 MiB context, i.e. fully evicted caches)."""
        main = self.segments[name].curve_at(width, 1, ts)
        if context_bytes is None:
            return main
        delta = self._context_delta(name, width, float(context_bytes))
        return Curve1D(main.x, tuple(max(v - delta, 0.05 * v) for v in main.y))

    def _context_delta(self, name: str, width: int, context_bytes: float) -> float:
        """How much less a segment's T = 1 cost is after ``context_bytes`` than after the grid's
        context, interpolated in log width between the measured widths (0 without context rows)."""
        by_w = self.segment_context[name]
        widths = sorted(w for w, c in by_w.items() if len(c.x) >= 2)
        if not widths:
            return 0.0
        i, j, wgt = _bracket(widths, width)

        def delta_at(w):
            c = by_w[w]
            # c.y[-1]: T = 1 at the largest context, the grid's own (its main T = 1 row)
            return max(0.0, c.y[-1] - c.at(context_bytes, proportional_past_end=False))

        return (1 - wgt) * delta_at(widths[i]) + wgt * delta_at(widths[j])

    def interval_factors(self) -> tuple[float, float]:
        """(low, high) factors of an 80 % interval around a step prediction: the run's machine-phase
        spread (reference GEMV p10/p90 over its median), widened by the probes' repetition spread and
        the attention laws' fit error in quadrature."""
        phase = self.d.get("phase_spread") or {"p10": 1.0, "p90": 1.0}
        other = math.sqrt(sum(p * p for p in (self.d["linear"].get("spread", 0.0), self.d.get("segment_spread", 0.0),
                                              self.d["attn_decode"].get("fit_mape", 0.0))))
        low = max(0.05, phase["p10"] - other)
        return low, phase["p90"] + other


def decode_terms(batch, kv_tokens, heads, kv_heads, head_dim) -> np.ndarray:
    """Columns of the decode law (DECODE_TERMS) for B sequences reading ``kv_tokens`` keys in total."""
    batch = np.asarray(batch, float)
    return np.stack([np.ones_like(batch), batch, heads * head_dim * kv_tokens, kv_heads * head_dim * kv_tokens], axis=1)


def prefill_pairs(new, cached, masked: bool):
    """Query-key pairs a prefill chunk of ``new`` tokens over ``cached`` computes: all n(c+n) under
    a boolean mask (torch's SDPA), n*c + n(n+1)/2 when causal (the masked half skipped)."""
    return new * (cached + new) if masked else new * cached + new * (new + 1) / 2


def prefill_terms(new, cached, heads, kv_heads, head_dim, masked: bool) -> np.ndarray:
    """Columns of the prefill law (PREFILL_TERMS) for one sequence per row."""
    new, cached = np.asarray(new, float), np.asarray(cached, float)
    pairs = prefill_pairs(new, cached, masked)
    return np.stack([np.ones_like(new), heads * head_dim * new, kv_heads * head_dim * (cached + new),
                     heads * head_dim * pairs], axis=1)
