"""Score step-time predictors on step rows, with held-out splits (``gpubench evaluate``).

Methods: :mod:`predictor.eval_methods` (each fitted on a split's training rows only, then scored on its
test rows). Reports: :mod:`predictor.eval_report`.

Splits: ``in_sample`` (train = test = all rows, for reference), ``by_batch`` and ``by_context``
(every other distinct value of num_seqs / context_max held out: interpolation), ``by_model``
(leave one model out: fit on the others, score on it). ``transfer`` pairs (train on one model,
score on another) are scored separately for ``rf`` and ``additive``.
Metrics: R^2, MAPE, median and p90 absolute percentage error; a paired Wilcoxon signed-rank test
of the two forms' absolute errors on the same test rows.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from common.errors import ConfigError, ResultsFormatError
from predictor.eval_methods import (
    FOREST_MISSING_NOTE,
    FORM_PAIRS,
    ForestModel,
    OpParts,
    ProbeOnly,
    RowCalibrated,
    StepForm,
    VidurStyle,
    _hw_and_model,
    _no_host,
    cpu_ops_base,
    fit_host_residual,
    forest_available,
    gpu_probe_base,
    step_model_base,
    step_model_parts,
)
from predictor.eval_report import (
    headline_text,
    interval_coverage_text,
    phase_matched_text,
    plot_predictions,
    reference_spread_text,
    report_markdown,
)
from predictor.eval_rows import PHASES, Fold, all_folds, load_rows, metrics


# ----------------------------------------------------------------------------- running
@dataclass
class EvalConfig:
    """What ``gpubench evaluate`` scores and where it writes."""
    rows: list[str]
    out: str
    calibration: str | None = None
    sku: str = "cpu"
    seed: int = 0
    target: str = "wall_s"
    allow_contended: bool = False
    command: list[str] = field(default_factory=list)
    # The Calibration to score (host_match.calibration_for: checked, and retargeted when
    # --force-calibration let another GPU SKU's through); None: load ``calibration`` as it is.
    loaded_calibration: Any = None
    force_calibration: bool = False


@dataclass
class EvalResult:
    predictions: pd.DataFrame
    metrics: pd.DataFrame
    wilcoxon: pd.DataFrame
    transfer: pd.DataFrame
    host_fits: pd.DataFrame
    headline: str


def vidur_column(target: str) -> str:
    """The per-op sum on the same clock as the target."""
    return "op_sum_cpu_s" if target == "thread_cpu_s" else "op_sum_s"


def _make_methods(base: dict, seed: int, target: str) -> list:
    """One fresh instance of every method; ``base`` holds the no-host forms, the op parts, the
    probe-only predictions (None without CPU op tables) and the rows."""
    probe_only = [ProbeOnly(base["cpu_ops"])] if base.get("cpu_ops") is not None else []
    if base.get("probe_only") is not None:
        probe_only.append(ProbeOnly(base["probe_only"], "probe_only"))
    return [*probe_only, StepForm("additive", base["additive"]), StepForm("max", base["max"]),
            RowCalibrated("additive", base["parts"]), RowCalibrated("max", base["parts"]),
            VidurStyle(base["rows"], vidur_column(target)), *_forest(seed)]


def _forest(seed: int) -> list:
    """The random-forest baseline, or nothing where scikit-learn (an optional extra) is absent."""
    return [ForestModel(seed)] if forest_available() else []


def predict_folds(df: pd.DataFrame, folds: list[Fold], base: dict[str, pd.Series], *, target: str,
                  seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Long table of test predictions (one row per fold x test row x method) and the S(N) fits."""
    recs, fits = [], []
    for fold in folds:
        train, test = df[fold.train], df[fold.test]
        for m in _make_methods(base, seed, target):
            m.fit(train, train[target].to_numpy(np.float64))
            pred = m.predict(test)
            if isinstance(m, StepForm):
                fits.append({"split": fold.split, "fold": fold.name, "method": m.name, "num_train_rows": len(train),
                             "s_floor_ms": m.s_floor_s * 1e3, "s_slope_ms": m.s_slope_s * 1e3})
            elif isinstance(m, RowCalibrated):
                fits.append({"split": fold.split, "fold": fold.name, "method": m.name, "num_train_rows": len(train),
                             **m.scales})
            recs.append(pd.DataFrame({
                "split": fold.split, "fold": fold.name, "method": m.name, "key": test.key.to_numpy(),
                "model": test.model.to_numpy(), "phase": test.phase.to_numpy(), "num_seqs": test.num_seqs.to_numpy(),
                "context_max": test.context_max.to_numpy(), "ops_profiled": test.ops_profiled.astype(bool).to_numpy(),
                "measured_s": test[target].to_numpy(np.float64), "predicted_s": pred}))
    return pd.concat(recs, ignore_index=True), pd.DataFrame(fits)


def score(pred: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Metrics per group and phase, on all test rows and on the op-profiled subset (where vidur exists)."""
    out = []
    for keys, g in pred.groupby(by, sort=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        for phase in PHASES:
            gp = g if phase == "all" else g[g.phase == phase]
            for subset, gs in (("all", gp), ("op_profiled", gp[gp.ops_profiled])):
                if len(gs) == 0:
                    continue
                out.append({**dict(zip(by, keys)), "phase": phase, "rows": subset,
                            **metrics(gs.measured_s, gs.predicted_s)})
    return pd.DataFrame(out)


def wilcoxon_forms(pred: pd.DataFrame) -> pd.DataFrame:
    """Paired Wilcoxon signed-rank test of |error| of each additive form vs its max form, same test rows."""
    from scipy.stats import wilcoxon

    out = []
    for split, g in pred.groupby("split", sort=False):
        wide = g.pivot_table(index=["fold", "key"], columns="method", values="predicted_s", aggfunc="first")
        first = g.drop_duplicates(["fold", "key"]).set_index(["fold", "key"])
        for a, b in FORM_PAIRS:
            if a not in wide.columns or b not in wide.columns:
                continue
            for ph in PHASES:
                idx = wide.index if ph == "all" else wide.index[first.phase.loc[wide.index].to_numpy() == ph]
                if len(idx) == 0:
                    continue
                ea = np.abs(wide.loc[idx, a] - first.measured_s.loc[idx]).to_numpy()
                eb = np.abs(wide.loc[idx, b] - first.measured_s.loc[idx]).to_numpy()
                stat = p = np.nan
                if np.any(ea != eb) and len(idx) >= 2:
                    d = np.abs(ea - eb)
                    # Exact null distribution when it exists cheaply; scipy's default falls back to a
                    # permutation test on ties, which takes minutes here.
                    exact = len(idx) <= 25 and np.all(d > 0) and len(np.unique(d)) == len(d)
                    res = wilcoxon(ea, eb, method="exact" if exact else "asymptotic")
                    stat, p = float(res.statistic), float(res.pvalue)
                out.append({"split": split, "pair": f"{a} vs {b}", "phase": ph, "n": len(idx),
                            "median_abs_err_a_ms": 1e3 * np.median(ea), "median_abs_err_b_ms": 1e3 * np.median(eb),
                            "wilcoxon_statistic": stat, "p_value": p,
                            "lower_error": a if np.median(ea) < np.median(eb) else b})
    return pd.DataFrame(out)


def transfer_pairs(df: pd.DataFrame, base: dict[str, pd.Series], *, target: str, seed: int) -> pd.DataFrame:
    """Train on exactly one model, score on each other model (rf and the additive form)."""
    models = sorted(df.model.unique())
    recs = []
    for a in models:
        for b in models:
            if a == b:
                continue
            train, test = df[df.model == a], df[df.model == b]
            for m in (StepForm("additive", base["additive"]), StepForm("max", base["max"]),
                      RowCalibrated("additive", base["parts"]), *_forest(seed)):
                m.fit(train, train[target].to_numpy(np.float64))
                pred = m.predict(test)
                for ph in ("all", "decode"):
                    sel = np.ones(len(test), bool) if ph == "all" else (test.phase == ph).to_numpy()
                    recs.append({"train_model": a, "test_model": b, "method": m.name, "phase": ph,
                                 **metrics(test[target].to_numpy()[sel], pred[sel])})
    return pd.DataFrame(recs)


# ----------------------------------------------------------------------------- reporting


def output_calibration(df: pd.DataFrame, base: pd.Series, *, sku: str, calibration, target: str,
                       rows: list[str]) -> dict:
    """The input calibration (or defaults) with a measured ``host_residual`` fitted on all given rows."""
    from predictor.calibrate import Calibration, defaults
    from predictor.hardware import HardwareSpec

    if calibration is None:
        cal = defaults(HardwareSpec.from_sku(sku), df.dtype.iloc[0])
    else:
        cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    y = df[target].to_numpy(np.float64)
    floor_s, slope_s = fit_host_residual(df.num_seqs, y - base.to_numpy(), y)
    pred = base.to_numpy() + floor_s + slope_s * np.maximum(0.0, df.num_seqs.to_numpy(np.float64) - 1)
    fit = metrics(y, pred)
    src = (f"gpubench evaluate: S(N) fitted to {len(df)} engine-step rows ({target}; "
           f"{', '.join(sorted(df.model.unique()))}) from {', '.join(rows)}")
    d = cal.to_dict()
    d["host_residual"] = {
        "s_floor_ms": {"value": floor_s * 1e3, "error": fit["mape_pct"], "tier": "measured", "source": src},
        "s_slope_ms": {"value": slope_s * 1e3, "error": fit["mape_pct"], "tier": "measured", "source": src},
        "fit_error": fit["mape_pct"], "n": len(df), "tier": "measured", "source": src,
    }
    return d


def rowcal_calibration(df: pd.DataFrame, parts: OpParts, *, sku: str, calibration, target: str,
                       rows: list[str]) -> dict:
    """A calibration whose StepModel *is* ``additive_rowcal`` fitted on all given rows.

    The fitted scales map onto parameters exactly: every op's T_c is proportional to
    1/eta_active, every T_m to 1/B (``mem_bytes_per_s``), the dispatch term to ``t_dispatch_s``.
    """
    from predictor.step import StepModel

    y = df[target].to_numpy(np.float64)
    m = RowCalibrated("additive", parts)
    m.fit(df, y)
    fit = metrics(y, m.predict(df))
    sc = m.scales
    dtype = df.dtype.iloc[0]
    base = _no_host(calibration, sku, dtype)
    sm = StepModel(*_hw_and_model(sku, df.model.iloc[0], calibration), calibration=base, dtype=dtype)
    src = (f"gpubench evaluate: additive form fitted to {len(df)} engine-step rows ({target}; "
           f"{', '.join(sorted(df.model.unique()))}) from {', '.join(rows)}")
    err = fit["mape_pct"]
    d = base.to_dict()
    d["params"]["eta_active"] = {"value": sm.eta_active / sc["compute_scale"], "error": err, "tier": "measured",
                                 "source": f"{src}: compute-time scale {sc['compute_scale']:.4g}"}
    d["params"]["t_dispatch_s"] = {"value": sm.t_launch_s * sc["dispatch_scale"], "error": err, "tier": "measured",
                                   "source": f"{src}: dispatch scale {sc['dispatch_scale']:.4g}"}
    d["hardware"]["mem_bytes_per_s"] = {"value": sm.hardware.mem_bytes_per_s / sc["memory_scale"], "error": err,
                                        "tier": "measured", "source": f"{src}: memory-time scale {sc['memory_scale']:.4g}"}
    d["host_residual"] = {
        "s_floor_ms": {"value": sc["s_floor_ms"], "error": err, "tier": "measured", "source": src},
        "s_slope_ms": {"value": sc["s_slope_ms"], "error": err, "tier": "measured", "source": src},
        "fit_error": err, "n": len(df), "tier": "measured", "source": src,
    }
    d["meta"] = {**d.get("meta", {}), "from": src}
    return d


def command_line(ec: EvalConfig) -> str:
    """The exact command that regenerates ``ec.out``."""
    parts = ["gpubench", "evaluate", *ec.rows]
    if ec.calibration:
        parts += ["--calibration", ec.calibration]
    if ec.force_calibration:
        parts.append("--force-calibration")
    parts += ["--sku", ec.sku, "--target", ec.target, "--seed", str(ec.seed), "--out", ec.out]
    return shlex.join(parts)


def _check_rows_device(df: pd.DataFrame, sku: str, calibration, *, force: bool) -> None:
    """Rows priced for the CPU a calibration records must come from a CPU of that name."""
    from predictor.host_match import calibration_cpu_spec

    spec = calibration_cpu_spec(calibration)
    if spec is None:  # no calibration, a GPU's, or an older one: the SKU is priced (cpu: this host)
        return
    names = sorted(set(df.device_name.astype(str)))
    if not force and any(not spec.name.startswith(n) for n in names):
        raise ConfigError(f"the rows were measured on {', '.join(names)} but the calibration describes {spec.name}: "
                          "fit one from a probe run on the rows' machine, or pass --force-calibration")


def evaluate_rows(df: pd.DataFrame, *, sku: str, calibration, target: str = "wall_s", seed: int = 0,
                  force_calibration: bool = False) -> EvalResult:
    """Score every method on every split of ``df`` (no files written)."""
    for col in (target, vidur_column(target)):
        if col not in df.columns:
            raise ConfigError(f"--target '{target}': rows have no column '{col}' (profiled by an older version?)")
    if (df[target] <= 0).any() or df[target].isna().any():
        raise ResultsFormatError(f"rows with non-positive or missing {target}: {df.key[df[target] <= 0].tolist()[:3]}")
    from predictor.hardware import HardwareSpec

    backend = HardwareSpec.from_sku(sku).backend
    if set(df.device_type) != {backend}:
        raise ConfigError(f"--sku {sku} is a {backend} SKU but the rows were measured on "
                          f"{', '.join(sorted(set(df.device_type)))}: pass the SKU the rows came from")
    if isinstance(calibration, (str, Path)):  # read once: every method below prices with it
        from predictor.calibrate import Calibration

        calibration = Calibration.load(calibration)
    _check_rows_device(df, sku, calibration, force=force_calibration)
    base: dict = {f: step_model_base(df, sku=sku, calibration=calibration, form=f) for f in ("additive", "max")}
    base["parts"] = step_model_parts(df, sku=sku, calibration=calibration)
    base["cpu_ops"] = cpu_ops_base(df, sku=sku, calibration=calibration)
    base["probe_only"] = gpu_probe_base(df, sku=sku, calibration=calibration)
    base["rows"] = df
    pred, fits = predict_folds(df, all_folds(df), base, target=target, seed=seed)
    per_fold = score(pred, ["split", "fold", "method"])
    pooled = score(pred, ["split", "method"]).assign(fold="pooled")
    met = pd.concat([pooled, per_fold], ignore_index=True)
    met = met[["split", "fold", "method", "phase", "rows", "n", "r2", "mape_pct", "median_ape_pct", "p90_ape_pct"]]
    wil = wilcoxon_forms(pred)
    transfer = transfer_pairs(df, base, target=target, seed=seed) if df.model.nunique() > 1 else pd.DataFrame()
    headline = headline_text(met, wil)
    if not forest_available():
        headline += "\n" + FOREST_MISSING_NOTE
    if base["cpu_ops"] is not None:
        headline += interval_coverage_text(df, base["cpu_ops"], calibration, target)
        headline += reference_spread_text(df, target)
        headline += phase_matched_text(df, base["cpu_ops"], calibration, target)
    return EvalResult(pred, met, wil, transfer, fits, headline)


def run_evaluation(ec: EvalConfig) -> str:
    """Load rows, score, write tables, plots, the calibration and COMMAND into ``ec.out``; return the headline."""
    df = load_rows(ec.rows, allow_contended=ec.allow_contended)
    calibration = ec.loaded_calibration if ec.loaded_calibration is not None else ec.calibration
    res = evaluate_rows(df, sku=ec.sku, calibration=calibration, target=ec.target, seed=ec.seed,
                        force_calibration=ec.force_calibration)
    out = Path(ec.out)
    out.mkdir(parents=True, exist_ok=True)
    res.metrics.to_csv(out / "metrics.csv", index=False)
    res.predictions.to_csv(out / "predictions.csv", index=False)
    res.wilcoxon.to_csv(out / "wilcoxon.csv", index=False)
    res.host_fits.to_csv(out / "host_residual_fits.csv", index=False)
    if len(res.transfer):
        res.transfer.to_csv(out / "transfer.csv", index=False)
    cmd = command_line(ec)
    split = "by_model" if (res.predictions.split == "by_model").any() else "by_batch"
    plot_predictions(res.predictions, out, split)
    base_add = step_model_base(df, sku=ec.sku, calibration=calibration, form="additive")
    cal = output_calibration(df, base_add, sku=ec.sku, calibration=calibration, target=ec.target, rows=ec.rows)
    (out / "calibration.json").write_text(json.dumps(cal, indent=2) + "\n")
    parts = step_model_parts(df, sku=ec.sku, calibration=calibration)
    rowcal = rowcal_calibration(df, parts, sku=ec.sku, calibration=calibration, target=ec.target, rows=ec.rows)
    (out / "calibration-rowcal.json").write_text(json.dumps(rowcal, indent=2) + "\n")
    from common.outdir import write_command

    write_command(out, cmd)
    (out / "headline.md").write_text(f"<!-- {cmd} -->\n" + res.headline)
    (out / "tables.md").write_text(report_markdown(res, df, cmd, target=ec.target))
    return res.headline


