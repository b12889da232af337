"""A GPU calibration fitted from one system's measured kernel tables (``gpubench fit --from-silicon``).

A second source of calibrations beside a probe run: for a GPU the user does not have, the kernels
NVIDIA measured on it (predictor.silicon_tables) give the factorized model's efficiencies. The same
parameters a probe run gives, from the same kind of evidence, plus the two only attention kernels
can give:

- ``t_gemm_fixed_s`` and ``eta_max``: the line of a GEMM's time against its bytes at M = 1 (a GEMV
  streams its weights: the intercept is the kernel's fixed time, the slope the bandwidth it
  streams at, as a share of the spec bandwidth), over the projection-sized shapes (N, K >= 1024).
  A table's latency is a kernel in a timed loop, its gap to the next kernel included, and the step
  model charges that gap itself (the graph-node interval): every fixed time here is net of it.
- ``eta_duty_by_m`` and ``eta_duty``: per M, the median over those shapes of the time net of the
  fixed part as a share of P x f_clk x eta_cluster x eta_active (the probe fit's curve,
  predictor.calibrate_compute.fit_duty_curve); the scalar from the compute-bound rows.
- ``t_attn_fixed_s``: the attention kernel's floor: the median, over decode rows of at most 8
  sequences and 15 cached tokens (where the KV read is negligible), of the measured time less the
  model's price with the GEMM parameters above.
- ``eta_attn``: attention's compute rate as a share of the GEMMs': the median, over prefill rows of
  at least 8192 new tokens (compute bound), of the model's compute time at share 1 over the measured
  time net of the floor.

Attention rows are those whose heads a shipped model config has, as ``gpubench silicon`` scores.
The clock factor and eta_active stay the defaults (the duty curve takes what they miss). Nothing else
of the target is read: launch intervals and the host residual stay published or assumed.
"""
from __future__ import annotations

import numpy as np

from common.errors import ConfigError
from predictor import efficiency as eff
from predictor.calibrate_compute import finite_or_none, fit_duty_curve
from predictor.calibration_model import Calibration, Curve, Param, defaults, utc_now_iso
from predictor.hardware import HardwareSpec
from predictor.silicon_match import GemmGrid
from predictor.silicon_tables import TableSet, read_attention, read_gemm, wheel_version

MIN_NK = 1024  # projection-sized GEMMs: the shapes a model runs
FLOOR_MAX_BATCH, FLOOR_MAX_STEP = 8, 15
RATE_MIN_TOKENS = 8192
DTYPE = "bf16"


def _gemm_params(grid: GemmGrid, hw: HardwareSpec, base: Calibration, where: str) -> tuple[dict, dict]:
    g = grid.rows
    g = g[(g["n"] >= MIN_NK) & (g["k"] >= MIN_NK)]
    one = g[g["m"] == 1]
    if len(one) < 2:
        raise ConfigError(f"{where}: fewer than two GEMM shapes at M = 1 with N, K >= {MIN_NK}; cannot fit")
    nbytes = 2.0 * (one["n"] * one["k"] + one["n"] + one["k"]).to_numpy(float)  # bf16 weights + in/out rows
    (slope, intercept), cov = np.polyfit(nbytes, one["latency_s"].to_numpy(float), 1, cov=True)
    if not slope > 0:
        raise ConfigError(f"{where}: GEMM time does not rise with bytes at M = 1; cannot fit")
    # a table's latency is a kernel inside a timed loop, its device-side gap to the next kernel
    # included; the step model charges that gap on its own (the graph-node interval), so the fixed
    # time is what remains
    node = base.value("t_graph_node_s")
    fixed = max(float(intercept) - node, 0.0)
    bw = 1.0 / slope
    params = {
        "t_gemm_fixed_s": Param(fixed, finite_or_none(np.sqrt(cov[1, 1])), "measured",
                                f"{where}: intercept of time against bytes over {len(one)} GEMMs at M=1 (N, K >= {MIN_NK}), "
                                f"{intercept * 1e6:.2f} us, less the graph-node interval {node * 1e6:.2f} us"),
        "eta_max": Param(bw / hw.mem_bytes_per_s, None, "measured",
                         f"{where}: those GEMMs stream at {bw / 1e12:.3g} TB/s (the slope) of the spec "
                         f"{hw.mem_bytes_per_s / 1e12:.3g} TB/s"),
        "x_half": Param(0.0, None, "measured", f"{where}: a GPU op streams at B x eta_max (no small-transfer term)"),
    }
    f, active = base.value("f_clk"), base.value("eta_active")
    peak = hw.peak(DTYPE)
    m, n, k = (g[c].to_numpy(float) for c in ("m", "n", "k"))
    t = g["latency_s"].to_numpy(float)
    t = t - node
    keep = t > fixed * 1.05
    flops = 2.0 * m * n * k
    rate = flops[keep] / (t[keep] - fixed)
    cluster = eff.eta_cluster(m[keep], n[keep], k[keep], hw.num_sms, eff.tile_shape(hw.arch))
    duty = eff.eta_duty(rate, peak, f, cluster, active)
    c = fit_duty_curve(m[keep], duty)
    curve = Curve(x=tuple(c["x"]), value=tuple(c["value"]), tier="measured", error=tuple(c["error"]), raw=tuple(c["raw"]),
                  num_rows=tuple(c["num_rows"]),
                  source=f"{where}: per M, median over the GEMMs with N, K >= {MIN_NK} of their time net of the fixed "
                         "part as a share of P f_clk eta_cluster eta_active; time envelope")
    t_mem = 2.0 * n * k / bw
    bound = keep & (t_mem < 0.5 * t)
    scalar = float(np.median(eff.eta_duty(flops[bound] / (t[bound] - fixed), peak, f,
                                          eff.eta_cluster(m[bound], n[bound], k[bound], hw.num_sms,
                                                          eff.tile_shape(hw.arch)), active))) if bound.any() else 1.0
    params["eta_duty"] = Param(scalar, None, "measured", f"{where}: median over {int(bound.sum())} compute-bound GEMMs")
    return params, {"eta_duty_by_m": {DTYPE: curve}}


def _attention_params(ts: TableSet, cal: Calibration, where: str) -> dict:
    from predictor.silicon_score import score_attention, shipped_models
    from predictor.step import StepModel

    models = shipped_models()
    cache: dict = {}

    def step_model_for(cfg, _cal=cal):
        if cfg.name not in cache:
            cache[cfg.name] = StepModel(ts.sku, cfg, calibration=_cal, cuda_graphs=True, dtype=DTYPE)
        return cache[cfg.name]

    out = {}
    decode, dsrc = read_attention(ts.decode)
    d = score_attention(decode, "decode_attention", step_model_for, models)
    small = d[(d["batch"] <= FLOOR_MAX_BATCH) & (d["step"] <= FLOOR_MAX_STEP)]
    floor = 0.0
    if len(small):
        gap = (small["measured_s"] - small["predicted_s"]).to_numpy(float)  # net of the graph-node interval too
        floor = max(float(np.median(gap)), 0.0)
        q75, q25 = np.percentile(gap, [75, 25])
        out["t_attn_fixed_s"] = Param(floor, finite_or_none((q75 - q25) / 1.349), "measured",
                                      f"{where} {dsrc}: median over {len(small)} decode kernels (batch <= {FLOOR_MAX_BATCH}, "
                                      f"<= {FLOOR_MAX_STEP} cached tokens) of measured - the model's price (op + graph-node interval)")
    prefill, psrc = read_attention(ts.prefill)
    p = score_attention(prefill, "prefill_attention", step_model_for, models)
    big = p[(p["batch"] * p["isl"] >= RATE_MIN_TOKENS) & (p["measured_s"] > 2 * floor)]
    if len(big):
        share = (big["predicted_op_s"] / (big["measured_s"] - floor - (big["predicted_s"] - big["predicted_op_s"]))).to_numpy(float)
        q75, q25 = np.percentile(share, [75, 25])
        out["eta_attn"] = Param(float(np.median(share)), finite_or_none((q75 - q25) / 1.349), "measured",
                                f"{where} {psrc}: median over {len(big)} prefill kernels (>= {RATE_MIN_TOKENS} tokens) of the "
                                "model's compute time at share 1 / (measured - the floor - the graph-node interval)")
    return out


def fit_from_silicon(ts: TableSet, *, argv: list | None = None) -> Calibration:
    """The calibration of ``ts.sku`` from its GEMM and attention tables (module docstring)."""
    if ts.sku is None:
        raise ConfigError(f"{ts.system} has tables but no gpubench SKU to calibrate")
    if ts.gemm is None:
        raise ConfigError(f"{ts.label}: no GEMM table; cannot fit")
    hw = HardwareSpec.from_sku(ts.sku)
    base = defaults(hw, DTYPE)
    where = f"aiconfigurator-core {wheel_version()} {ts.label}"
    params, curves = _gemm_params(GemmGrid(read_gemm(ts)), hw, base, where)
    gemm_only = Calibration(sku=hw.sku_id, backend=hw.backend, dtype=DTYPE, params={**base.params, **params},
                            host_residual=dict(base.host_residual), curves=curves)
    params.update(_attention_params(ts, gemm_only, where))
    meta = {"created_utc": utc_now_iso(), "from": f"silicon: {where}", "tables": ts.label,
            "command": " ".join(argv) if argv else None}
    return Calibration(sku=hw.sku_id, backend=hw.backend, dtype=DTYPE, params=params, curves=curves, meta=meta)
