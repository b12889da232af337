"""``gpubench fit``: the step model's efficiency parameters fitted from a gpubench run.

The fitted values become a :class:`predictor.calibration_model.Calibration` (that module holds the
data model, the JSON form, the defaults without a run and ``resolve``; its names are importable
from here too, as callers have always imported them). The compute side (eta_active, eta_duty and
eta_duty(M)) is fitted in predictor.calibrate_compute.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from common.errors import ConfigError
from predictor import efficiency as eff
from predictor.calibrate_compute import finite_or_none, fit_active, fit_duty, fit_duty_by_m, fit_gemm_fixed, is_finite, valid_rows
from predictor.calibrate_kernels import fit_kernels
from predictor.calibration_model import Calibration, Curve, Param, defaults, resolve, utc_now_iso  # noqa: F401 - resolve: re-exported
from predictor.hardware import HardwareSpec


# ====================================================================== fitting from a run
def triad_plateau(run) -> Param | None:
    """The CPU bandwidth B: STREAM triad headline (best) of the largest array in the run."""
    df = valid_rows(run.frames.get("stream"))
    if df is None or len(df) == 0 or "kernel" not in df.columns:
        return None
    tri = df[df["kernel"] == "triad"]
    if len(tri) == 0:
        return None
    size_col = "array_bytes" if "array_bytes" in tri.columns else "bytes"
    biggest = tri[tri[size_col] == tri[size_col].max()]
    best = float(biggest["gbps_best"].max()) * 1e9
    med = float(biggest["gbps_median"].median()) * 1e9
    return Param(best, abs(best - med), "measured",
                 f"{run.run_dir}: stream triad best of the largest array ({int(biggest[size_col].iloc[0])} B per array); "
                 f"error = best - median")


def run_hardware_overrides(run, hw: HardwareSpec) -> dict:
    """Device figures a run read at run time (SM/core count, L2/LLC) and, on a CPU, the measured B."""
    props = (run.manifest.get("device") or {}).get("properties") or {}
    src = f"{run.run_dir}/manifest.json device.properties"
    out = {}
    sms = props.get("sm_count") if hw.backend == "cuda" else props.get("num_cpus")
    if sms:
        out["num_sms"] = Param(float(sms), None, "measured", f"{src} ({'sm_count' if hw.backend == 'cuda' else 'num_cpus'})")
    l2 = props.get("l2_bytes") if hw.backend == "cuda" else props.get("llc_bytes")
    if l2:
        out["l2_bytes"] = Param(float(l2), None, "measured", f"{src} ({'l2_bytes' if hw.backend == 'cuda' else 'llc_bytes'})")
    if hw.backend == "cpu":
        b = triad_plateau(run)
        if b is not None:
            out["mem_bytes_per_s"] = b
    return out


def run_spec(run) -> HardwareSpec:
    """The spec of the device ``run`` measured: the SKU's, and for a CPU the CPU its manifest recorded
    (not the host the fit runs on: a run fits to the same calibration on any machine)."""
    from predictor.host_match import identity_from_device, recorded_cpu_spec

    device = run.manifest.get("device") or {}
    spec = recorded_cpu_spec(identity_from_device(device)) if device.get("backend") == "cpu" else None
    return spec if spec is not None else HardwareSpec.from_sku(run.sku)


def hardware_from_run(run) -> HardwareSpec:
    """The device a gpubench run measured (``run``: a loaded ``Run`` or a run directory): the SKU's
    spec with the SM/core count and L2/LLC of the manifest's device properties and, on a CPU, the
    STREAM triad headline of the largest array as its bandwidth (:func:`triad_plateau`).

    Here, not on HardwareSpec: reading a run is calibration's business (hardware.py is the spec
    table's view, below calibration)."""
    from gpubench import results

    if not hasattr(run, "manifest"):
        run = results.load(run)
    base = run_spec(run)
    over = run_hardware_overrides(run, base)
    changes = {k: (int(p.value) if k == "num_sms" else p.value) for k, p in over.items()}
    if "mem_bytes_per_s" in over:
        changes["mem_bw_tier"] = "measured"
    return base.replace(**changes)


def fit_eta_mem(x, eta) -> tuple[float, float, float, float, float]:
    """Least-squares fit of eta_mem(x) = eta_max * x / (x + x_half) (scipy curve_fit).

    Returns (eta_max, x_half, eta_max_stderr, x_half_stderr, mape) where mape is the mean absolute
    percentage error of the fitted law on the points. ValueError if fewer than 3 distinct x.
    """
    from scipy.optimize import curve_fit

    x = np.asarray(x, dtype=np.float64)
    eta = np.asarray(eta, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(eta) & (x > 0) & (eta > 0)
    x, eta = x[ok], eta[ok]
    if np.unique(x).size < 3:
        raise ValueError(f"need >= 3 distinct transfer sizes to fit eta_mem (have {np.unique(x).size})")
    p0 = (float(np.clip(eta.max(), 1e-3, 2.0)), float(np.clip(np.median(x), 1e-6, 1e4)))
    # relative residuals (sigma = eta): the sweep spans orders of magnitude in eta, and an absolute
    # fit would ignore the small transfers that set x_half
    popt, pcov = curve_fit(lambda xx, a, b: eff.eta_mem(xx, a, b), x, eta, p0=p0, sigma=eta,
                           bounds=([1e-6, 0.0], [2.0, 1e4]), maxfev=20000)
    perr = np.sqrt(np.clip(np.diag(pcov), 0, None))
    pred = eff.eta_mem(x, *popt)
    mape = float(np.mean(np.abs(pred - eta) / eta))
    return float(popt[0]), float(popt[1]), float(perr[0]), float(perr[1]), mape


def _memory_points(run, bw: float, l2_bytes: float):
    """(x, eta, sources) from the l2 cold sweep and the stream triad sweep of a run."""
    xs, etas, used = [], [], []
    l2 = valid_rows(run.frames.get("l2"))
    if l2 is not None and len(l2) and "mode" in l2.columns:
        cold = l2[l2["mode"] == "cold"]
        if len(cold):
            xs.append(cold["bytes"].to_numpy(float) / l2_bytes)
            etas.append(cold["gbps_median"].to_numpy(float) * 1e9 / bw)
            used.append(f"{len(cold)} l2 cold rows")
    st = valid_rows(run.frames.get("stream"))
    if st is not None and len(st) and "kernel" in st.columns:
        # triad only (copy/scale move uncounted write-allocate bytes), and only arrays past the cache:
        # STREAM repeats its kernel over the same arrays, so a cache-resident triad is not a cold transfer
        tri = st[(st["kernel"] == "triad") & (st["bytes"] >= l2_bytes)]
        if len(tri):
            xs.append(tri["bytes"].to_numpy(float) / l2_bytes)
            etas.append(tri["gbps_median"].to_numpy(float) * 1e9 / bw)
            used.append(f"{len(tri)} stream triad rows past the L2/LLC")
    if not xs:
        return np.array([]), np.array([]), []
    return np.concatenate(xs), np.concatenate(etas), used


def _fit_clock(run, hw: HardwareSpec, base: Param) -> Param:
    """f_clk, the achieved clock under compute load over the clock the spec peak assumes.

    GPU: the mean SM clock during the largest GEMMs (telemetry) over the spec clock, the clock the
    spec peak P is quoted at. eta_active is taken against the same clock
    (calibrate_compute.fit_active), so f_clk x eta_active x P is the rate at the GEMMs' clock and
    neither factor absorbs the other's reference (an H200 holds 1980 MHz at rest, above its 1830 MHz
    spec clock, and ~1530 MHz under a large GEMM). Without a spec clock: mean over max reference
    clock (1 - droop). CPU: the clock the `peak` probe measured with a dependent-add chain over the
    spec clock (f_clk > 1: the cores turbo above it), since CPU telemetry is often the constant
    nominal clock a hypervisor reports; gemm telemetry only when the probe has no clock row.
    """
    if hw.backend == "cpu":
        return _cpu_measured_clock(run, hw) or _telemetry_clock(run) or base
    return _telemetry_clock(run, hw) or base


def _telemetry_clock(run, hw: HardwareSpec | None = None) -> Param | None:
    g = valid_rows(run.frames.get("gemm"))
    if g is None or len(g) == 0 or not {"clock_mhz_mean", "clock_max_ref_mhz"} <= set(g.columns):
        return None
    g = g.dropna(subset=["clock_mhz_mean", "clock_max_ref_mhz"])
    g = g[(g["clock_max_ref_mhz"] > 0) & (g["clock_mhz_mean"] > 0)]
    if len(g) == 0:
        return None
    big = g[g["m"] == g["m"].max()]
    spec = hw.spec_clock_mhz if hw is not None and hw.backend == "cuda" and hw.spec_clock_mhz else None
    ref, what = (spec, f"spec clock {spec:.0f} MHz") if spec else (big["clock_max_ref_mhz"], "max SM clock")
    f = (big["clock_mhz_mean"] / ref).to_numpy(float)
    return Param(float(np.mean(f)), finite_or_none(np.std(f, ddof=1)) if f.size > 1 else None, "measured",
                 f"{run.run_dir}: gemm telemetry, mean SM clock {float(big['clock_mhz_mean'].mean()):.0f} MHz / {what} over "
                 f"{f.size} rows at M={int(big['m'].iloc[0])}")


def _cpu_measured_clock(run, hw: HardwareSpec) -> Param | None:
    pk = valid_rows(run.frames.get("peak"))
    if pk is None or len(pk) == 0 or "unit" not in pk.columns or hw.spec_clock_mhz <= 0:
        return None
    clk = pk[pk["unit"] == "dependent_add"]
    col = "clock_mhz_median" if "clock_mhz_median" in clk.columns else "clock_mhz_measured"
    if len(clk) == 0 or col not in clk.columns or not clk[col].notna().any():
        return None
    mhz = float(clk[col].dropna().median())
    cv: Any = clk["cv"].dropna() if "cv" in clk.columns else []  # a Series, or [] (only len() is asked of that)
    return Param(mhz / hw.spec_clock_mhz, finite_or_none(float(cv.iloc[0]) * mhz / hw.spec_clock_mhz) if len(cv) else None,
                 "measured", f"{run.run_dir}: peak dependent-add clock {mhz:.0f} MHz / spec clock "
                 f"{hw.spec_clock_mhz:.0f} MHz")


def _fit_launch(run, hw: HardwareSpec, params: dict) -> None:
    """t_launch_s / t_graph_node_s (CUDA device interval, graph node) or t_dispatch_s (CPU)."""
    la = valid_rows(run.frames.get("launch"))
    if la is None or len(la) == 0 or "kind" not in la.columns:
        return
    if hw.backend == "cpu":
        kinds = [("torch_dispatch", "t_dispatch_s"), ("py_ext_call", "t_dispatch_s")]
    else:
        kinds = [("device_interval", "t_launch_s"), ("graph_node", "t_graph_node_s")]
    done = set()
    for kind, name in kinds:
        rows = la[la["kind"] == kind]
        if name in done or len(rows) == 0:
            continue
        row = rows.loc[rows["count"].idxmax()]
        med = float(row["per_launch_s_median"])
        lo = row.get("per_launch_s_min")
        params[name] = Param(med, abs(med - float(lo)) if is_finite(lo) else None, "measured",
                             f"{run.run_dir}: launch {kind} per launch (median) at count {int(row['count'])}; error = median - min")
        done.add(name)


def fit_run(run_dir, dtype: str | None = None, argv: list | None = None, *, allow_contended: bool = False) -> Calibration:
    """Fit every parameter a run supports; the rest fall back to published, then spec, values.

    The calibration records the host the run measured (``meta.host``, see predictor.host_match).
    A run taken under contention is refused (ConfigError) unless ``allow_contended``; then it is
    fitted and marked (``meta.contended``: why). ``run_dir`` may also be a list of run directories
    of one device, each probe taken from the run that measured it (gpubench.results.load_many).

    Raises ResultsFormatError for a malformed run directory (from gpubench.results.load).
    """
    from gpubench import results
    from predictor.host_match import identity_from_device, run_contention

    run = results.load_many(run_dir if isinstance(run_dir, (list, tuple)) else [run_dir])
    contended = run_contention(run)
    if contended and not allow_contended:
        raise ConfigError(f"{run.run_dir}: taken under contention ({contended}): rerun when the machine is quiet, "
                          "or pass --allow-contended to fit anyway (the calibration is then marked)")
    hw0 = run_spec(run)
    if hw0.backend != run.backend:
        raise ConfigError(f"{run.run_dir}: manifest backend '{run.backend}' does not match SKU '{run.sku}' ({hw0.backend})")
    dtype = dtype or hw0.default_dtype
    hw0.peak(dtype)  # ConfigError early for a dtype this SKU has no peak for
    cal = defaults(hw0, dtype)
    hw_over = run_hardware_overrides(run, hw0)
    hw = hw0.replace(**{k: (int(p.value) if k == "num_sms" else p.value) for k, p in hw_over.items()})
    params = dict(cal.params)
    report: dict = {}

    x, eta, used = _memory_points(run, hw.mem_bytes_per_s, hw.l2_bytes)
    if len(used):
        try:
            a, b, ea, eb, mape = fit_eta_mem(x, eta)
            src = f"{run.run_dir}: curve_fit over {', '.join(used)} (x = bytes / {hw.l2_bytes:.3g} B L2; " \
                  f"eta = median GB/s / B {hw.mem_bytes_per_s / 1e9:.4g} GB/s " \
                  f"({hw.mem_bw_tier if 'mem_bytes_per_s' not in hw_over else 'measured'})); MAPE {mape:.2%}"
            params["eta_max"] = Param(a, finite_or_none(ea), "measured", src)
            params["x_half"] = Param(b, finite_or_none(eb), "measured", src)
            report["eta_mem_mape"] = mape
            report["eta_mem_points"] = int(x.size)
        except (ValueError, RuntimeError) as e:
            report["eta_mem_skipped"] = str(e)
    params["f_clk"] = _fit_clock(run, hw, params["f_clk"])
    f = params["f_clk"].value
    params["eta_active"] = fit_active(run, hw, dtype, f, params["eta_active"])
    params["eta_duty"], duty_report = fit_duty(run, hw, dtype, f, params["eta_active"].value,
                                                params["eta_max"].value, params["x_half"].value, params["eta_duty"])
    report.update(duty_report)
    gemm_fixed = fit_gemm_fixed(run, hw, dtype)
    if gemm_fixed is not None:
        params["t_gemm_fixed_s"] = gemm_fixed
    curves, curve_report = fit_duty_by_m(run, hw, dtype, f, params["eta_active"].value,
                                         gemm_fixed.value if gemm_fixed is not None else 0.0)
    report.update(curve_report)
    _fit_launch(run, hw, params)
    if hw.backend != "cpu":
        fit_kernels(run, hw, params, report)
    cpu_ops = _fit_cpu_ops(run, report)
    report["warnings"] = sanity_warnings(params, hw, report, run)
    meta = {"created_utc": utc_now_iso(), "from": "run", "run_dir": str(run.run_dir),
            "run_git_commit": run.manifest.get("git_commit"), "run_created_utc": run.manifest.get("created_utc"),
            **({"run_dirs": run.manifest["merged_from"]} if "merged_from" in run.manifest else {}),
            "device": (run.manifest.get("device") or {}).get("name"),
            "host": identity_from_device(run.manifest.get("device") or {}), "contended": contended,
            "command": list(argv) if argv is not None else ["gpubench", *sys.argv[1:]], "fit": report}
    return Calibration(sku=hw0.sku_id, backend=hw0.backend, dtype=dtype, params=params, hardware=hw_over,
                       host_residual=cal.host_residual, meta=meta, curves=curves, cpu_ops=cpu_ops)


def _fit_cpu_ops(run, report: dict) -> dict:
    """dtype -> CpuOpTables from the run's ``torch_ops`` rows (empty without them)."""
    from predictor.cpu_tables import CpuOpTables
    from predictor.cpu_tables_fit import fit_tables

    # what a --quick run left out (gpubench run says so when it starts; fit says it again)
    report["quick_left_out"] = dict((run.manifest.get("config") or {}).get("quick_left_out") or {})
    frame = run.frames.get("torch_ops")
    if frame is None or not len(frame):
        return {}
    vllm_frame = run.frames.get("vllm_ops")
    out = {}
    for dt in sorted(set(frame["dtype"])):
        # fitted by predictor.cpu_tables_fit, which reads the table schema of predictor.cpu_tables
        tables = CpuOpTables(fit_tables(frame, dt, f"{run.run_dir}: torch_ops", vllm_frame))
        out[dt] = tables
        report[f"cpu_ops_{dt}"] = {"linear_rows": tables.d["linear"]["num_rows"],
                                   "linear_vllm_rows": (tables.d.get("linear_vllm") or {}).get("num_rows", 0),
                                   "attn_decode_fit_mape": tables.d["attn_decode"]["fit_mape"],
                                   "attn_prefill_fit_mape": {m: tables.d["attn_prefill"][m]["fit_mape"]
                                                             for m in ("causal", "masked")}}
    return out


def sanity_warnings(params: dict, hw: HardwareSpec, report: dict, run=None) -> list[str]:
    """Plain-language flags for fitted values that a quiet, healthy device would not produce.

    The fit never hides them: the values stay as measured, the warnings travel in meta.fit.
    """
    out = []
    fixed_s = params["x_half"].value * hw.l2_bytes / (hw.mem_bytes_per_s * params["eta_max"].value)
    if fixed_s > 100e-6:
        out.append(f"eta_mem charges every op {fixed_s * 1e6:.0f} us (x_half {params['x_half'].value:.3g} x L2 / "
                   f"B eta_max): the cold sweep's small transfers are slow; is the host busy?")
    if params["eta_active"].tier == "measured" and params["eta_active"].value < 0.3:
        out.append(f"eta_active {params['eta_active'].value:.3f}: the peak loop reached under 30 % of spec")
    if params["eta_duty"].tier == "measured" and not 0.1 <= params["eta_duty"].value <= 1.5:
        out.append(f"eta_duty {params['eta_duty'].value:.3f} is outside 0.1-1.5")
    if report.get("eta_mem_mape", 0) > 0.25:
        out.append(f"the eta_mem law misses the cold sweep by {report['eta_mem_mape']:.0%} on average: it does not "
                   f"describe this device (on a CPU, transfers under the LLC are served faster than DRAM)")
    if report.get("gemm_identity_mape", 0) > 0.25:
        out.append(f"eta_c * P misses the compute-bound GEMM rows by {report['gemm_identity_mape']:.0%} on average")
    if report.get("gemm_curve_identity_mape", 0) > 0.25:
        out.append(f"eta_c(M) * P (the per-M eta_duty curve) misses the gemm rows by "
                   f"{report['gemm_curve_identity_mape']:.0%} on average: shapes at one M differ that much")
    if run is not None:
        cvs = [df["cv"].median() for df in run.frames.values() if "cv" in df.columns and len(df)]
        if cvs and max(cvs) > 0.2:
            out.append(f"noisy run: a probe's median coefficient of variation is {max(cvs):.0%} (> 20 %)")
        load = (run.manifest.get("host_load") or run.manifest.get("loadavg"))
        if load:
            out.append(f"host load during the run: {load}")
    return out
