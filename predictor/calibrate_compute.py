"""The compute side of a calibration fitted from a run: eta_active from the ``peak`` probe, eta_duty
and its per-M curve eta_duty(M) from the ``gemm`` probe (predictor.calibrate assembles them with
the memory law, the clock and the launch costs).

Separate from the rest of ``gpubench fit`` because these fits share one model of a GEMM's
throughput, P x f_clk x eta_cluster x eta_active x eta_duty (predictor.efficiency), and its
identity check against the rows, which nothing else in the fit uses.
"""
from __future__ import annotations

import math

import numpy as np

from gpubench.report import valid_rows
from predictor import efficiency as eff
from predictor.calibration_model import Curve, Param
from predictor.hardware import HardwareSpec


def finite_or_none(x) -> float | None:
    """``x`` as a float, or None when it is not finite (an error bar nobody could compute)."""
    x = float(x)
    return x if math.isfinite(x) else None


def fit_active(run, hw: HardwareSpec, dtype: str, f: float, base: Param) -> Param:
    """eta_active = best `peak` throughput for dtype / (spec peak x clock factor of that row)."""
    pk = valid_rows(run.frames.get("peak"))
    if pk is None or len(pk) == 0 or "dtype" not in pk.columns:
        return base
    pk = pk[pk["dtype"] == dtype]
    if len(pk) == 0:
        return base
    row = pk.loc[pk["tflops_median"].idxmax()]
    f_row, how = f, "the step clock factor"
    ref, mean = row.get("clock_max_ref_mhz"), row.get("clock_mhz_mean")
    meas, spec_clk = row.get("clock_mhz_measured"), row.get("spec_clock_mhz")
    # a clock the probe measured itself beats telemetry (a VM's /proc/cpuinfo reports a constant)
    if meas is not None and spec_clk is not None and is_finite(meas) and is_finite(spec_clk) and spec_clk > 0:
        f_row, how = float(meas) / float(spec_clk), "that row's measured clock / spec clock"
    elif hw.backend == "cuda" and hw.spec_clock_mhz and mean is not None and is_finite(mean) and mean > 0:
        # the same reference as f_clk (predictor.calibrate._fit_clock): the clock the spec peak is quoted at
        f_row, how = float(mean) / hw.spec_clock_mhz, f"that row's mean clock / the spec clock {hw.spec_clock_mhz:.0f} MHz"
    elif ref is not None and mean is not None and is_finite(ref) and is_finite(mean) and ref > 0 and mean > 0:
        f_row, how = float(mean) / float(ref), "that row's own mean/max clock"
    measured = float(row["tflops_median"]) * 1e12
    value = eff.eta_active(measured, hw.peak(dtype), f_row)
    cv = row.get("cv")
    err = value * float(cv) if cv is not None and is_finite(cv) else None
    return Param(value, err, "measured", f"{run.run_dir}: peak {row['key']} median {measured / 1e12:.3g} TFLOP/s "
                 f"/ spec {hw.peak(dtype) / 1e12:.3g} / f_clk {f_row:.3f} ({how})")


def is_finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def fit_duty(run, hw: HardwareSpec, dtype: str, f: float, active: float, eta_max: float, x_half: float,
              base: Param) -> tuple[Param, dict]:
    """eta_duty: median over compute-bound gemm rows of measured / (P f_clk eta_cluster eta_active).

    A row counts as compute bound when the memory law predicts under half of its measured time;
    if none does, the rows with the largest M are used (and the source says so).
    """
    g = valid_rows(run.frames.get("gemm"))
    if g is None or len(g) == 0 or "dtype" not in g.columns:
        return base, {}
    g = g[g["dtype"] == dtype]
    if len(g) == 0:
        return base, {}
    peak = hw.peak(dtype)
    m, n, k = (g[c].to_numpy(float) for c in ("m", "n", "k"))
    measured = g["tflops_median"].to_numpy(float) * 1e12
    cluster = eff.eta_cluster(m, n, k, hw.num_sms, eff.tile_shape(hw.arch))
    duty = eff.eta_duty(measured, peak, f, cluster, active)
    t_meas = g["flops"].to_numpy(float) / measured
    nbytes = g["bytes"].to_numpy(float)
    t_mem = (nbytes + x_half * hw.l2_bytes) / (hw.mem_bytes_per_s * eta_max)
    keep = t_mem < 0.5 * t_meas
    how = f"{int(keep.sum())} compute-bound gemm rows (memory law < half the measured time)"
    if not keep.any():
        keep = m == m.max()
        how = f"{int(keep.sum())} gemm rows at the largest M={int(m.max())} (none compute bound)"
    d = duty[keep]
    q75, q25 = np.percentile(d, [75, 25])
    value = float(np.median(d))
    # the identity check: eta_c * P against every kept row's measured throughput
    pred = peak * f * cluster[keep] * active * value
    report = {"eta_duty_rows": int(keep.sum()),
              "gemm_identity_mape": float(np.mean(np.abs(pred - measured[keep]) / measured[keep]))}
    return Param(value, finite_or_none((q75 - q25) / 1.349), "measured",
                 f"{run.run_dir}: median over {how}; error = IQR/1.349"), report


def fit_duty_curve(m, duty) -> dict:
    """eta_duty as a function of M from per-row duties: the median over rows (the (N, K) shapes)
    at each measured M, then the time envelope (efficiency.duty_time_envelope).

    Returns {"x", "raw", "value", "error", "num_rows"} (lists, x ascending); error per node is
    IQR/1.349 of that M's rows (None for a single row). ValueError without a finite positive duty.
    """
    m = np.asarray(m, dtype=np.float64)
    duty = np.asarray(duty, dtype=np.float64)
    ok = np.isfinite(m) & np.isfinite(duty) & (m >= 1) & (duty > 0)
    m, duty = m[ok], duty[ok]
    if m.size == 0:
        raise ValueError("no gemm row with a finite positive throughput")
    xs = np.unique(m)
    raw, err, num = [], [], []
    for x in xs:
        d = duty[m == x]
        raw.append(float(np.median(d)))
        q75, q25 = np.percentile(d, [75, 25])
        err.append(finite_or_none((q75 - q25) / 1.349) if d.size > 1 else None)
        num.append(int(d.size))
    value = eff.duty_time_envelope(xs, raw)
    return {"x": [float(x) for x in xs], "raw": raw, "value": [float(v) for v in value], "error": err, "num_rows": num}


def fit_gemm_fixed(run, hw: HardwareSpec, dtype: str) -> Param | None:
    """A GPU GEMM kernel's fixed time: the intercept of time against bytes over the gemm rows of
    ``dtype`` at the smallest M (one row of activations: the weights stream, and what does not grow
    with them is the kernel's ramp and tail). None on the CPU (the memory law's own x_half term
    covers it there), without two distinct shapes at that M, or when the line does not rise."""
    if hw.backend == "cpu":
        return None
    g = valid_rows(run.frames.get("gemm"))
    if g is None or len(g) == 0 or not {"dtype", "m", "bytes", "t_median_s"} <= set(g.columns):
        return None
    g = g[g["dtype"] == dtype]
    if len(g) == 0:
        return None
    g = g[g["m"] == g["m"].min()]
    x, t = g["bytes"].to_numpy(float), g["t_median_s"].to_numpy(float)
    if np.unique(x).size < 2:
        return None
    (slope, intercept), cov = np.polyfit(x, t, 1, cov=True) if x.size > 2 else (np.polyfit(x, t, 1), None)
    if not slope > 0 or not intercept > 0:
        return None
    err = finite_or_none(np.sqrt(cov[1, 1])) if cov is not None else None
    return Param(float(intercept), err, "measured",
                 f"{run.run_dir}: intercept of time against bytes over {x.size} gemm rows of {dtype} at M={int(g['m'].min())} "
                 f"(t = {intercept * 1e6:.2f} us + bytes / {1 / slope / 1e12:.3g} TB/s); error = its standard error")


def fit_duty_by_m(run, hw: HardwareSpec, dtype: str, f: float, active: float, fixed_s: float = 0.0) -> tuple[dict, dict]:
    """curves["eta_duty_by_m"][dtype] from every valid gemm row of the dtype (not only the
    compute-bound ones: at small M the probe's time is what a GEMM of that M costs, whatever
    bounds it, and that is what the per-M duty must reproduce).

    ``fixed_s``: each kernel's fixed time (``fit_gemm_fixed``), which the model charges on its own:
    the duty is then fitted on each row's time net of it (rows whose time is not above it are left
    out), so fixed time plus the curve's time reproduces every row."""
    g = valid_rows(run.frames.get("gemm"))
    if g is None or len(g) == 0 or "dtype" not in g.columns:
        return {}, {}
    g = g[g["dtype"] == dtype]
    if len(g) == 0:
        return {}, {}
    if fixed_s > 0:
        g = g[g["flops"] / (g["tflops_median"] * 1e12) > fixed_s]
    peak = hw.peak(dtype)
    m, n, k = (g[c].to_numpy(float) for c in ("m", "n", "k"))
    measured = g["tflops_median"].to_numpy(float) * 1e12
    flops = g["flops"].to_numpy(float)
    measured = flops / (flops / measured - fixed_s)  # the throughput of the time net of the fixed part
    cluster = eff.eta_cluster(m, n, k, hw.num_sms, eff.tile_shape(hw.arch))
    duty = eff.eta_duty(measured, peak, f, cluster, active)
    try:
        c = fit_duty_curve(m, duty)
    except ValueError as e:
        return {}, {"eta_duty_by_m_skipped": str(e)}
    # the identity check: eta_c(M) * P against every row's measured throughput
    at = eff.eta_duty_at(m, np.log2(c["x"]), np.log(c["value"]))
    pred = peak * f * cluster * active * at
    ok = measured > 0
    mape = float(np.mean(np.abs(pred[ok] - measured[ok]) / measured[ok]))
    lifted = int(sum(v > r * (1 + 1e-12) for v, r in zip(c["value"], c["raw"])))
    net = f" net of the fixed {fixed_s * 1e6:.2f} us per kernel" if fixed_s > 0 else ""
    src = (f"{run.run_dir}: per M, median over {len(g)} gemm rows of {dtype} ({len(c['x'])} M values, "
           f"{len(set(zip(n, k)))} (N, K) shapes) of measured{net} / (P f_clk eta_cluster eta_active); time envelope "
           f"raised {lifted} of them; error = IQR/1.349 per M; fit_error = MAPE of eta_c * P over the rows")
    curve = Curve(x=tuple(c["x"]), value=tuple(c["value"]), tier="measured", source=src, error=tuple(c["error"]),
                  raw=tuple(c["raw"]), num_rows=tuple(c["num_rows"]), fit_error=mape)
    return {"eta_duty_by_m": {dtype: curve}}, {"gemm_curve_identity_mape": mape, "eta_duty_by_m_points": len(c["x"])}
