"""The methods ``gpubench evaluate`` scores (predictor.evaluate holds the splits and metrics); each has
``fit(train, target)`` and ``predict(test)``, and nothing is fitted on test rows.

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
- ``probe_only`` the same on a GPU: StepModel with the given calibration as it is (its S(N) included),
                priced for the engine each row names (``engine`` column: the eager torch loop, the
                graph engine with CUDA graphs, or vLLM with graphs and asynchronous scheduling),
                nothing fitted on any step row. Present only when a GPU calibration is given.
- ``vidur``     Vidur-style profile-and-interpolate: per op kind (torch.profiler, see ``predictor.profile``),
                a least-squares line over the *other* op-profiled steps of the same model (linear,
                elementwise, copy, gather, kv_write on new tokens; attention on sequences, keys read
                and query-key pairs; sampling on sequences), summed over kinds. The step it predicts is
                never among the steps it interpolates from; it exists only on op-profiled rows.
- ``rf``        a scikit-learn random forest on batch and model descriptors, log-time target.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

METHODS = ("cpu_ops", "probe_only", "additive", "max", "additive_rowcal", "max_rowcal", "vidur", "rf")
FORM_PAIRS = (("cpu_ops", "max"), ("additive", "max"), ("additive_rowcal", "max_rowcal"))
RF_FEATURES = ("num_seqs", "num_new_tokens", "context_sum", "context_max", "kv_len_sum", "step_flops",
               "weight_bytes", "kv_read_bytes", "num_layers", "hidden_size")


def ape_pct(measured, predicted) -> np.ndarray:
    """Absolute percentage error per row, in percent."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    return 100.0 * np.abs(p - m) / m



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
        models[(model, dtype)] = StepModel(*_hw_and_model(sku, model, calibration), calibration=_no_host(calibration, sku, dtype),
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

    def __init__(self, base_s: pd.Series, name: str = "cpu_ops"):
        self.base_s, self.name = base_s, name

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


def forest_available() -> bool:
    """Whether the random-forest baseline can run: scikit-learn is an optional extra (``baselines``),
    the only thing in the package that uses it."""
    import importlib.util

    return importlib.util.find_spec("sklearn") is not None


FOREST_MISSING_NOTE = ("The random-forest baseline (rf) was not run: scikit-learn is not installed "
                       "(`pip install 'gpubench[baselines]'`).\n")


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


def _hw_and_model(sku: str, model: str, calibration):
    """The device the rows are priced for (the CPU the calibration recorded, wherever this runs) and
    the model's config."""
    from common.model_config import load_model_config
    from predictor.host_match import spec_for_calibration

    return spec_for_calibration(sku, calibration), load_model_config(model)


def _no_host(calibration, sku: str, dtype: str):
    """The calibration (path, Calibration or None = defaults) with S(N) set to zero: it is fitted per split."""
    from predictor.calibrate import Calibration, Param, defaults
    from predictor.hardware import HardwareSpec

    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    if cal is None:
        cal = defaults(HardwareSpec.from_sku(sku), dtype)  # no calibration: the SKU (cpu: this host)
    zero = {k: Param(0.0, None, "measured", "evaluate: fitted per split") for k in ("s_floor_ms", "s_slope_ms")}
    return Calibration(sku=cal.sku, backend=cal.backend, dtype=cal.dtype, params=dict(cal.params),
                       hardware=dict(cal.hardware), host_residual=zero, meta=dict(cal.meta),
                       curves={k: dict(v) for k, v in cal.curves.items()})


def cpu_ops_base(df: pd.DataFrame, *, sku: str, calibration) -> pd.Series | None:
    """Probe-only predictions (CPU op tables) of every row, or None if the calibration has no
    tables for every dtype of the rows (or is not a CPU calibration)."""
    from predictor.calibrate import Calibration
    from predictor.engines import step_model_for_engine

    if calibration is None:
        return None
    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    if cal.backend != "cpu" or not set(df.dtype) <= set(cal.cpu_ops):
        return None
    engines = df["engine"].fillna("torch") if "engine" in df.columns else pd.Series("torch", index=df.index)
    threads = df["num_threads"] if "num_threads" in df.columns else pd.Series(np.nan, index=df.index)
    out = pd.Series(np.nan, index=df.index, dtype=np.float64)
    keys = ["model", "dtype", "_engine", "_threads"]
    for (model, dtype, engine, n), g in df.assign(_engine=engines, _threads=threads.fillna(0)).groupby(keys, sort=True):
        # the path `gpubench predict --engine` takes; rows from an engine at another thread count than
        # the probes are refused, as predict refuses them
        sm, _ = step_model_for_engine(*_hw_and_model(sku, model, calibration), calibration=cal, engine=engine, dtype=dtype,
                                      threads=int(n) or None)
        out.loc[g.index] = sm.predict_many([[tuple(s) for s in json.loads(b)] for b in g.batch_json])
    return out


def gpu_probe_base(df: pd.DataFrame, *, sku: str, calibration) -> pd.Series | None:
    """Probe-only predictions of GPU rows, each priced for the engine it names (None without a GPU
    calibration: the defaults are not probes)."""
    from predictor.calibrate import Calibration
    from predictor.engines import step_model_for_engine

    if calibration is None:
        return None
    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    if cal.backend == "cpu":
        return None
    engines = df["engine"].fillna("torch") if "engine" in df.columns else pd.Series("torch", index=df.index)
    out = pd.Series(np.nan, index=df.index, dtype=np.float64)
    for (model, dtype, engine), g in df.assign(_engine=engines).groupby(["model", "dtype", "_engine"], sort=True):
        sm, choice = step_model_for_engine(*_hw_and_model(sku, model, calibration), calibration=cal, engine=engine, dtype=dtype)
        out.loc[g.index] = [sm.predict_time([tuple(s) for s in json.loads(b)], async_scheduling=choice.async_scheduling)
                            for b in g.batch_json]
    return out


def step_model_base(df: pd.DataFrame, *, sku: str, calibration, form: str) -> pd.Series:
    """StepModel predictions of each row *without* the host term (S(N) is fitted per split)."""
    from predictor.step import StepModel

    out = pd.Series(np.nan, index=df.index, dtype=np.float64)
    for (model, dtype), g in df.groupby(["model", "dtype"], sort=True):
        sm = StepModel(*_hw_and_model(sku, model, calibration), calibration=_no_host(calibration, sku, dtype), form=form,
                       dtype=dtype)
        batches = [[tuple(s) for s in json.loads(b)] for b in g.batch_json]
        out.loc[g.index] = sm.predict_many(batches)
    return out
