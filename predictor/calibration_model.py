"""Calibration: the efficiency parameters of the step model (docs/predictor.md), as a file and in memory.

Fitting them from a gpubench run is :mod:`predictor.calibrate`; this module is the data model
(``Param``, ``Curve``, ``Calibration``), its JSON form, the defaults without a run and ``resolve``.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.errors import ConfigError, suggest
from common.jsonio import read_json
from predictor import efficiency as eff
from predictor.hardware import HardwareSpec

SCHEMA = "gpubench.calibration/1"
KNOWN = {
    "params": ("eta_max", "x_half", "eta_active", "eta_duty", "f_clk", "t_launch_s", "t_graph_node_s", "t_dispatch_s",
               "t_gemm_fixed_s", "t_attn_fixed_s", "t_attn_seq_s", "t_attn_token_s", "eta_attn",
               "wave_quantization"),
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
    t_dispatch_s, and on a GPU t_gemm_fixed_s (a GEMM kernel's fixed time; only when a run measured
    it: absent, no fixed time is charged); t_attn_fixed_s, t_attn_seq_s, t_attn_token_s and eta_attn
    (an attention kernel's fixed time, its time per sequence of the batch and per new token of a
    prefill chunk, and attention's compute rate as a share of the GEMMs'), only from measured
    attention kernels (``gpubench fit --from-silicon``): absent, 0, 0, 0 and 1; wave_quantization
    (how much of the wave-quantization loss the GEMM library leaves, ``efficiency.eta_cluster``),
    only from measured GEMM tables: absent, 1. ``hardware``: overrides of the spec read from the
    run (num_sms, l2_bytes, mem_bytes_per_s). ``host_residual``: s_floor_ms, s_slope_ms.
    ``curves``: name -> dtype ->
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

    def value_or(self, name: str, default: float) -> float:
        """``value(name)``, or ``default`` for a parameter only some calibrations carry."""
        return self.params[name].value if name in self.params else default

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
        d = read_json(p, error=ConfigError, what="a calibration")
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
                       meta={"created_utc": utc_now_iso(), "from": "defaults (no run)"})


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def retarget(cal: Calibration, sku_id: str) -> Calibration:
    """``cal`` used for another SKU of the same backend (``--force-calibration``): its fitted
    efficiencies, curves and host residual apply; the device figures its run read (SM count, L2,
    measured bandwidth) stay with the device it measured, so the target's spec ones are used.
    ConfigError across backends (a CPU's efficiencies do not describe a GPU)."""
    backend = HardwareSpec.from_sku(sku_id).backend
    if cal.backend != backend:
        raise ConfigError(f"the calibration is for a {cal.backend} SKU ('{cal.sku}'); it cannot describe "
                          f"the {backend} SKU '{sku_id}', forced or not")
    return Calibration(sku=sku_id, backend=backend, dtype=cal.dtype, params=dict(cal.params), hardware={},
                       host_residual=dict(cal.host_residual), meta={**cal.meta, "retargeted_from": cal.sku},
                       curves={k: dict(v) for k, v in cal.curves.items()}, cpu_ops=dict(cal.cpu_ops))


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
