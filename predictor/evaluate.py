"""Score step-time predictors on step rows, with held-out splits (``gpubench evaluate``).

Methods (each fitted on a split's training rows only, then scored on its test rows):

- ``additive``  ``predictor.StepModel(form="additive")`` for the rows' hardware and calibration, plus
                the host residual S(N) = s_floor + s_slope * max(0, N - 1) (N = sequences in the
                batch) fitted to the training rows' residuals (non-negative least squares, weighted
                by 1 / measured so the fit minimizes relative error).
- ``max``       the monolithic form ``max(sum T_c, sum T_m) + T_0``, with its own S(N) fitted the same way.
- ``additive_rowcal``, ``max_rowcal``: the same op graph and forms, but the hardware's compute time
                scale, memory time scale and per-op dispatch cost are fitted to the *training*
                rows together with S(N) (scipy least squares on relative error). This asks whether
                the forms transfer to an unseen model once the hardware constants are right, when
                the probe calibration of a busy shared host is not.
- ``cpu_ops``   probes only: StepModel with the calibration's CPU op tables (the ``torch_ops`` probe,
                predictor.cpu_tables), nothing fitted on any step row; q/k/v and gate/up priced as
                separate calls for the torch engine's rows and fused for vLLM's (``engine`` column).
                Present only when the calibration has tables for the rows' dtype.
- ``vidur``     Vidur-style profile-and-interpolate: per op kind (torch.profiler, see ``predictor.profile``),
                a least-squares line over the *other* op-profiled steps of the same model (linear,
                elementwise, copy, gather, kv_write on new tokens; attention on sequences, keys read
                and query-key pairs; sampling on sequences), summed over kinds. The step it predicts is
                never among the steps it interpolates from; it exists only on op-profiled rows.
- ``rf``        a scikit-learn random forest on batch and model descriptors, log-time target.

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
from typing import Any, Protocol

import numpy as np
import pandas as pd

from gpubench.errors import ConfigError, ResultsFormatError

REQUIRED_COLUMNS = ("key", "model", "dtype", "device_type", "phase", "num_seqs", "num_new_tokens",
                    "context_sum", "context_max", "batch_json", "wall_s", "ops_profiled", "op_sum_s")
METHODS = ("cpu_ops", "additive", "max", "additive_rowcal", "max_rowcal", "vidur", "rf")
FORM_PAIRS = (("cpu_ops", "max"), ("additive", "max"), ("additive_rowcal", "max_rowcal"))
PHASES = ("all", "decode", "prefill", "mixed")
RF_FEATURES = ("num_seqs", "num_new_tokens", "context_sum", "context_max", "kv_len_sum", "step_flops",
               "weight_bytes", "kv_read_bytes", "num_layers", "hidden_size")


# ----------------------------------------------------------------------------- metrics
def ape_pct(measured, predicted) -> np.ndarray:
    """Absolute percentage error per row, in percent."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    return 100.0 * np.abs(p - m) / m


def metrics(measured, predicted) -> dict:
    """n, R^2 (1 - SS_res/SS_tot on seconds), MAPE, median and p90 APE (percent); NaN rows dropped."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    ok = np.isfinite(m) & np.isfinite(p)
    m, p = m[ok], p[ok]
    if m.size == 0:
        return {"n": 0, "r2": np.nan, "mape_pct": np.nan, "median_ape_pct": np.nan, "p90_ape_pct": np.nan}
    ss_tot = float(np.sum((m - m.mean()) ** 2))
    r2 = 1.0 - float(np.sum((m - p) ** 2)) / ss_tot if ss_tot > 0 else np.nan
    e = ape_pct(m, p)
    return {"n": int(m.size), "r2": r2, "mape_pct": float(e.mean()), "median_ape_pct": float(np.median(e)),
            "p90_ape_pct": float(np.percentile(e, 90))}


def fit_host_residual(num_seqs, residual_s, measured_s) -> tuple[float, float]:
    """(s_floor_s, s_slope_s) >= 0 minimizing sum(((residual - S(N)) / measured)^2).

    S(N) = s_floor + s_slope * max(0, N - 1). Weighting by 1/measured makes the fit minimize the
    relative error of the total prediction, which is what the evaluation scores.
    """
    from scipy.optimize import nnls

    n = np.asarray(num_seqs, dtype=np.float64)
    r, w = np.asarray(residual_s, dtype=np.float64), 1.0 / np.asarray(measured_s, dtype=np.float64)
    a = np.column_stack([np.ones_like(n), np.maximum(0.0, n - 1.0)]) * w[:, None]
    coef, _ = nnls(a, r * w)
    return float(coef[0]), float(coef[1])


# ----------------------------------------------------------------------------- rows
def load_rows(paths, *, allow_contended: bool = False) -> pd.DataFrame:
    """Concatenate step-row files (parquet from ``gpubench profile``); checks the columns it needs.

    Rows flagged ``contended`` (taken while the host gave the engine less CPU than it asked for:
    ``gpubench profile --engine vllm`` marks them) are not ground truth: a file with any is refused
    unless ``allow_contended``, and then those rows are dropped rather than scored.
    """
    from predictor.profile import read_rows

    frames = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise ResultsFormatError(f"{p}: no such rows file (make one with `gpubench profile ... --out {p}`)")
        rows = read_rows(p)
        if not rows:
            raise ResultsFormatError(f"{p}: no rows")
        df = pd.DataFrame(rows)
        missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
        if missing:
            raise ResultsFormatError(f"{p}: not step rows (missing columns: {', '.join(missing)})")
        if "contended" in df.columns and df["contended"].fillna(False).astype(bool).any():
            bad = int(df["contended"].fillna(False).astype(bool).sum())
            if not allow_contended:
                raise ResultsFormatError(f"{p}: {bad} of {len(df)} rows were taken under contention (low CPU share or "
                                         f"high load): re-take them on a quiet machine, or pass --allow-contended to "
                                         f"score the other rows only")
            df = df[~df["contended"].fillna(False).astype(bool)]
        df["source_file"] = str(p)
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    dup = df.key[df.key.duplicated()]
    if len(dup):
        raise ResultsFormatError(f"step row '{dup.iloc[0]}' appears in more than one input")
    return df.sort_values("key", kind="stable").reset_index(drop=True)


# ----------------------------------------------------------------------------- methods
class Method(Protocol):
    name: str

    def fit(self, train: pd.DataFrame, target: np.ndarray) -> None: ...

    def predict(self, test: pd.DataFrame) -> np.ndarray: ...


class StepForm:
    """A StepModel form without its host term (``base_s``) plus S(N) fitted on training rows."""

    def __init__(self, form: str, base_s: pd.Series):
        self.name, self.base_s = form, base_s
        self.s_floor_s = self.s_slope_s = 0.0

    def fit(self, train: pd.DataFrame, target: np.ndarray) -> None:
        base = self.base_s.loc[train.index].to_numpy()
        self.s_floor_s, self.s_slope_s = fit_host_residual(train.num_seqs, target - base, target)

    def host_s(self, num_seqs) -> np.ndarray:
        return self.s_floor_s + self.s_slope_s * np.maximum(0.0, np.asarray(num_seqs, dtype=np.float64) - 1.0)

    def predict(self, test: pd.DataFrame) -> np.ndarray:
        return self.base_s.loc[test.index].to_numpy() + self.host_s(test.num_seqs)


@dataclass(frozen=True)
class OpParts:
    """Per row: the StepModel's per-op compute and memory times (s, summed over layers), the
    sampling op's, and the dispatch term; forms are recombined from these with fitted scales."""
    t_c: np.ndarray      # [rows, ops] without sampling
    t_m: np.ndarray
    sample_c: np.ndarray  # [rows]
    sample_m: np.ndarray
    launch_s: np.ndarray  # [rows]
    index: pd.Index


def step_model_parts(df: pd.DataFrame, *, sku: str, calibration) -> OpParts:
    """Per-op (t_c, t_m) of every row from ``StepModel.predict`` (the op graph of the row's model)."""
    from predictor.step import StepModel

    rows_c, rows_m, sc, sm_, la = [], [], [], [], []
    models = {}
    width = 0
    for (model, dtype), g in df.groupby(["model", "dtype"], sort=True):
        models[(model, dtype)] = StepModel(*_hw_and_model(sku, model), calibration=_no_host(calibration, sku, dtype),
                                           form="additive", dtype=dtype)
    for r in df.itertuples():
        m = models[(r.model, r.dtype)]
        pred = m.predict([tuple(x) for x in json.loads(r.batch_json)])
        sample = m.graph.ops[m.graph.sample_index].name
        ops = [o for k, o in pred.ops.items() if k != sample]
        rows_c.append([o.t_c_s for o in ops])
        rows_m.append([o.t_m_s for o in ops])
        sc.append(pred.ops[sample].t_c_s)
        sm_.append(pred.ops[sample].t_m_s)
        la.append(pred.launch_added_s)
        width = max(width, len(ops))
    pad = lambda rows: np.array([x + [0.0] * (width - len(x)) for x in rows])  # noqa: E731
    return OpParts(pad(rows_c), pad(rows_m), np.array(sc), np.array(sm_), np.array(la), df.index)


class RowCalibrated:
    """A form whose compute scale a, memory scale b and dispatch scale d are fitted with S(N).

    additive: sum_op max(a t_c, b t_m) + d launch + S(N) + max(a t_c, b t_m)_sample;
    max:      max(a sum t_c, b sum t_m) + the same other terms.
    """

    def __init__(self, form: str, parts: OpParts):
        self.form, self.name, self.parts = form, f"{form}_rowcal", parts
        self.theta = np.array([0.0, 0.0, 0.0, 0.0, 0.0])  # log a, log b, log d, s_floor_ms, s_slope_ms

    def _rows(self, frame: pd.DataFrame) -> np.ndarray:
        return self.parts.index.get_indexer(frame.index)

    def _predict(self, theta, idx, num_seqs) -> np.ndarray:
        a, b, d = np.exp(theta[:3])
        p = self.parts
        tc, tm = a * p.t_c[idx], b * p.t_m[idx]
        blocks = np.maximum(tc, tm).sum(1) if self.form == "additive" else np.maximum(tc.sum(1), tm.sum(1))
        host = 1e-3 * (theta[3] + theta[4] * np.maximum(0.0, num_seqs - 1.0))
        return blocks + d * p.launch_s[idx] + host + np.maximum(a * p.sample_c[idx], b * p.sample_m[idx])

    def fit(self, train: pd.DataFrame, target: np.ndarray) -> None:
        from scipy.optimize import least_squares

        idx, n = self._rows(train), train.num_seqs.to_numpy(np.float64)
        # NOTE: max() makes the loss non-convex in (a, b): a single start lands in a different
        # local minimum depending on how far the base calibration is off. Start from a grid of
        # scales and keep the lowest *training* loss.
        best = None
        for la in (-2.0, 0.0, 2.0):
            for lb in (-2.0, 0.0, 2.0):
                res = least_squares(lambda th: (self._predict(th, idx, n) - target) / target,
                                    np.array([la, lb, 0.0, 0.0, 0.0]),
                                    bounds=([-6, -6, -6, 0, 0], [6, 6, 6, np.inf, np.inf]), method="trf")
                if best is None or res.cost < best.cost:
                    best = res
        assert best is not None  # nine starts ran
        self.theta = best.x

    @property
    def scales(self) -> dict:
        a, b, d = np.exp(self.theta[:3])
        return {"compute_scale": a, "memory_scale": b, "dispatch_scale": d,
                "s_floor_ms": self.theta[3], "s_slope_ms": self.theta[4]}

    def predict(self, test: pd.DataFrame) -> np.ndarray:
        return self._predict(self.theta, self._rows(test), test.num_seqs.to_numpy(np.float64))


class ProbeOnly:
    """Predictions fixed before any split (from probes alone): nothing to fit."""

    name = "cpu_ops"

    def __init__(self, base_s: pd.Series):
        self.base_s = base_s

    def fit(self, train: pd.DataFrame, target: np.ndarray) -> None:
        pass

    def predict(self, test: pd.DataFrame) -> np.ndarray:
        return self.base_s.loc[test.index].to_numpy()


def _kind_features(frame: pd.DataFrame, kind: str) -> np.ndarray:
    """Regressors of one op kind's time (see the module docstring's ``vidur``)."""
    one = np.ones(len(frame))
    if kind == "attention":
        new, ctx = frame.num_new_tokens.to_numpy(float), frame.kv_len_sum.to_numpy(float)
        return np.stack([one, frame.num_seqs.to_numpy(float), ctx, new * frame.context_max.to_numpy(float)], axis=1)
    if kind == "sampling":
        return np.stack([one, frame.num_seqs.to_numpy(float)], axis=1)
    return np.stack([one, frame.num_new_tokens.to_numpy(float), frame.num_seqs.to_numpy(float)], axis=1)


class VidurStyle:
    """Profile some of a model's steps op by op, interpolate the rest (see the module docstring).

    ``column``: ``op_sum_s`` for wall-time targets, ``op_sum_cpu_s`` for ``thread_cpu_s`` (the
    per-kind profiled times are rescaled by each training step's column / its kinds' sum).
    """
    name = "vidur"

    def __init__(self, frame: pd.DataFrame, column: str = "op_sum_s"):
        self.frame, self.column = frame, column

    def fit(self, train: pd.DataFrame, target: np.ndarray) -> None:
        pass  # it interpolates from the same model's other profiled steps, whichever split holds them

    def predict(self, test: pd.DataFrame) -> np.ndarray:
        out = np.full(len(test), np.nan)
        prof = self.frame[self.frame.ops_profiled.astype(bool)]
        for i, (idx, row) in enumerate(test.iterrows()):
            if not bool(row.ops_profiled):
                continue
            others = prof[(prof.model == row.model) & (prof.key != row.key)]
            if len(others) < 3:
                continue
            kinds = [json.loads(j) for j in others.ops_json]
            clock = others[self.column].to_numpy(float) / np.array([sum(k.values()) for k in kinds])
            total = 0.0
            for kind in sorted({k for d in kinds for k in d}):
                y = np.array([d.get(kind, 0.0) for d in kinds]) * clock
                x = _kind_features(others, kind)
                coef, *_ = np.linalg.lstsq(x, y, rcond=None)
                total += max(0.0, float((_kind_features(test.loc[[idx]], kind) @ coef)[0]))
            out[i] = total
        return out


class ForestModel:
    """Random forest on batch and model descriptors, fitted to log(time) (relative errors)."""
    name = "rf"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.model: Any = None  # a RandomForestRegressor once fitted (sklearn is imported in fit)

    def fit(self, train: pd.DataFrame, target: np.ndarray) -> None:
        from sklearn.ensemble import RandomForestRegressor

        self.model = RandomForestRegressor(n_estimators=100, random_state=self.seed, n_jobs=1)
        self.model.fit(train[list(RF_FEATURES)].to_numpy(np.float64), np.log(target))

    def predict(self, test: pd.DataFrame) -> np.ndarray:
        return np.exp(self.model.predict(test[list(RF_FEATURES)].to_numpy(np.float64)))


def _hw_and_model(sku: str, model: str):
    from predictor.config import load_model_config
    from predictor.hardware import HardwareSpec

    return HardwareSpec.from_sku(sku), load_model_config(model)


def _no_host(calibration, sku: str, dtype: str):
    """The calibration (path, Calibration or None = defaults) with S(N) set to zero: it is fitted per split."""
    from predictor.calibrate import Calibration, Param, defaults
    from predictor.hardware import HardwareSpec

    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    if cal is None:
        cal = defaults(HardwareSpec.from_sku(sku), dtype)
    zero = {k: Param(0.0, None, "measured", "evaluate: fitted per split") for k in ("s_floor_ms", "s_slope_ms")}
    return Calibration(sku=cal.sku, backend=cal.backend, dtype=cal.dtype, params=dict(cal.params),
                       hardware=dict(cal.hardware), host_residual=zero, meta=dict(cal.meta),
                       curves={k: dict(v) for k, v in cal.curves.items()})


def cpu_ops_base(df: pd.DataFrame, *, sku: str, calibration) -> pd.Series | None:
    """Probe-only predictions (CPU op tables) of every row, or None if the calibration has no
    tables for every dtype of the rows (or is not a CPU calibration)."""
    from predictor.calibrate import Calibration
    from predictor.step import StepModel

    if calibration is None:
        return None
    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    if cal.backend != "cpu" or not set(df.dtype) <= set(cal.cpu_ops):
        return None
    engines = df["engine"].fillna("torch") if "engine" in df.columns else pd.Series("torch", index=df.index)
    out = pd.Series(np.nan, index=df.index, dtype=np.float64)
    for (model, dtype, engine), g in df.assign(_engine=engines).groupby(["model", "dtype", "_engine"], sort=True):
        sm = StepModel(*_hw_and_model(sku, model), calibration=cal, form="additive", dtype=dtype,
                       gemm_layout="fused" if engine == "vllm" else "separate")
        out.loc[g.index] = sm.predict_many([[tuple(s) for s in json.loads(b)] for b in g.batch_json])
    return out


def step_model_base(df: pd.DataFrame, *, sku: str, calibration, form: str) -> pd.Series:
    """StepModel predictions of each row *without* the host term (S(N) is fitted per split)."""
    from predictor.step import StepModel

    out = pd.Series(np.nan, index=df.index, dtype=np.float64)
    for (model, dtype), g in df.groupby(["model", "dtype"], sort=True):
        sm = StepModel(*_hw_and_model(sku, model), calibration=_no_host(calibration, sku, dtype), form=form,
                       dtype=dtype)
        batches = [[tuple(s) for s in json.loads(b)] for b in g.batch_json]
        out.loc[g.index] = sm.predict_many(batches)
    return out


# ----------------------------------------------------------------------------- splits
@dataclass(frozen=True)
class Fold:
    split: str
    name: str
    train: np.ndarray  # bool masks over the rows
    test: np.ndarray


def interleaved_folds(df: pd.DataFrame, column: str, split: str) -> list[Fold]:
    """Hold out every other distinct value of ``column`` (interpolation, not extrapolation)."""
    values = np.sort(df[column].unique())
    held = set(values[1::2].tolist())
    test = df[column].isin(held).to_numpy()
    return [Fold(split, f"{column} in {sorted(held)}", ~test, test)]


def model_folds(df: pd.DataFrame) -> list[Fold]:
    """Leave one model out (needs >= 2 models)."""
    models = sorted(df.model.unique())
    if len(models) < 2:
        return []
    return [Fold("by_model", f"test={m}", (df.model != m).to_numpy(), (df.model == m).to_numpy()) for m in models]


def all_folds(df: pd.DataFrame) -> list[Fold]:
    every = np.ones(len(df), dtype=bool)
    return ([Fold("in_sample", "all rows", every, every)] + interleaved_folds(df, "num_seqs", "by_batch")
            + interleaved_folds(df, "context_max", "by_context") + model_folds(df))


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
    return [*probe_only, StepForm("additive", base["additive"]), StepForm("max", base["max"]),
            RowCalibrated("additive", base["parts"]), RowCalibrated("max", base["parts"]),
            VidurStyle(base["rows"], vidur_column(target)), ForestModel(seed)]


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
                      RowCalibrated("additive", base["parts"]), ForestModel(seed)):
                m.fit(train, train[target].to_numpy(np.float64))
                pred = m.predict(test)
                for ph in ("all", "decode"):
                    sel = np.ones(len(test), bool) if ph == "all" else (test.phase == ph).to_numpy()
                    recs.append({"train_model": a, "test_model": b, "method": m.name, "phase": ph,
                                 **metrics(test[target].to_numpy()[sel], pred[sel])})
    return pd.DataFrame(recs)


# ----------------------------------------------------------------------------- reporting
def markdown_table(df: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A GitHub Markdown table (no tabulate dependency)."""
    def cell(v):
        if isinstance(v, (float, np.floating)):
            return "" if np.isnan(v) else format(v, floatfmt)
        return str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _pooled(metrics_df: pd.DataFrame, split: str, phase: str, rows: str) -> pd.DataFrame:
    m = metrics_df[(metrics_df.split == split) & (metrics_df.fold == "pooled") & (metrics_df.phase == phase)
                   & (metrics_df.rows == rows)]
    return m.set_index("method")


def headline_text(metrics_df: pd.DataFrame, wil: pd.DataFrame, *, goal_pct: float = 10.0,
                  stretch_pct: float = 5.0) -> str:
    """The held-out-by-model decode table and the verdicts the issue asks for, as Markdown."""
    split = "by_model" if (metrics_df.split == "by_model").any() else "by_batch"
    cols = ["method", "rows", "n", "mape_pct", "median_ape_pct", "p90_ape_pct", "r2"]
    sel = metrics_df[(metrics_df.split == split) & (metrics_df.fold == "pooled") & (metrics_df.phase == "decode")]
    order = {m: i for i, m in enumerate(METHODS)}
    sel = sel.sort_values(["rows", "method"], key=lambda s: s.map(order) if s.name == "method" else s)
    lines = [f"Held out {split.replace('_', ' ')} ({'leave one model out' if split == 'by_model' else 'interleaved'}), "
             "decode steps:", "", markdown_table(sel[cols]), ""]
    all_rows, prof = _pooled(metrics_df, split, "decode", "all"), _pooled(metrics_df, split, "decode", "op_profiled")
    for a, b in FORM_PAIRS:
        if a not in all_rows.index:
            continue
        x = all_rows.loc[a, "mape_pct"]
        verdict = "met" if x <= goal_pct else "NOT met"
        stretch = "met" if x <= stretch_pct else "not met"
        lines.append(f"- `{a}`, decode, {split}: MAPE {x:.2f} % (goal <= {goal_pct:g} %: {verdict}; "
                     f"stretch <= {stretch_pct:g} %: {stretch})")
        y = all_rows.loc[b, "mape_pct"] if b in all_rows.index else np.nan
        lines.append(f"  - beats `{b}` on the same rows: {'yes' if x < y else 'NO'} ({x:.2f} % vs {y:.2f} %)")
        if "vidur" in prof.index and a in prof.index:
            av, vv = prof.loc[a, "mape_pct"], prof.loc["vidur", "mape_pct"]
            lines.append(f"  - beats the Vidur-style baseline on the op-profiled rows: {'yes' if av < vv else 'NO'} "
                         f"({av:.2f} % vs {vv:.2f} %, n = {int(prof.loc['vidur', 'n'])})")
        w = wil[(wil.split == split) & (wil.phase == "decode") & (wil.pair == f"{a} vs {b}")] if len(wil) else wil
        if len(w):
            r = w.iloc[0]
            lines.append(f"  - paired Wilcoxon of |error| vs `{b}`: n = {int(r.n)}, p = {r.p_value:.3g} "
                         f"(median |err| {r.median_abs_err_a_ms:.3f} ms vs {r.median_abs_err_b_ms:.3f} ms)")
    return "\n".join(lines) + "\n"


def plot_predictions(pred: pd.DataFrame, out: Path, split: str) -> list[Path]:
    """Predicted vs measured (log-log, one panel per method) and median APE vs batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = pred[pred.split == split]
    models = sorted(g.model.unique())
    colors = {m: plt.cm.tab10(i) for i, m in enumerate(models)}
    fig, axes = plt.subplots(1, len(METHODS), figsize=(4 * len(METHODS), 4), squeeze=False)
    for ax, method in zip(axes[0], METHODS):
        gm = g[(g.method == method) & np.isfinite(g.predicted_s)]
        for m in models:
            s = gm[gm.model == m]
            ax.scatter(s.measured_s * 1e3, s.predicted_s * 1e3, s=10, color=colors[m], label=m, alpha=0.8)
        ax.set(title=f"{method} ({split})", xlabel="measured step (ms)", ylabel="predicted step (ms)")
        if len(gm):
            lo = 0.8 * min(gm.measured_s.min(), gm.predicted_s.min()) * 1e3
            hi = 1.25 * max(gm.measured_s.max(), gm.predicted_s.max()) * 1e3
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set(xscale="log", yscale="log")
        else:  # e.g. no op-profiled rows for the Vidur-style baseline (vLLM's rows)
            ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "pred_vs_measured.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, phase in zip(axes, ("decode", "all")):
        gp = g if phase == "all" else g[g.phase == phase]
        drawn = 0
        for method in METHODS:
            gm = gp[(gp.method == method) & np.isfinite(gp.predicted_s)]
            if not len(gm):
                continue
            e = gm.assign(ape=ape_pct(gm.measured_s, gm.predicted_s)).groupby("num_seqs").ape.median()
            e = e[(e > 0) & (e.index > 0)]  # a log axis: an exact prediction has no place on it
            if len(e):
                ax.plot(e.index, e.to_numpy(), marker="o", label=method)
                drawn += 1
        ax.set(xlabel="sequences in the batch", ylabel="median APE (%)", title=f"error vs batch, {phase} steps ({split})")
        if drawn:
            ax.set(xscale="log", yscale="log")
            ax.legend(fontsize=8)
    fig.tight_layout()
    p2 = out / "error_vs_batch.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def output_calibration(df: pd.DataFrame, base: pd.Series, *, sku: str, calibration, target: str,
                       rows: list[str]) -> dict:
    """The input calibration (or defaults) with a measured ``host_residual`` fitted on all given rows."""
    from predictor.calibrate import Calibration, defaults
    from predictor.hardware import HardwareSpec

    cal = Calibration.load(calibration) if calibration else defaults(HardwareSpec.from_sku(sku), df.dtype.iloc[0])
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
    sm = StepModel(*_hw_and_model(sku, df.model.iloc[0]), calibration=base, dtype=dtype)
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
    parts += ["--sku", ec.sku, "--target", ec.target, "--seed", str(ec.seed), "--out", ec.out]
    return shlex.join(parts)


def evaluate_rows(df: pd.DataFrame, *, sku: str, calibration, target: str = "wall_s", seed: int = 0) -> EvalResult:
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
    base: dict = {f: step_model_base(df, sku=sku, calibration=calibration, form=f) for f in ("additive", "max")}
    base["parts"] = step_model_parts(df, sku=sku, calibration=calibration)
    base["cpu_ops"] = cpu_ops_base(df, sku=sku, calibration=calibration)
    base["rows"] = df
    pred, fits = predict_folds(df, all_folds(df), base, target=target, seed=seed)
    per_fold = score(pred, ["split", "fold", "method"])
    pooled = score(pred, ["split", "method"]).assign(fold="pooled")
    met = pd.concat([pooled, per_fold], ignore_index=True)
    met = met[["split", "fold", "method", "phase", "rows", "n", "r2", "mape_pct", "median_ape_pct", "p90_ape_pct"]]
    wil = wilcoxon_forms(pred)
    transfer = transfer_pairs(df, base, target=target, seed=seed) if df.model.nunique() > 1 else pd.DataFrame()
    headline = headline_text(met, wil)
    if base["cpu_ops"] is not None:
        headline += interval_coverage_text(df, base["cpu_ops"], calibration, target)
        headline += phase_matched_text(df, base["cpu_ops"], calibration, target)
    return EvalResult(pred, met, wil, transfer, fits, headline)


def phase_matched_text(df: pd.DataFrame, predicted: pd.Series, calibration, target: str) -> str:
    """A diagnostic, not a prediction a user can make ahead of time: the CPU op tables' decode MAPE
    when each prediction is taken to the machine phase of its row, i.e. multiplied by the row's own
    reference GEMV over the probe run's median one (the same cold GEMV, timed right before the
    row's steps). What it removes is the host's drift between the probe run and the rows; nothing
    is fitted. Empty when the rows or the calibration lack the reference."""
    from predictor.calibrate import Calibration

    if "ref_gemv_s" not in df.columns:
        return ""
    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    probe_ref = np.array([(cal.cpu_ops[dt].d.get("phase_spread") or {}).get("reference_median_s") or np.nan
                          for dt in df.dtype], dtype=float)
    phase = df["ref_gemv_s"].to_numpy(float) / probe_ref
    y, p = df[target].to_numpy(np.float64), predicted.to_numpy()
    sel = (df.phase == "decode").to_numpy() & np.isfinite(phase)
    if not sel.any():
        return ""
    raw, matched = ape_pct(y[sel], p[sel]).mean(), ape_pct(y[sel], p[sel] * phase[sel]).mean()
    return (f"- `cpu_ops` at each row's machine phase (prediction x the row's reference GEMV / the probe run's, "
            f"a diagnostic of host drift, not a held-out figure): decode MAPE {matched:.2f} % against "
            f"{raw:.2f} % as predicted (n = {int(sel.sum())}; row phase / probe phase median "
            f"{np.median(phase[sel]):.3f}, p10..p90 {np.percentile(phase[sel], 10):.3f}..{np.percentile(phase[sel], 90):.3f})\n")


def interval_coverage_text(df: pd.DataFrame, predicted: pd.Series, calibration, target: str) -> str:
    """How often the measured step lies inside the CPU op tables' 80 % interval, per phase."""
    from predictor.calibrate import Calibration

    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    lows, highs = zip(*(cal.cpu_ops[dt].interval_factors() for dt in df.dtype))
    y, p = df[target].to_numpy(np.float64), predicted.to_numpy()
    inside = (y >= p * np.array(lows)) & (y <= p * np.array(highs))
    parts = []
    for phase in ("decode", "prefill", "mixed"):
        sel = (df.phase == phase).to_numpy()
        if sel.any():
            parts.append(f"{phase} {inside[sel].mean():.0%} of {int(sel.sum())}")
    return (f"- `cpu_ops` 80 % interval (x{min(lows):.2f} .. x{max(highs):.2f} of the prediction, from the probe "
            f"run's own spread): holds the measured step for {', '.join(parts)} rows\n")


def run_evaluation(ec: EvalConfig) -> str:
    """Load rows, score, write tables, plots, the calibration and COMMAND into ``ec.out``; return the headline."""
    df = load_rows(ec.rows, allow_contended=ec.allow_contended)
    res = evaluate_rows(df, sku=ec.sku, calibration=ec.calibration, target=ec.target, seed=ec.seed)
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
    base_add = step_model_base(df, sku=ec.sku, calibration=ec.calibration, form="additive")
    cal = output_calibration(df, base_add, sku=ec.sku, calibration=ec.calibration, target=ec.target, rows=ec.rows)
    (out / "calibration.json").write_text(json.dumps(cal, indent=2) + "\n")
    parts = step_model_parts(df, sku=ec.sku, calibration=ec.calibration)
    rowcal = rowcal_calibration(df, parts, sku=ec.sku, calibration=ec.calibration, target=ec.target, rows=ec.rows)
    (out / "calibration-rowcal.json").write_text(json.dumps(rowcal, indent=2) + "\n")
    from gpubench.outdir import write_command

    write_command(out, cmd)
    (out / "headline.md").write_text(f"<!-- {cmd} -->\n" + res.headline)
    (out / "tables.md").write_text(report_markdown(res, df, cmd, target=ec.target))
    return res.headline


def report_markdown(res: EvalResult, df: pd.DataFrame, cmd: str, *, target: str) -> str:
    """Every pooled table, the S(N) fits, Wilcoxon and transfer pairs, stamped with the command."""
    cols = ["method", "phase", "rows", "n", "mape_pct", "median_ape_pct", "p90_ape_pct", "r2"]
    parts = [f"# Step-time evaluation\n\nRegenerate: `{cmd}`\n",
             f"Rows: {len(df)} steps of {', '.join(sorted(df.model.unique()))} "
             f"(target `{target}`; device {', '.join(sorted(df.device_type.unique()))}; "
             f"host load average during profiling {df.get('loadavg_1m_before', pd.Series([np.nan])).median():.1f}).\n",
             "## Headline\n", res.headline]
    for split in res.metrics.split.unique():
        m = res.metrics[(res.metrics.split == split) & (res.metrics.fold == "pooled")]
        folds = ", ".join(res.metrics[(res.metrics.split == split) & (res.metrics.fold != "pooled")].fold.unique())
        parts += [f"\n## {split} (test folds: {folds})\n", markdown_table(m[cols]), ""]
    parts += ["\n## Host residual S(N) per training split (ms)\n", markdown_table(res.host_fits, ".4f"),
              "\n## Paired Wilcoxon: |error| additive vs max\n", markdown_table(res.wilcoxon, ".4g")]
    if len(res.transfer):
        parts += ["\n## Train on one model, score on another\n", markdown_table(res.transfer)]
    return "\n".join(parts) + "\n"
