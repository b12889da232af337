"""Calibration: the efficiency parameters of DESIGN §6, fitted from a gpubench run or defaulted.

Every parameter is a ``Param`` (value, fit error, tier, source). Tiers, best first:
``measured`` (fitted from the user's run), ``published`` (constants of the research this project
descends from, DESIGN §5), ``spec`` (what the datasheet identity implies, e.g. eta = 1),
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

import numpy as np

from gpubench.errors import ConfigError
from predictor import efficiency as eff
from predictor.hardware import HardwareSpec

SCHEMA = "gpubench.calibration/1"
TIERS = ("measured", "published", "spec", "assumed")
RESEARCH = "published: shared/DESIGN.md §5 (research this project descends from)"

# Back-to-back launch interval, eager and per CUDA-graph node (shared/reference/hardware.md).
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
            return cls(float(obj), None, "measured", f"{where} (bare number)")
        if not isinstance(obj, dict) or "value" not in obj:
            raise ConfigError(f"{where}: expected a number or an object with 'value', got {obj!r}")
        try:
            value = float(obj["value"])
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: 'value' must be a number, got {obj['value']!r}") from None
        err = obj.get("error", obj.get("fit_error"))
        return cls(value, None if err is None else float(err), str(obj.get("tier", "measured")),
                   str(obj.get("source", "")))


@dataclass
class Calibration:
    """Parameters of the step model for one SKU and dtype.

    ``params``: eta_max, x_half, eta_active, eta_duty, f_clk, t_launch_s, t_graph_node_s,
    t_dispatch_s. ``hardware``: overrides of the spec read from the run (num_sms, l2_bytes,
    mem_bytes_per_s). ``host_residual``: s_floor_ms, s_slope_ms.
    """

    sku: str
    backend: str
    dtype: str
    params: dict = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)
    host_residual: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

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
        return out

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "sku": self.sku, "backend": self.backend, "dtype": self.dtype,
            "meta": self.meta,
            "params": {k: p.to_dict() for k, p in self.params.items()},
            "hardware": {k: p.to_dict() for k, p in self.hardware.items()},
            "host_residual": {k: p.to_dict() for k, p in self.host_residual.items()},
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

        def block(name):
            raw = d.get(name) or {}
            if not isinstance(raw, dict):
                raise ConfigError(f"{where}: '{name}' must be an object")
            # the host-residual block may carry block-level fit info next to its parameters
            skip = {"fit_error", "error", "tier", "source", "n", "num_rows", "split", "mape", "r2"}
            keys = [k for k in raw if not (name == "host_residual" and k in skip)]
            out = {k: Param.from_obj(raw[k], f"{where}: {name}.{k}") for k in keys}
            if name == "host_residual" and (raw.get("tier") or raw.get("source")):
                out = {k: Param(p.value, p.error if p.error is not None else _num(raw.get("fit_error")),
                                str(raw.get("tier", p.tier)), str(raw.get("source", p.source)))
                       for k, p in out.items()}
            return out

        return cls(sku=str(d["sku"]), backend=str(d.get("backend", "cuda")), dtype=str(d.get("dtype", "bf16")),
                   params=block("params"), hardware=block("hardware"), host_residual=block("host_residual"),
                   meta=dict(d.get("meta") or {}))

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: no such calibration file (make one with `gpubench fit RUN_DIR -o {p}`)")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{e.lineno}: malformed JSON ({e.msg})") from None
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
            p["t_launch_s"] = Param(eager, None, "published", f"shared/reference/hardware.md: {src}")
            p["t_graph_node_s"] = Param(graph, None, "published", f"shared/reference/hardware.md: {src}")
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
                       host_residual={**base.host_residual, **cal.host_residual}, meta=dict(cal.meta))
