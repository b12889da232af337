"""`gpubench evaluate`: metrics with known answers, splits, S(N) fit, and end-to-end on synthetic rows."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from common.errors import ResultsFormatError
from predictor import load_model_config
from predictor.eval_methods import StepForm, fit_host_residual, step_model_base
from predictor.eval_rows import all_folds, interleaved_folds, load_rows, metrics
from predictor.evaluate import EvalConfig, evaluate_rows, run_evaluation
from predictor.profile_grid import GRIDS, build_grid, point_features

S_FLOOR_S, S_SLOPE_S = 3e-3, 4e-4


def test_metrics_known_answer():
    m = metrics([1.0, 2.0, 4.0], [1.1, 1.8, 4.0])  # APE 10, 10, 0 %
    assert m["n"] == 3
    assert m["mape_pct"] == pytest.approx(20 / 3)
    assert m["median_ape_pct"] == pytest.approx(10.0)
    assert m["p90_ape_pct"] == pytest.approx(10.0)
    ss_res, ss_tot = 0.01 + 0.04, (1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2
    assert m["r2"] == pytest.approx(1 - ss_res / ss_tot)


def test_metrics_drop_nan_predictions():
    m = metrics([1.0, 2.0], [np.nan, 2.2])
    assert m["n"] == 1 and m["mape_pct"] == pytest.approx(10.0)
    assert metrics([1.0], [np.nan])["n"] == 0


def test_host_residual_recovers_floor_and_slope():
    n = np.array([1, 1, 2, 4, 8, 16, 64])
    measured = np.linspace(0.01, 0.2, n.size)
    resid = S_FLOOR_S + S_SLOPE_S * np.maximum(0, n - 1)
    floor, slope = fit_host_residual(n, resid, measured)
    assert floor == pytest.approx(S_FLOOR_S, rel=1e-9) and slope == pytest.approx(S_SLOPE_S, rel=1e-9)


def test_host_residual_is_never_negative():
    floor, slope = fit_host_residual([1, 2, 4], [-0.01, -0.02, -0.03], [0.1, 0.1, 0.1])
    assert floor == 0.0 and slope == 0.0


def test_interleaved_folds_hold_out_every_other_value():
    df = pd.DataFrame({"num_seqs": [1, 2, 4, 8, 8, 2]})
    (fold,) = interleaved_folds(df, "num_seqs", "by_batch")
    assert fold.test.tolist() == [False, True, False, True, True, True]
    assert not np.any(fold.train & fold.test)


def _synthetic_rows() -> pd.DataFrame:
    """Rows whose truth is the additive StepModel plus a known S(N); Vidur-style sums are 80 % of it."""
    rows = []
    for name in ("tiny-llama", "llama-60m"):
        cfg = load_model_config(name)
        for p in build_grid(GRIDS["quick"], cfg, dtype_bytes=4)[::2]:
            rows.append({"key": f"{name}|cpu|fp32|{p.key}", "model": name, "dtype": "fp32", "device_type": "cpu",
                         "phase": p.phase, **point_features(cfg, p, 4), "ops_profiled": len(rows) % 2 == 0})
    df = pd.DataFrame(rows)
    base = step_model_base(df, sku="cpu", calibration=None, form="additive")
    df["wall_s"] = base + S_FLOOR_S + S_SLOPE_S * np.maximum(0, df.num_seqs - 1)
    # per-kind profiled times that are exactly linear in the Vidur-style regressors, so interpolating
    # from the other steps of the model must reproduce each step's own sum
    linear = 1e-3 + 2e-5 * df.num_new_tokens
    attention = 3e-4 * df.num_seqs + 1e-7 * df.kv_len_sum
    df["ops_json"] = [json.dumps({"linear": a, "attention": b}) if prof else None
                      for a, b, prof in zip(linear, attention, df.ops_profiled)]
    df["op_sum_s"] = np.where(df.ops_profiled, linear + attention, np.nan)
    return df


@pytest.fixture(scope="module")
def synthetic():
    df = _synthetic_rows()
    return df, evaluate_rows(df, sku="cpu", calibration=None)


def test_additive_is_exact_on_its_own_rows_in_every_split(synthetic):
    df, res = synthetic
    pooled = res.metrics[(res.metrics.fold == "pooled") & (res.metrics.rows == "all")]
    add = pooled[pooled.method == "additive"]
    assert set(add.split) == {"in_sample", "by_batch", "by_context", "by_model"}
    assert add.mape_pct.max() < 1e-9
    fits = res.host_fits[res.host_fits.method == "additive"]
    assert np.allclose(fits.s_floor_ms, S_FLOOR_S * 1e3) and np.allclose(fits.s_slope_ms, S_SLOPE_S * 1e3)


def test_vidur_baseline_interpolates_from_other_profiled_steps_only(synthetic):
    from predictor.evaluate import VidurStyle

    df, res = synthetic
    v = res.metrics[(res.metrics.method == "vidur") & (res.metrics.fold == "pooled") & (res.metrics.phase == "all")]
    assert (v[v.rows == "all"].n.to_numpy() == v[v.rows == "op_profiled"].n.to_numpy()).all()
    assert v[(v.split == "in_sample")].n.iloc[0] == df.ops_profiled.sum()
    prof = df[df.ops_profiled]
    pred = VidurStyle(df).predict(prof)
    assert np.allclose(pred, prof.op_sum_s, rtol=1e-6)  # exact when the kinds are linear in the regressors
    # the step being predicted is never used: corrupting its own profile leaves its prediction unchanged
    bad = df.copy()
    victim = prof.index[3]
    bad.loc[victim, "ops_json"] = json.dumps({"linear": 100.0, "attention": 100.0})
    again = VidurStyle(bad).predict(bad.loc[prof.index])
    assert again[3] == pytest.approx(pred[3], rel=1e-9)
    same_model = (bad.loc[prof.index].model == bad.loc[victim, "model"]).to_numpy()
    others = np.arange(len(prof)) != 3
    assert not np.allclose(again[others & same_model], pred[others & same_model])


def test_splits_never_train_on_test_rows(synthetic):
    df, res = synthetic
    for fold in all_folds(df):
        if fold.split != "in_sample":
            assert not np.any(fold.train & fold.test) and fold.test.any() and fold.train.any()
    models = res.predictions[res.predictions.split == "by_model"].groupby("fold").model.unique()
    assert all(len(m) == 1 and f == f"test={m[0]}" for f, m in models.items())


def test_wilcoxon_and_headline_verdicts(synthetic):
    _, res = synthetic
    w = res.wilcoxon[(res.wilcoxon.split == "by_model") & (res.wilcoxon.phase == "all")
                     & (res.wilcoxon.pair == "additive vs max")].iloc[0]
    assert w.lower_error == "additive" and w.p_value < 0.01
    assert "`additive`, decode, by_model: MAPE 0.00 % (goal <= 10 %: met" in res.headline
    assert "beats `max` on the same rows: yes" in res.headline
    assert "beats the Vidur-style baseline on the op-profiled rows: yes (0.00 % vs " in res.headline
    t = res.transfer
    assert set(t.method) == {"additive", "max", "additive_rowcal", "rf"} and len(t[(t.method == "rf") & (t.phase == "all")]) == 2


def test_without_scikit_learn_the_forest_is_left_out_and_the_headline_says_so(monkeypatch):
    """scikit-learn is an optional extra: without it every other method is scored the same and the
    headline names the baseline that did not run (the absence is simulated; the real import path is
    the fixture's run above)."""
    import predictor.evaluate as evaluate

    df = _synthetic_rows()
    monkeypatch.setattr(evaluate, "forest_available", lambda: False)
    res = evaluate_rows(df, sku="cpu", calibration=None)
    assert "rf" not in set(res.metrics.method) and "rf" not in set(res.transfer.method)
    assert {"additive", "max", "vidur"} <= set(res.metrics.method)
    assert "scikit-learn is not installed" in res.headline and "gpubench[baselines]" in res.headline


def test_step_form_adds_fitted_host_term():
    base = pd.Series([0.01, 0.02, 0.03])
    df = pd.DataFrame({"num_seqs": [1, 2, 3]})
    f = StepForm("additive", base)
    f.fit(df, base.to_numpy() + 0.001 * df.num_seqs.to_numpy())  # S(N) = 1 ms + 1 ms * (N - 1)
    assert f.predict(df) == pytest.approx(base.to_numpy() + 0.001 * df.num_seqs.to_numpy())


def test_run_evaluation_writes_everything_and_regenerates(tmp_path):
    rows = tmp_path / "rows.parquet"
    _synthetic_rows().to_parquet(rows)
    out = tmp_path / "eval"
    ec = EvalConfig(rows=[str(rows)], out=str(out), sku="cpu")
    run_evaluation(ec)
    for name in ("metrics.csv", "predictions.csv", "wilcoxon.csv", "transfer.csv", "host_residual_fits.csv",
                 "calibration-rowcal.json",
                 "tables.md", "headline.md", "calibration.json", "COMMAND", "pred_vs_measured.png",
                 "error_vs_batch.png"):
        assert (out / name).stat().st_size > 0, name
    cal = json.loads((out / "calibration.json").read_text())
    hr = cal["host_residual"]
    assert hr["tier"] == "measured" and hr["s_floor_ms"]["value"] == pytest.approx(3.0, rel=1e-6)
    from predictor import StepModel  # the written calibration is usable as is
    assert StepModel("cpu", "tiny-llama", calibration=str(out / "calibration.json")).s_floor_s == pytest.approx(3e-3)
    cmd = (out / "COMMAND").read_text().split()
    assert cmd[:2] == ["gpubench", "evaluate"] and str(rows) in cmd
    # The COMMAND file regenerates the same table (through the real CLI, in a subprocess).
    regen = tmp_path / "regen"
    argv = cmd[2:]
    argv[argv.index("--out") + 1] = str(regen)
    res = subprocess.run([sys.executable, "-m", "gpubench", "evaluate", *argv], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    pd.testing.assert_frame_equal(pd.read_csv(out / "metrics.csv"), pd.read_csv(regen / "metrics.csv"))


def test_bad_inputs_are_user_errors(tmp_path):
    with pytest.raises(ResultsFormatError, match="no such rows file"):
        load_rows([tmp_path / "missing.parquet"])
    pd.DataFrame({"key": ["a"], "wall_s": [1.0]}).to_parquet(tmp_path / "x.parquet")
    with pytest.raises(ResultsFormatError, match="missing columns"):
        load_rows([tmp_path / "x.parquet"])
    res = subprocess.run([sys.executable, "-m", "gpubench", "evaluate", str(tmp_path / "x.parquet"), "--out",
                          str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "missing columns" in res.stderr and "Traceback" not in res.stderr


def test_rowcal_calibration_is_the_fitted_form_as_a_step_model():
    """The written calibration-rowcal makes StepModel reproduce additive_rowcal's in-sample predictions."""
    from predictor import StepModel
    from predictor.evaluate import RowCalibrated, rowcal_calibration, step_model_parts

    df = _synthetic_rows()
    # Truth off the spec calibration by known factors, so the fit has something to find.
    parts = step_model_parts(df, sku="cpu", calibration=None)
    truth = RowCalibrated("additive", parts)
    truth.theta = np.array([np.log(0.3), np.log(2.0), np.log(1.5), 2.0, 0.5])
    y = truth.predict(df)
    df = df.assign(wall_s=y)
    cal = rowcal_calibration(df, parts, sku="cpu", calibration=None, target="wall_s", rows=["synthetic"])
    assert cal["host_residual"]["tier"] == "measured" and cal["host_residual"]["fit_error"] < 1e-6
    for model, g in df.groupby("model"):
        sm = StepModel("cpu", model, calibration=cal, dtype="fp32")
        got = sm.predict_many([[tuple(x) for x in json.loads(b)] for b in g.batch_json])
        np.testing.assert_allclose(got, g.wall_s.to_numpy(), rtol=1e-6)


def test_sku_must_match_the_rows_backend():
    from common.errors import ConfigError

    df = pd.DataFrame({"device_type": ["cpu"], "wall_s": [1.0], "op_sum_s": [np.nan]})
    with pytest.raises(ConfigError, match="--sku h100-sxm is a cuda SKU"):
        evaluate_rows(df, sku="h100-sxm", calibration=None)


def test_cli_evaluate_json(tmp_path):
    rows = tmp_path / "rows.parquet"
    df = _synthetic_rows()
    df.to_parquet(rows)
    out = tmp_path / "eval"
    res = subprocess.run([sys.executable, "-m", "gpubench", "evaluate", str(rows), "--sku", "cpu", "--out", str(out),
                          "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["out_dir"] == str(out) and doc["num_rows"] == df.key.nunique()
    assert {str(out / n) for n in ("metrics.csv", "calibration.json", "COMMAND", "pred_vs_measured.png")} <= set(doc["files"])
    met = pd.read_csv(out / "metrics.csv")
    want = met[(met.fold == "pooled") & (met.split == "in_sample") & (met.method == "additive") & (met.phase == "all")]
    if "rows" in met:
        want = want[want.rows == "all"]
    assert doc["mape_pct"]["in_sample"]["additive"]["all"] == pytest.approx(float(want.mape_pct.iloc[0]))
