"""A GPU calibration fitted from one system's measured kernel tables (``gpubench fit --from-silicon``).

A second source of calibrations beside a probe run: for a GPU the user does not have, the kernels
NVIDIA measured on it (predictor.silicon_tables) give the factorized model's efficiencies. The same
parameters a probe run gives, from the same kind of evidence, plus the two only attention kernels
can give:

- ``t_gemm_fixed_s`` and ``eta_max``: the line of a GEMM's time against its bytes at M = 1 (a GEMV
  streams its weights: the intercept is the kernel's fixed time, the slope the bandwidth it
  streams at, as a share of the spec bandwidth), over the projection-sized shapes (N, K >= 1024),
  fitted in relative error (weights 1 / time: the error that is scored, and a 3 us kernel's fit
  not left to the 300 us ones).
  A table's latency is a kernel in a timed loop, its gap to the next kernel included, and the step
  model charges that gap itself (the graph-node interval): every fixed time here is net of it.
- ``eta_duty_by_m`` and ``eta_duty``: per M, the median over those shapes of the time net of the
  fixed part as a share of P x f_clk x eta_cluster x eta_active (the probe fit's curve,
  predictor.calibrate_compute.fit_duty_curve); the scalar from the compute-bound rows.
- ``wave_quantization``: how much of eta_cluster's last-wave loss the library's GEMMs show
  (efficiency.eta_cluster): the value of 0, 0.25, ..., 1 whose fit (the two items above, redone
  with it) prices those shapes' GEMMs, at every measured M, with the least mean relative error.
  Persistent stream-K kernels (cuBLAS on Hopper and Blackwell) share the last wave out and show
  little of it; whole-tile waves show all of it.
- ``t_attn_fixed_s`` and ``t_attn_seq_s``: the attention kernel's floor and what each sequence of
  the batch adds to it: the line, in relative error, of the measured time less the model's price
  with the GEMM parameters above against the batch size, over the decode rows of at most 15 cached
  tokens (where the KV read is negligible), every batch the table has.
- ``t_attn_token_s`` and ``eta_attn``: what each new token of a prefill chunk adds (its query
  tile's share of loading Q, the softmax epilogue and writing O) and attention's compute rate as a
  share of the GEMMs': the least-squares fit, in relative error, of the prefill rows of at least
  512 new tokens, their time net of the floor and per-sequence time, as token_s x tokens + the
  model's compute time at share 1 / eta_attn. (A flash kernel's efficiency rises with the
  sequence: 216 TFLOP/s at 16 x 512 tokens, 803 at 1 x 16384 on the H100; a time per query tile
  beside the FLOPs is what makes that rise.)

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
WAVES = (0.0, 0.25, 0.5, 0.75, 1.0)
FLOOR_MAX_STEP = 15
RATE_MIN_TOKENS = 512
DTYPE = "bf16"


def _gemm_params(grid: GemmGrid, hw: HardwareSpec, base: Calibration, where: str, wave: float) -> tuple[dict, dict]:
    g = grid.rows
    g = g[(g["n"] >= MIN_NK) & (g["k"] >= MIN_NK)]
    one = g[g["m"] == 1]
    if len(one) < 2:
        raise ConfigError(f"{where}: fewer than two GEMM shapes at M = 1 with N, K >= {MIN_NK}; cannot fit")
    nbytes = 2.0 * (one["n"] * one["k"] + one["n"] + one["k"]).to_numpy(float)  # bf16 weights + in/out rows
    latency = one["latency_s"].to_numpy(float)
    (slope, intercept), cov = np.polyfit(nbytes, latency, 1, w=1.0 / latency, cov=True)  # relative residuals
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
    cluster = eff.eta_cluster(m[keep], n[keep], k[keep], hw.num_sms, eff.tile_shape(hw.arch), wave)
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
                                                          eff.tile_shape(hw.arch), wave), active))) if bound.any() else 1.0
    params["eta_duty"] = Param(scalar, None, "measured", f"{where}: median over {int(bound.sum())} compute-bound GEMMs")
    params["wave_quantization"] = Param(wave, None, "measured", "")  # the source: _fit_gemm, which chose it
    return params, {"eta_duty_by_m": {DTYPE: curve}}


def _fit_gemm(grid: GemmGrid, hw: HardwareSpec, base: Calibration, where: str) -> tuple[dict, dict]:
    """The GEMM parameters at the ``WAVES`` value whose step-model price of the projection-sized
    shapes (N, K >= MIN_NK) of the shipped models, at every measured M, has the least MAPE."""
    from predictor.silicon_score import score_gemm, shipped_models
    from predictor.step import StepModel

    models = shipped_models()
    fits, mape = {}, {}
    for wave in WAVES:
        params, curves = _gemm_params(grid, hw, base, where, wave)
        cal = Calibration(sku=hw.sku_id, backend=hw.backend, dtype=DTYPE, params={**base.params, **params},
                          host_residual=dict(base.host_residual), curves=curves)
        rows = score_gemm(grid, lambda cfg, _c=cal: StepModel(hw.sku_id, cfg, calibration=_c, cuda_graphs=True, dtype=DTYPE),
                          models)
        rows = rows[(rows["n"] >= MIN_NK) & (rows["k"] >= MIN_NK)]
        fits[wave] = params, curves
        mape[wave] = float((np.abs(rows["predicted_s"] - rows["measured_s"]) / rows["measured_s"]).mean() * 100)
    best = min(WAVES, key=lambda w: mape[w])
    params, curves = fits[best]
    params["wave_quantization"] = Param(best, None, "measured",
                                        f"{where}: of {', '.join(f'{w:g}' for w in WAVES)}, the value whose fit prices the "
                                        f"shipped models' GEMMs with N, K >= {MIN_NK} at every measured M best (MAPE "
                                        + ", ".join(f"{mape[w]:.1f} %" for w in WAVES) + ")")
    return params, curves


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
    small = d[d["step"] <= FLOOR_MAX_STEP]
    floor = 0.0
    if small["batch"].nunique() >= 2:
        gap = (small["measured_s"] - small["predicted_s"]).to_numpy(float)  # net of the graph-node interval too
        batch = small["batch"].to_numpy(float)
        (per_seq, intercept), cov = np.polyfit(batch, gap, 1, w=1.0 / small["measured_s"].to_numpy(float), cov=True)
        floor, per_seq = max(float(intercept), 0.0), max(float(per_seq), 0.0)
        what = (f"{where} {dsrc}: the line of measured - the model's price (op + graph-node interval) against the batch "
                f"size, in relative error, over {len(small)} decode kernels of <= {FLOOR_MAX_STEP} cached tokens "
                f"(batch {int(batch.min())}-{int(batch.max())})")
        out["t_attn_fixed_s"] = Param(floor, finite_or_none(np.sqrt(cov[1, 1])), "measured", what + ": its intercept")
        out["t_attn_seq_s"] = Param(per_seq, finite_or_none(np.sqrt(cov[0, 0])), "measured", what + ": its slope")
    prefill, psrc = read_attention(ts.prefill)
    p = score_attention(prefill, "prefill_attention", step_model_for, models)
    rows = p[(p["batch"] * p["isl"] >= RATE_MIN_TOKENS) & (p["measured_s"] > 2 * floor)]
    if len(rows) >= 2:
        # measured = graph-node interval + floor + per-sequence time + token_s x tokens + compute at share 1 / eta_attn
        seq = out["t_attn_seq_s"].value if "t_attn_seq_s" in out else 0.0
        net = (rows["measured_s"] - floor - seq * rows["batch"] - (rows["predicted_s"] - rows["predicted_op_s"])).to_numpy(float)
        x = np.column_stack([(rows["batch"] * rows["isl"]).to_numpy(float), rows["predicted_op_s"].to_numpy(float)])
        w = 1.0 / rows["measured_s"].to_numpy(float)  # relative residuals
        (token_s, inv_share), *_ = np.linalg.lstsq(x * w[:, None], net * w, rcond=None)
        if token_s < 0:  # no per-token time to be seen: the share alone
            token_s, inv_share = 0.0, float(np.sum(x[:, 1] * net * w * w) / np.sum((x[:, 1] * w) ** 2))
        what = (f"{where} {psrc}: the least-squares fit, in relative error, of measured - the floor, per-sequence time and "
                f"graph-node interval = token_s x new tokens + the model's compute time at share 1 / eta_attn, over "
                f"{len(rows)} prefill kernels of >= {RATE_MIN_TOKENS} tokens")
        out["t_attn_token_s"] = Param(float(token_s), None, "measured", what)
        out["eta_attn"] = Param(1.0 / float(inv_share), None, "measured", what)
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
    params, curves = _fit_gemm(GemmGrid(read_gemm(ts)), hw, base, where)
    gemm_only = Calibration(sku=hw.sku_id, backend=hw.backend, dtype=DTYPE, params={**base.params, **params},
                            host_residual=dict(base.host_residual), curves=curves)
    params.update(_attention_params(ts, gemm_only, where))
    meta = {"created_utc": utc_now_iso(), "from": f"silicon: {where}", "tables": ts.label,
            "command": " ".join(argv) if argv else None}
    return Calibration(sku=hw.sku_id, backend=hw.backend, dtype=DTYPE, params=params, curves=curves, meta=meta)
