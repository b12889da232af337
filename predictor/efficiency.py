"""The factorized efficiency model (docs/predictor.md): small pure functions, each one physical effect.

Compute efficiency of an op on a device with spec peak ``P`` (FLOP/s, by the FMA-count identity):

    eta_c = f_clk * eta_cluster * eta_active * eta_duty

Memory efficiency of an op that moves ``bytes`` through a device with bandwidth ``B`` and an
L2 (CPU: last-level cache) of ``l2_bytes``:

    eta_mem(x) = eta_max * x / (x + x_half),    x = bytes / l2_bytes

Every function takes and returns plain floats or numpy arrays (broadcasting), so the step model
can evaluate thousands of batches in one call.
"""
from __future__ import annotations

import numpy as np

# Published L2-reuse memory law constants (docs/predictor.md): defaults until a run is fitted.
PUBLISHED_ETA_MAX = 0.90
PUBLISHED_X_HALF = 0.477

# Output tile (t_m, t_n) that the GEMM library assigns to one SM (CPU: one core) per architecture.
# NOTE(predictor): why these shapes --
#   ampere:    cuBLAS/CUTLASS sm80 bf16 kernels mostly pick 128x128 or 256x128 CTA tiles; 128x128 is
#              the most common for LLM shapes (mma.sync 16x8x16 warps tiled 2x2 per CTA).
#   hopper:    sm90 WGMMA kernels use 128-row warpgroup tiles with N = 256 for large GEMMs
#              (CUTLASS 3 default 128x256x64 bf16 tile, one CTA per SM).
#   ada:       sm89 has no WGMMA; cuBLAS uses sm80-style 128x128 tiles.
#   blackwell: sm100 UMMA issues 128xN per SM (256xN across a 2-SM pair); 128x256 per SM.
#   cpu:       BLAS (OpenBLAS/MKL) splits C into per-thread macro-tiles; with a few cores a
#              64x256 block is a typical per-thread share, so wave quantization is small there.
TILE_SHAPES: dict[str, tuple[int, int]] = {
    "ampere": (128, 128),
    "hopper": (128, 256),
    "ada": (128, 128),
    "blackwell": (128, 256),
    "cpu": (64, 256),
}
DEFAULT_TILE = (128, 128)
# Smallest K slice a split-K GEMM gives one tile (libraries do not split K finer than this).
MIN_SPLIT_K = 256


def tile_shape(arch: str) -> tuple[int, int]:
    """The (t_m, t_n) output tile one SM computes for ``arch`` (see TILE_SHAPES for why)."""
    return TILE_SHAPES.get(arch, DEFAULT_TILE)


def f_clk(clock_droop: float | None) -> float:
    """Clock factor: achieved SM clock under sustained compute / the clock the spec peak assumes.

    A GPU running a large GEMM sags below its boost clock (power and thermal limits): an H100 SXM
    loses about 30 %. ``clock_droop`` is 1 - mean clock / reference clock; None means unknown (1.0).
    """
    if clock_droop is None:
        return 1.0
    return 1.0 - float(clock_droop)


def eta_cluster(m, n, k, num_sms: int, tile: tuple[int, int], wave: float = 1.0):
    """Wave quantization: the share of SM-slots in the GEMM's last wave that hold real work.

    The output M x N is cut into tiles of ``tile``; tiles run in waves of ``num_sms``. With
    tiles = ceil(M/t_m) * ceil(N/t_n) and waves = ceil(tiles/SMs), eta = tiles / (waves * SMs):
    a GEMM of 133 tiles on 132 SMs runs two waves with the second nearly empty (eta ~ 0.5).
    When there are fewer tiles than SMs, libraries split K across idle SMs (split-K), so the
    tile count is multiplied by min(SMs // tiles, K // MIN_SPLIT_K) before the waves are counted.
    Padding inside a tile (M = 1 in a 128-row tile) is not counted: small-M GEMMs are memory bound.

    ``wave`` is how much of that loss a GEMM library leaves: 1 for kernels that run whole tiles in
    waves, 0 for persistent (stream-K) kernels that share the last wave's work out among all SMs;
    between, the loss 1 - eta is scaled by it. A calibration fitted on measured GEMM tables sets it
    (``wave_quantization``); otherwise it is 1.
    """
    m = np.asarray(m, dtype=np.float64)
    t_m, t_n = tile
    tiles = np.ceil(np.maximum(m, 1.0) / t_m) * np.ceil(n / t_n)
    split = np.clip(np.minimum(num_sms // tiles, k // MIN_SPLIT_K), 1, None)
    tiles = tiles * split
    eta = tiles / (np.ceil(tiles / num_sms) * num_sms)
    return eta if wave == 1.0 else 1.0 - wave * (1.0 - eta)  # the default skips two array passes (hot path)


def eta_active(measured_peak_flops_per_s: float, spec_peak_flops_per_s: float, clock_factor: float) -> float:
    """Matrix-unit delivery: what the ``peak`` probe reaches with data in registers, as a share
    of the spec peak scaled to the clock actually held. 1.0 means the tensor cores (CPU: FMA
    units) deliver their nominal FMAs per clock; less means issue limits or unmodelled stalls.
    """
    return measured_peak_flops_per_s / (spec_peak_flops_per_s * clock_factor)


def eta_duty(measured_flops_per_s, spec_peak_flops_per_s: float, clock_factor: float, cluster, active: float):
    """Duty cycle: the rest of a real GEMM's loss once clock, waves and unit delivery are taken
    out -- barriers, pipeline fill and drain, epilogues, operand loads not hidden by the MMA.
    Chosen so that eta_c * P reproduces the measured GEMM throughput exactly.
    """
    return np.asarray(measured_flops_per_s) / (spec_peak_flops_per_s * clock_factor * np.asarray(cluster) * active)


def eta_mem(x, eta_max: float, x_half: float):
    """L2-reuse saturation law: achieved share of DRAM bandwidth for an op moving x L2-sizes.

    Small transfers cannot fill the memory pipeline (latency-bound, the start of the sweep); large
    ones approach ``eta_max`` of the bandwidth. ``x_half`` is the transfer size, in L2 sizes, that
    reaches half of eta_max. x = bytes moved by the op / L2 bytes.
    """
    x = np.asarray(x, dtype=np.float64)
    return eta_max * x / (x + x_half)


def eta_compute(clock_factor: float, cluster, active: float, duty: float):
    """eta_c = f_clk * eta_cluster * eta_active * eta_duty (the product that scales the spec peak)."""
    return clock_factor * np.asarray(cluster) * active * duty


def eta_duty_at(m, log2_m_nodes, log_duty_nodes):
    """Duty cycle of a GEMM with M rows, from a measured per-M curve (eta_duty fitted
    from gemm rows, so that eta_c * P reproduces the measured throughput at every measured M).

    A BLAS picks a different kernel by M: on a CPU, M = 1 is a GEMV that streams the weights once,
    while M = 2..8 runs a packed GEMM (weight packing not amortized over so few rows, as we read
    the timings), so per FLOP it is several times slower. Between measured M the curve is a power law (linear in log2 M of
    log eta), which keeps time ~ M / eta_duty(M) monotone between nodes whenever it is at the
    nodes; outside the measured range it is clamped to the end values (no extrapolation).
    """
    m = np.asarray(m, dtype=np.float64)
    return np.exp(np.interp(np.log2(np.maximum(m, 1.0)), log2_m_nodes, log_duty_nodes))


def duty_time_envelope(m_nodes, duty_nodes) -> np.ndarray:
    """Per-M duty raised where a larger measured M is faster in *time*: a GEMM of M rows can always
    run as the larger GEMM with zero rows added, so eta(M_i) >= eta(M_j) * M_i / M_j for M_j > M_i.

    Efficiency itself may fall with M (the M = 1 GEMV beats M = 2 per FLOP); only time falling
    with M is removed, which keeps the step model monotone in batch.
    """
    m = np.asarray(m_nodes, dtype=np.float64)
    d = np.asarray(duty_nodes, dtype=np.float64)
    # t_i ~ m_i / d_i; the envelope takes the least time of any node at or after i
    t_env = np.minimum.accumulate((m / d)[::-1])[::-1]
    return m / t_env
