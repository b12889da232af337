"""Calibration: the efficiency parameters of the step model (docs/predictor.md), fitted from a gpubench run or defaulted.

Every parameter is a ``Param`` (value, fit error, tier, source). Tiers, best first:
``measured`` (fitted from the user's run), ``published`` (constants of the research this project
descends from; docs/predictor.md lists them), ``spec`` (what the datasheet identity implies, e.g. eta = 1),
``assumed`` (no spec exists -- a CPU's bandwidth or dispatch cost without a run; labelled so).

``gpubench fit RUN_DIR -o calibration.json`` writes the JSON documented in docs/predictor.md;
``StepModel(..., calibration=path_or_obj)`` reads it. A ``host_residual`` block (s_floor_ms,
s_slope_ms) written later from real step rows is accepted and used.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpubench.errors import ConfigError, suggest
from predictor import efficiency as eff
from predictor.hardware import HardwareSpec

SCHEMA = "gpubench.calibration/1"
KNOWN = {
    "params": ("eta_max", "x_half", "eta_active", "eta_duty", "f_clk", "t_launch_s", "t_graph_node_s", "t_dispatch_s"),
    "hardware": ("num_sms", "l2_bytes", "mem_bytes_per_s"),
    "host_residual": ("s_floor_ms", "s_slope_ms"),
    "curves": ("eta_duty_by_m",),
}
TIERS = ("measured", "published", "spec", "assumed")
RESEARCH = "published: measurements of the research this project descends from (docs/predictor.md)"

# Back-to-back launch interval, eager and per CUDA-graph node (published measurements; docs/predictor.md).
PUBLISHED_LAUNCH_S = {
    "h200": (2.45e-6, 1.315e-6, "H200 eager 2.4-2.5 us, graph 1.26-1.37 us"),
    "a100-80": (2.65e-6, 1.40e-6, "A100-80 eager 2.6-2.7 us, graph 1.34-1.46 us"),
    "l40s": (1.70e-6, 1.03e-6, "L40 (not S) eager 1.6-1.8 us, graph 0.93-1.13 us"),
}
ASSUMED_LAUNCH_S = (2.5e-6, 1.3e-6)  # typical of published SXM parts; no figure for this SKU
ASSUMED_CPU_DISPATCH_S = 5e-6  # one eager PyTorch op on a CPU, order of magnitude


@dataclass(frozen=True)
class Param:
    """One calibrated number with its provenance."""

    value: float
    error: float | None
    tier: str
    source: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_obj(cls, obj, where: str) -> "Param":
        """From ``{"value", "error", "tier", "source"}`` or a bare number (tier 'measured')."""
        if isinstance(obj, (int, float)) and not isinstance(obj, bool):
            if not math.isfinite(obj):
                raise ConfigError(f"{where}: must be a finite number, got {obj!r}")
            return cls(float(obj), None, "measured", f"{where} (bare number)")
        if not isinstance(obj, dict) or "value" not in obj:
            raise ConfigError(f"{where}: expected a number or an object with 'value', got {obj!r:.80}")
        value = obj["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: 'value' must be a finite number, got {value!r:.80}")
        err = obj.get("error", obj.get("fit_error"))
        if err is not None and (isinstance(err, bool) or not isinstance(err, (int, float)) or not math.isfinite(err)):
            raise ConfigError(f"{where}: 'error' must be a finite number or null, got {err!r:.80}")
        return cls(float(value), None if err is None else float(err), str(obj.get("tier", "measured")),
                   str(obj.get("source", "")))


@dataclass(frozen=True)
class Curve:
    """A parameter that is a measured function of one variable: ``value[i]`` at ``x[i]``.

    ``eta_duty_by_m``: x = GEMM rows M, value = eta_duty after the time envelope
    (efficiency.duty_time_envelope), ``raw`` = the per-M median before it, ``error`` per node =
    IQR/1.349 over the (N, K) shapes at that M (None for one shape), ``num_rows`` per node,
    ``fit_error`` = MAPE of eta_c * P against every gemm row used. Read by
    efficiency.eta_duty_at: linear in log2 x of log value, clamped outside [x[0], x[-1]].
    """

    x: tuple
    value: tuple
    tier: str
    source: str
    error: tuple = ()
    raw: tuple = ()
    num_rows: tuple = ()
    fit_error: float | None = None
    interpolation: str = "linear in (log2 M, log eta), clamped outside the measured M"

    def to_dict(self) -> dict:
        return {"x": list(self.x), "value": list(self.value), "error": list(self.error), "raw": list(self.raw),
                "num_rows": list(self.num_rows), "fit_error": self.fit_error, "tier": self.tier,
                "source": self.source, "interpolation": self.interpolation}

    @classmethod
    def from_obj(cls, obj, where: str) -> "Curve":
        if not isinstance(obj, dict) or "x" not in obj or "value" not in obj:
            raise ConfigError(f"{where}: expected an object with 'x' and 'value' lists, got {obj!r}")
        try:
            x = tuple(float(v) for v in obj["x"])
            val = tuple(float(v) for v in obj["value"])
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: 'x' and 'value' must be lists of numbers") from None
        if not x or len(x) != len(val):
            raise ConfigError(f"{where}: 'x' and 'value' must be non-empty and of equal length ({len(x)} vs {len(val)})")
        if any(v <= 0 for v in x) or any(b <= a for a, b in zip(x, x[1:])):
            raise ConfigError(f"{where}: 'x' must be positive and strictly increasing, got {list(x)}")
        if not all(math.isfinite(v) and v > 0 for v in val):
            raise ConfigError(f"{where}: every 'value' must be a positive number, got {list(val)}")
        fe = obj.get("fit_error")
        return cls(x=x, value=val, tier=str(obj.get("tier", "measured")), source=str(obj.get("source", "")),
                   error=tuple(obj.get("error") or ()), raw=tuple(obj.get("raw") or ()),
                   num_rows=tuple(obj.get("num_rows") or ()), fit_error=None if fe is None else float(fe),
                   interpolation=str(obj.get("interpolation", cls.interpolation)))


@dataclass
class Calibration:
    """Parameters of the step model for one SKU and dtype.

    ``params``: eta_max, x_half, eta_active, eta_duty, f_clk, t_launch_s, t_graph_node_s,
    t_dispatch_s. ``hardware``: overrides of the spec read from the run (num_sms, l2_bytes,
    mem_bytes_per_s). ``host_residual``: s_floor_ms, s_slope_ms. ``curves``: name -> dtype ->
    Curve (``eta_duty_by_m``: eta_duty as a function of GEMM M; absent in older files, where
    the scalar eta_duty applies to every M).
    """

    sku: str
    backend: str
    dtype: str
    params: dict = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)
    host_residual: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    curves: dict = field(default_factory=dict)
    cpu_ops: dict = field(default_factory=dict)  # dtype -> predictor.cpu_tables.CpuOpTables

    def curve(self, name: str, dtype: str) -> Curve | None:
        """The ``name`` curve fitted for ``dtype``, or None."""
        return (self.curves.get(name) or {}).get(dtype)

    def value(self, name: str) -> float:
        for block in (self.params, self.host_residual, self.hardware):
            if name in block:
                return block[name].value
        raise KeyError(name)

    def tiers(self) -> dict:
        """name -> tier of every parameter (for labelling predictions)."""
        out = {}
        for block in (self.params, self.hardware, self.host_residual):
            out.update({k: p.tier for k, p in block.items()})
        for name, by_dtype in self.curves.items():
            if self.dtype in by_dtype:
                out[name] = by_dtype[self.dtype].tier
        return out

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "sku": self.sku, "backend": self.backend, "dtype": self.dtype,
            "meta": self.meta,
            "params": {k: p.to_dict() for k, p in self.params.items()},
            "hardware": {k: p.to_dict() for k, p in self.hardware.items()},
            "host_residual": {k: p.to_dict() for k, p in self.host_residual.items()},
            "curves": {k: {dt: c.to_dict() for dt, c in v.items()} for k, v in self.curves.items()},
            **({"cpu_ops": {dt: t.to_dict() for dt, t in self.cpu_ops.items()}} if self.cpu_ops else {}),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "calibration") -> "Calibration":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        for k in ("sku", "params"):
            if k not in d:
                raise ConfigError(f"{where}: missing field '{k}'")
        if "schema" in d and d["schema"] != SCHEMA:
            raise ConfigError(f"{where}: field 'schema' is {d['schema']!r}; this gpubench reads {SCHEMA!r} "
                              "(re-make it with `gpubench fit RUN_DIR`)")
        for k in ("sku", "backend", "dtype"):
            if k in d and not (isinstance(d[k], str) and d[k].strip()):
                raise ConfigError(f"{where}: field '{k}' must be a non-empty string, got {d[k]!r}")
        for k in ("meta", "params", "hardware", "host_residual", "curves", "cpu_ops"):
            if d.get(k) is not None and not isinstance(d[k], dict):
                raise ConfigError(f"{where}: '{k}' must be an object, got {type(d[k]).__name__}")

        def block(name):
            raw = d.get(name) or {}
            # the host-residual block may carry block-level fit info next to its parameters
            skip = {"fit_error", "error", "tier", "source", "n", "num_rows", "split", "mape", "r2"}
            keys = [k for k in raw if not (name == "host_residual" and k in skip)]
            for k in keys:
                if k not in KNOWN[name]:
                    raise ConfigError(f"{where}: unknown {name} entry '{k}'{suggest(k, KNOWN[name])} "
                                      f"(known: {', '.join(KNOWN[name])})")
            out = {k: Param.from_obj(raw[k], f"{where}: {name}.{k}") for k in keys}
            if name == "host_residual" and (raw.get("tier") or raw.get("source")):
                out = {k: Param(p.value, p.error if p.error is not None else _num(raw.get("fit_error")),
                                str(raw.get("tier", p.tier)), str(raw.get("source", p.source)))
                       for k, p in out.items()}
            return out

        raw_curves = d.get("curves") or {}
        if not isinstance(raw_curves, dict):
            raise ConfigError(f"{where}: 'curves' must be an object")
        curves = {}
        for name, by_dtype in raw_curves.items():
            if name not in KNOWN["curves"]:
                raise ConfigError(f"{where}: unknown curves entry '{name}'{suggest(name, KNOWN['curves'])} "
                                  f"(known: {', '.join(KNOWN['curves'])})")
            if not isinstance(by_dtype, dict):
                raise ConfigError(f"{where}: curves.{name} must map dtype -> curve")
            curves[name] = {str(dt): Curve.from_obj(c, f"{where}: curves.{name}.{dt}") for dt, c in by_dtype.items()}
        raw_ops = d.get("cpu_ops") or {}
        if not isinstance(raw_ops, dict):
            raise ConfigError(f"{where}: 'cpu_ops' must map dtype -> tables")
        from predictor.cpu_tables import CpuOpTables

        cpu_ops = {str(dt): CpuOpTables.from_dict(t, f"{where}: cpu_ops.{dt}") for dt, t in raw_ops.items()}
        return cls(sku=str(d["sku"]), backend=str(d.get("backend", "cuda")), dtype=str(d.get("dtype", "bf16")),
                   params=block("params"), hardware=block("hardware"), host_residual=block("host_residual"),
                   meta=dict(d.get("meta") or {}), curves=curves, cpu_ops=cpu_ops)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: no such calibration file (make one with `gpubench fit RUN_DIR -o {p}`)")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{e.lineno}: malformed JSON ({e.msg})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not a calibration (not UTF-8 text: {e.reason} at byte {e.start})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: a calibration is a JSON object, got {type(d).__name__}")
        return cls.from_dict(d, where=str(p))


def _num(x):
    return None if x is None else float(x)


def defaults(hw: HardwareSpec, dtype: str) -> Calibration:
    """No run: published constants where the research has them, else spec values, else assumed."""
    cpu = hw.backend == "cpu"
    p = {}
    if cpu:
        p["eta_max"] = Param(1.0, None, "assumed", "CPU without a run: B is the measured plateau, so eta_max ~ 1")
        p["x_half"] = Param(0.0, None, "assumed", "CPU without a run: no small-transfer penalty")
    else:
        p["eta_max"] = Param(eff.PUBLISHED_ETA_MAX, None, "published", RESEARCH + ": L2-reuse law (0.90, 0.477)")
        p["x_half"] = Param(eff.PUBLISHED_X_HALF, None, "published", RESEARCH + ": L2-reuse law (0.90, 0.477)")
    p["eta_active"] = Param(1.0, None, "spec", "spec: matrix units deliver their nominal FMA per clock")
    p["eta_duty"] = Param(1.0, None, "spec", "spec: no duty-cycle loss")
    if hw.clock_droop is not None:
        p["f_clk"] = Param(eff.f_clk(hw.clock_droop), None, "published",
                           f"{RESEARCH}: clock droop {hw.clock_droop:.1%} under a large GEMM")
    else:
        p["f_clk"] = Param(1.0, None, "spec", "spec: the clock the spec peak is quoted at")
    if cpu:
        p["t_launch_s"] = Param(0.0, None, "spec", "CPU: no kernel launch queue")
        p["t_graph_node_s"] = Param(0.0, None, "spec", "CPU: no CUDA graphs")
        p["t_dispatch_s"] = Param(ASSUMED_CPU_DISPATCH_S, None, "assumed",
                                  "assumed: ~5 us per eager PyTorch op on a CPU (no run)")
    else:
        if hw.sku_id in PUBLISHED_LAUNCH_S:
            eager, graph, src = PUBLISHED_LAUNCH_S[hw.sku_id]
            p["t_launch_s"] = Param(eager, None, "published", f"published launch measurements: {src}")
            p["t_graph_node_s"] = Param(graph, None, "published", f"published launch measurements: {src}")
        else:
            p["t_launch_s"] = Param(ASSUMED_LAUNCH_S[0], None, "assumed", "assumed: typical eager interval (no figure for this SKU)")
            p["t_graph_node_s"] = Param(ASSUMED_LAUNCH_S[1], None, "assumed", "assumed: typical graph-node interval")
        p["t_dispatch_s"] = Param(0.0, None, "spec", "GPU: host dispatch overlaps the device (async queue)")
    host = {}
    if hw.s_floor_ms is not None:
        host["s_floor_ms"] = Param(hw.s_floor_ms, None, "published", f"{RESEARCH}: host-residual floor (engine steps)")
        host["s_slope_ms"] = Param(0.0, None, "published", f"{RESEARCH}: slope ~ 0")
    else:
        host["s_floor_ms"] = Param(0.0, None, "assumed", "no published floor for this SKU; fit one from step rows")
        host["s_slope_ms"] = Param(0.0, None, "assumed", "no published slope for this SKU")
    return Calibration(sku=hw.sku_id, backend=hw.backend, dtype=dtype, params=p, host_residual=host,
                       meta={"created_utc": _now(), "from": "defaults (no run)"})


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def resolve(calibration, hw: HardwareSpec, dtype: str) -> Calibration:
    """A complete Calibration for ``hw``: ``calibration`` (None, a path, a dict or a Calibration)
    with anything it lacks filled from ``defaults``. ConfigError if it was made for another SKU."""
    base = defaults(hw, dtype)
    if calibration is None:
        return base
    if isinstance(calibration, (str, Path)):
        cal = Calibration.load(calibration)
    elif isinstance(calibration, dict):
        cal = Calibration.from_dict(calibration)
    elif isinstance(calibration, Calibration):
        cal = calibration
    else:
        raise ConfigError(f"calibration must be a path, a dict or a Calibration, got {type(calibration).__name__}")
    if cal.sku != hw.sku_id:
        raise ConfigError(f"calibration is for SKU '{cal.sku}', not '{hw.sku_id}'")
    return Calibration(sku=cal.sku, backend=cal.backend, dtype=cal.dtype,
                       params={**base.params, **cal.params}, hardware=dict(cal.hardware),
                       host_residual={**base.host_residual, **cal.host_residual}, meta=dict(cal.meta),
                       curves={k: dict(v) for k, v in cal.curves.items()}, cpu_ops=dict(cal.cpu_ops))


# ====================================================================== fitting from a run
def _valid(df):
    """Rows whose golden-value check passed (rows without a 'valid' field are kept)."""
    if df is None or len(df) == 0:
        return df
    if "valid" in df.columns:
        df = df[df["valid"].fillna(False).astype(bool)]
    return df


def _err(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def triad_plateau(run) -> Param | None:
    """The CPU bandwidth B: STREAM triad headline (best) of the largest array in the run."""
    df = _valid(run.frames.get("stream"))
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
    l2 = _valid(run.frames.get("l2"))
    if l2 is not None and len(l2) and "mode" in l2.columns:
        cold = l2[l2["mode"] == "cold"]
        if len(cold):
            xs.append(cold["bytes"].to_numpy(float) / l2_bytes)
            etas.append(cold["gbps_median"].to_numpy(float) * 1e9 / bw)
            used.append(f"{len(cold)} l2 cold rows")
    st = _valid(run.frames.get("stream"))
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

    GPU: 1 - droop, droop = 1 - mean SM clock / max reference clock during the largest GEMMs
    (telemetry). CPU: the clock the `peak` probe measured with a dependent-add chain over the
    spec clock (f_clk > 1: the cores turbo above it), since CPU telemetry is often the constant
    nominal clock a hypervisor reports; gemm telemetry only when the probe has no clock row.
    """
    if hw.backend == "cpu":
        return _cpu_measured_clock(run, hw) or _telemetry_clock(run) or base
    return _telemetry_clock(run) or base


def _telemetry_clock(run) -> Param | None:
    g = _valid(run.frames.get("gemm"))
    if g is None or len(g) == 0 or not {"clock_mhz_mean", "clock_max_ref_mhz"} <= set(g.columns):
        return None
    g = g.dropna(subset=["clock_mhz_mean", "clock_max_ref_mhz"])
    g = g[(g["clock_max_ref_mhz"] > 0) & (g["clock_mhz_mean"] > 0)]
    if len(g) == 0:
        return None
    big = g[g["m"] == g["m"].max()]
    f = (big["clock_mhz_mean"] / big["clock_max_ref_mhz"]).to_numpy(float)
    return Param(float(np.mean(f)), _err(np.std(f, ddof=1)) if f.size > 1 else None, "measured",
                 f"{run.run_dir}: gemm telemetry, mean/max SM clock over {f.size} rows at M={int(big['m'].iloc[0])}")


def _cpu_measured_clock(run, hw: HardwareSpec) -> Param | None:
    pk = _valid(run.frames.get("peak"))
    if pk is None or len(pk) == 0 or "unit" not in pk.columns or hw.spec_clock_mhz <= 0:
        return None
    clk = pk[pk["unit"] == "dependent_add"]
    col = "clock_mhz_median" if "clock_mhz_median" in clk.columns else "clock_mhz_measured"
    if len(clk) == 0 or col not in clk.columns or not clk[col].notna().any():
        return None
    mhz = float(clk[col].dropna().median())
    cv: Any = clk["cv"].dropna() if "cv" in clk.columns else []  # a Series, or [] (only len() is asked of that)
    return Param(mhz / hw.spec_clock_mhz, _err(float(cv.iloc[0]) * mhz / hw.spec_clock_mhz) if len(cv) else None,
                 "measured", f"{run.run_dir}: peak dependent-add clock {mhz:.0f} MHz / spec clock "
                 f"{hw.spec_clock_mhz:.0f} MHz")


def _fit_active(run, hw: HardwareSpec, dtype: str, f: float, base: Param) -> Param:
    """eta_active = best `peak` throughput for dtype / (spec peak x clock factor of that row)."""
    pk = _valid(run.frames.get("peak"))
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
    if meas is not None and spec_clk is not None and _finite(meas) and _finite(spec_clk) and spec_clk > 0:
        f_row, how = float(meas) / float(spec_clk), "that row's measured clock / spec clock"
    elif ref is not None and mean is not None and _finite(ref) and _finite(mean) and ref > 0 and mean > 0:
        f_row, how = float(mean) / float(ref), "that row's own mean/max clock"
    measured = float(row["tflops_median"]) * 1e12
    value = eff.eta_active(measured, hw.peak(dtype), f_row)
    cv = row.get("cv")
    err = value * float(cv) if cv is not None and _finite(cv) else None
    return Param(value, err, "measured", f"{run.run_dir}: peak {row['key']} median {measured / 1e12:.3g} TFLOP/s "
                 f"/ spec {hw.peak(dtype) / 1e12:.3g} / f_clk {f_row:.3f} ({how})")


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _fit_duty(run, hw: HardwareSpec, dtype: str, f: float, active: float, eta_max: float, x_half: float,
              base: Param) -> tuple[Param, dict]:
    """eta_duty: median over compute-bound gemm rows of measured / (P f_clk eta_cluster eta_active).

    A row counts as compute bound when the memory law predicts under half of its measured time;
    if none does, the rows with the largest M are used (and the source says so).
    """
    g = _valid(run.frames.get("gemm"))
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
    return Param(value, _err((q75 - q25) / 1.349), "measured",
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
        err.append(_err((q75 - q25) / 1.349) if d.size > 1 else None)
        num.append(int(d.size))
    value = eff.duty_time_envelope(xs, raw)
    return {"x": [float(x) for x in xs], "raw": raw, "value": [float(v) for v in value], "error": err, "num_rows": num}


def _fit_duty_curve(run, hw: HardwareSpec, dtype: str, f: float, active: float) -> tuple[dict, dict]:
    """curves["eta_duty_by_m"][dtype] from every valid gemm row of the dtype (not only the
    compute-bound ones: at small M the probe's time is what a GEMM of that M costs, whatever
    bounds it, and that is what the per-M duty must reproduce)."""
    g = _valid(run.frames.get("gemm"))
    if g is None or len(g) == 0 or "dtype" not in g.columns:
        return {}, {}
    g = g[g["dtype"] == dtype]
    if len(g) == 0:
        return {}, {}
    peak = hw.peak(dtype)
    m, n, k = (g[c].to_numpy(float) for c in ("m", "n", "k"))
    measured = g["tflops_median"].to_numpy(float) * 1e12
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
    src = (f"{run.run_dir}: per M, median over {len(g)} gemm rows of {dtype} ({len(c['x'])} M values, "
           f"{len(set(zip(n, k)))} (N, K) shapes) of measured / (P f_clk eta_cluster eta_active); time envelope "
           f"raised {lifted} of them; error = IQR/1.349 per M; fit_error = MAPE of eta_c * P over the rows")
    curve = Curve(x=tuple(c["x"]), value=tuple(c["value"]), tier="measured", source=src, error=tuple(c["error"]),
                  raw=tuple(c["raw"]), num_rows=tuple(c["num_rows"]), fit_error=mape)
    return {"eta_duty_by_m": {dtype: curve}}, {"gemm_curve_identity_mape": mape, "eta_duty_by_m_points": len(c["x"])}


def _fit_launch(run, hw: HardwareSpec, params: dict) -> None:
    """t_launch_s / t_graph_node_s (CUDA device interval, graph node) or t_dispatch_s (CPU)."""
    la = _valid(run.frames.get("launch"))
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
        params[name] = Param(med, abs(med - float(lo)) if _finite(lo) else None, "measured",
                             f"{run.run_dir}: launch {kind} per launch (median) at count {int(row['count'])}; error = median - min")
        done.add(name)


def fit_run(run_dir, dtype: str | None = None, argv: list | None = None, *, allow_contended: bool = False) -> Calibration:
    """Fit every parameter a run supports; the rest fall back to published, then spec, values.

    The calibration records the host the run measured (``meta.host``, see predictor.host_match).
    A run taken under contention is refused (ConfigError) unless ``allow_contended``; then it is
    fitted and marked (``meta.contended``: why).

    Raises ResultsFormatError for a malformed run directory (from gpubench.results.load).
    """
    from gpubench import results
    from predictor.host_match import identity_from_device, run_contention

    run = results.load(run_dir)
    contended = run_contention(run)
    if contended and not allow_contended:
        raise ConfigError(f"{run.run_dir}: taken under contention ({contended}); re-run it on a quiet machine, "
                          "or pass --allow-contended to fit it anyway (the calibration is then marked)")
    hw0 = HardwareSpec.from_sku(run.sku)
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
            params["eta_max"] = Param(a, _err(ea), "measured", src)
            params["x_half"] = Param(b, _err(eb), "measured", src)
            report["eta_mem_mape"] = mape
            report["eta_mem_points"] = int(x.size)
        except (ValueError, RuntimeError) as e:
            report["eta_mem_skipped"] = str(e)
    params["f_clk"] = _fit_clock(run, hw, params["f_clk"])
    f = params["f_clk"].value
    params["eta_active"] = _fit_active(run, hw, dtype, f, params["eta_active"])
    params["eta_duty"], duty_report = _fit_duty(run, hw, dtype, f, params["eta_active"].value,
                                                params["eta_max"].value, params["x_half"].value, params["eta_duty"])
    report.update(duty_report)
    curves, curve_report = _fit_duty_curve(run, hw, dtype, f, params["eta_active"].value)
    report.update(curve_report)
    _fit_launch(run, hw, params)
    cpu_ops = _fit_cpu_ops(run, report)
    report["warnings"] = sanity_warnings(params, hw, report, run)
    meta = {"created_utc": _now(), "from": "run", "run_dir": str(run.run_dir),
            "run_git_commit": run.manifest.get("git_commit"), "run_created_utc": run.manifest.get("created_utc"),
            "device": (run.manifest.get("device") or {}).get("name"),
            "host": identity_from_device(run.manifest.get("device") or {}), "contended": contended,
            "command": list(argv) if argv is not None else ["gpubench", *sys.argv[1:]], "fit": report}
    return Calibration(sku=hw0.sku_id, backend=hw0.backend, dtype=dtype, params=params, hardware=hw_over,
                       host_residual=cal.host_residual, meta=meta, curves=curves, cpu_ops=cpu_ops)


def _fit_cpu_ops(run, report: dict) -> dict:
    """dtype -> CpuOpTables from the run's ``torch_ops`` rows (empty without them)."""
    from predictor.cpu_tables import CpuOpTables

    frame = run.frames.get("torch_ops")
    if frame is None or not len(frame):
        return {}
    vllm_frame = run.frames.get("vllm_ops")
    out = {}
    for dt in sorted(set(frame["dtype"])):
        tables = CpuOpTables.fit(frame, dt, f"{run.run_dir}: torch_ops", vllm_frame=vllm_frame)
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
