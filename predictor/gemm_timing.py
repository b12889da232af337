"""GemmTiming: what a GEMM's compute time adds to the roofline's FLOPs / rate, per M (its rows).

Two corrections, both fixed once the calibration and the op graph are known: the calibration's
measured eta_duty(M) curve, as a ratio to the scalar eta_duty every op's rate already holds, and
the monotone time envelope over M-tile segments. Separate from predictor.step because they are
tables built at set-up: StepModel reads them in its vectorized path and, through the bound
``duty_ratio_scalar`` and the envelope rows, in its ``predict_time`` hot path.
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from predictor import efficiency as eff
from predictor.ops import OpGraph

# M-tile segments the GEMM monotone envelope covers (128-row tiles: M up to ~1M tokens).
GEMM_ENVELOPE_SEGMENTS = 8192


class GemmTiming:
    """eta_duty(M) ratios and the time envelope of ``graph``'s GEMM ops.

    Args:
        graph: the op graph (its ``gemm_index``, M features, N and K).
        num_sms: SMs (GPU) or cores (CPU) of the hardware, for eta_cluster.
        tile: the architecture's (M, N) output tile (``efficiency.tile_shape``).
        flops_per_s: every op's rate with the scalar eta_duty (and without eta_cluster).
        curve: the calibration's ``eta_duty_by_m`` curve for the dtype, or None.
        eta_duty: the calibration's scalar eta_duty.
        wave: the calibration's wave_quantization (``efficiency.eta_cluster``; 1 unless fitted).
    """

    def __init__(self, graph: OpGraph, num_sms: int, tile: tuple, flops_per_s: np.ndarray, curve, eta_duty: float,
                 wave: float = 1.0):
        self.tile, self.wave = tile, wave
        self._setup_duty_curve(curve, eta_duty)
        self._setup_envelope(graph, num_sms, flops_per_s)

    def _setup_duty_curve(self, curve, eta_duty: float) -> None:
        """GEMM ops' eta_duty(M) / scalar eta_duty, as nodes in (log2 M, log ratio); None without a curve.

        StepModel's op rates hold the scalar eta_duty (attention and elementwise ops use it as is);
        a GEMM's rate is multiplied by this ratio at its M.
        """
        if curve is None:
            self._duty_lx = self._duty_ly = None
            self._duty_lx_list = self._duty_ly_list = None
            return
        self._duty_lx = np.log2(np.asarray(curve.x, dtype=np.float64))
        self._duty_ly = np.log(np.asarray(curve.value, dtype=np.float64) / eta_duty)
        self._duty_lx_list = self._duty_lx.tolist()
        self._duty_ly_list = self._duty_ly.tolist()

    def duty_ratio(self, m):
        """eta_duty(M) / scalar eta_duty for GEMMs with M rows (arrays; 1.0 without a curve)."""
        if self._duty_lx is None:
            return 1.0
        return eff.eta_duty_at(m, self._duty_lx, self._duty_ly)

    def duty_ratio_scalar(self, m: float) -> float:
        """``duty_ratio`` for one M in plain Python (the ``predict_time`` hot path)."""
        lx, ly = self._duty_lx_list, self._duty_ly_list
        if lx is None:
            return 1.0
        assert ly is not None  # set together with lx
        x = math.log2(max(m, 1.0))
        if x <= lx[0]:
            return math.exp(ly[0])
        if x >= lx[-1]:
            return math.exp(ly[-1])
        j = bisect.bisect_right(lx, x)
        w = (x - lx[j - 1]) / (lx[j] - lx[j - 1])
        return math.exp(ly[j - 1] + w * (ly[j] - ly[j - 1]))

    def _setup_envelope(self, g: OpGraph, num_sms: int, flops_per_s: np.ndarray) -> None:
        """Per GEMM op, the least compute time of any larger M, by M-tile segment.

        NOTE(predictor): wave quantization alone makes t_c fall when M crosses a tile boundary
        (133 tiles run as 2 waves, 264 tiles also run as 2 waves). But a GEMM with M rows can always
        be run as the bigger GEMM with zero rows added, so its time is at most the least time of any
        M' >= M: t_c(M) = min(raw(M), min over later segments of raw(segment start)). This keeps the
        model monotone in batch and context and never lowers it below FLOPs / peak.
        """
        t_m = self.tile[0]
        starts = np.arange(1, GEMM_ENVELOPE_SEGMENTS + 1, dtype=np.float64) * t_m + 1  # first M of segment a+1
        env = np.full((g.gemm_index.size, GEMM_ENVELOPE_SEGMENTS + 2), np.inf)
        for j, i in enumerate(g.gemm_index):
            flops_per_m = g.flops[i, g.gemm_m_feature[j]]
            cluster = eff.eta_cluster(starts, g.gemm_n[j], g.gemm_k[j], num_sms, self.tile, self.wave)
            cluster = cluster * self.duty_ratio(starts)
            raw = starts * flops_per_m / (flops_per_s[i] * cluster)
            # env[j, a] = least raw time over segments after segment a (a = ceil(M / t_m))
            env[j, 1:GEMM_ENVELOPE_SEGMENTS + 1] = np.minimum.accumulate(raw[::-1])[::-1]
        self.env = env  # (num GEMM ops, segments + 2): row j is graph.gemm_index[j]
        self.env_list = [list(row) for row in env]

    def segment(self, m):
        """Index into the envelope table of a GEMM's M (past the table: its last, infinite, column)."""
        return np.minimum(np.ceil(np.maximum(m, 1.0) / self.tile[0]), GEMM_ENVELOPE_SEGMENTS + 1).astype(np.intp)
