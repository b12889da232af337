"""score-kernels on the committed H200 measurements (real kernels, timed on an H200 by
scripts/device_check.sh), and the H200 calibration fitted from the two committed probe runs."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from gpubench.cli import main
from predictor.calibrate import Calibration, fit_run
from predictor.step import StepModel

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "results" / "h200"
RUNS = [H200 / "20261204T122331Z-vm", H200 / "20261204T123451Z-vm"]
ROWS = sorted((H200 / "steps").glob("gpu-*.parquet"))
COMMITTED = ROOT / "results" / "h200" / "kernels"


def test_the_committed_h200_calibration_is_the_fit_of_its_two_runs(monkeypatch):
    """stream and l2 from the second run (they crashed on the first machine), the rest from the first."""
    monkeypatch.chdir(ROOT)
    committed = Calibration.load(H200 / "calibration.json")
    cal = fit_run([str(r.relative_to(ROOT)) for r in RUNS])
    for name, p in committed.params.items():
        assert cal.params[name].value == pytest.approx(p.value, rel=1e-12), name
        assert cal.params[name].tier == p.tier, name
    assert {n for n, p in cal.params.items() if p.tier == "measured"} >= {
        "eta_max", "x_half", "eta_active", "eta_duty", "f_clk", "t_launch_s", "t_graph_node_s"}
    assert committed.meta["run_dirs"] == [str(r.relative_to(ROOT)) for r in RUNS]


def test_the_committed_kernel_score_regenerates(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the committed COMMAND names paths relative to the checkout
    out = tmp_path / "k"
    args = [str(p.relative_to(ROOT)) for p in ROWS]
    assert main(["score-kernels", *args, "--sku", "h200", "--calibration", "results/h200/calibration.json",
                 "--out", str(out)]) == 0
    got, want = pd.read_csv(out / "summary.csv"), pd.read_csv(COMMITTED / "summary.csv")
    pd.testing.assert_frame_equal(got, want, rtol=1e-9)
    assert {p.name for p in out.iterdir()} >= {"kernels.csv", "summary.csv", "kernels.md", "kernels.png", "COMMAND"}
    capsys.readouterr()
    assert main(["score-kernels", *args, "--sku", "h200", "--calibration", "results/h200/calibration.json",
                 "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_rows"] == 40 and set(doc["mape_pct"]) == {"linear", "attention", "kernels"}
    assert doc["mape_pct_by_model"]["linear"]["llama-3.1-8b"] == pytest.approx(
        float(want[(want.kind == "linear") & (want.model == "llama-3.1-8b")]["mape_pct"].iloc[0]))
    # what the committed figures say: the two Llama-shaped 7-8B models' GEMMs within 5 % of their kernels
    lin = want[(want.kind == "linear") & (want.phase == "all")].set_index("model")
    assert lin.loc["llama-3.1-8b", "mape_pct"] < 5 and lin.loc["mistral-7b", "mape_pct"] < 5


def test_a_scored_row_is_the_step_models_own_prediction(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rows = pd.read_csv(COMMITTED / "kernels.csv")
    steps = pd.read_parquet(H200 / "steps" / "gpu-llama-3.1-8b.parquet").set_index("key")
    model = StepModel("h200", "llama-3.1-8b", calibration="results/h200/calibration.json")
    for r in rows[rows.model == "llama-3.1-8b"].itertuples():
        step = steps.loc[r.key]
        pred = model.predict([tuple(s) for s in json.loads(step.batch_json)])
        # the loop runs 7 projection kernels per layer (q, k, v, o, gate, up, down) + lm_head where the
        # model's graph has a serving engine's fused 4 + 1: 3 more fixed GEMM times per layer
        model_kernels = sum(op.num_kernels for op in pred.ops.values() if op.kind == "gemm")
        assert model_kernels == 4 * 32 + 1
        separate = 3 * 32 * model.t_gemm_fixed_s
        if r.kind == "kernels":
            assert r.measured_s == pytest.approx(step.op_sum_s)
            assert r.predicted_s == pytest.approx(pred.blocks_s + pred.sample_s + separate)
        elif r.kind == "linear":
            assert r.measured_s == pytest.approx(json.loads(step.ops_json)["linear"])
            assert r.predicted_s == pytest.approx(sum(op.t_s for op in pred.ops.values() if op.kind == "gemm") + separate)


def test_bad_input_is_one_line(tmp_path, capsys):
    unprofiled = tmp_path / "unprofiled.parquet"
    df = pd.read_parquet(ROWS[0])
    df.assign(ops_profiled=False).to_parquet(unprofiled)
    cpu_rows = ROOT / "results" / "steps" / "cpu-llama-60m.parquet"
    for args, msg in (([str(cpu_rows), "--sku", "h200"], "needs GPU step rows"),
                      ([str(ROWS[0]), "--sku", "cpu"], "scores GPU kernel times"),
                      ([str(unprofiled), "--sku", "h200"], "--ops-subset"),
                      ([str(tmp_path / "none.parquet"), "--sku", "h200"], "no such rows file"),
                      ([str(ROWS[0]), "--sku", "h2000"], "unknown SKU")):
        assert main(["score-kernels", *args, "--out", str(tmp_path / "o")]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err and "Traceback" not in err, err
    assert not (tmp_path / "o" / "summary.csv").exists()


def test_the_h200_gemm_fixed_time_is_the_probes_intercept_and_every_path_charges_it(monkeypatch):
    """t_gemm_fixed_s is the intercept of the gemm rows' time against bytes at M = 1 (measured, so
    only a measured calibration charges it; a calibration without it charges none); the scalar,
    vectorized and breakdown paths agree, and each adds exactly one fixed time per GEMM kernel."""
    import numpy as np

    from gpubench import results
    from predictor.calibrate_compute import fit_gemm_fixed
    from predictor.calibration_model import Calibration as Cal
    from predictor.hardware import HardwareSpec
    from predictor.ops import batch_features

    monkeypatch.chdir(ROOT)
    run = results.load(RUNS[0])
    gemm = run.frames["gemm"]
    at1 = gemm[(gemm.dtype == "bf16") & (gemm.m == 1)]
    slope, intercept = np.polyfit(at1["bytes"], at1["t_median_s"], 1)
    fixed = fit_gemm_fixed(run, HardwareSpec.from_sku("h200"), "bf16")
    assert fixed.tier == "measured" and fixed.value == pytest.approx(intercept) and 2e-6 < fixed.value < 10e-6
    assert fit_gemm_fixed(run, HardwareSpec.from_sku("cpu"), "bf16") is None  # the CPU keeps its memory law

    cal = Calibration.load(H200 / "calibration.json")
    assert cal.params["t_gemm_fixed_s"].value == pytest.approx(fixed.value)
    with_fixed = StepModel("h200", "llama-3.1-8b", calibration=cal)
    doc = cal.to_dict()
    del doc["params"]["t_gemm_fixed_s"]
    without = StepModel("h200", "llama-3.1-8b", calibration=Cal.from_dict(doc))
    assert without.t_gemm_fixed_s == 0.0
    for batch in ([(1, 64)], [(1, 1024)] * 16, [(1, 512)] * 7 + [(64, 256)], [(1024, 0)] * 4):
        p = with_fixed.predict(batch)
        assert with_fixed.predict_time(batch) == pytest.approx(p.total_s, rel=1e-12)
        assert without.predict_time(batch) == pytest.approx(without.predict(batch).total_s, rel=1e-12)
        if all(n == 1 for n, _ in batch):
            vec = with_fixed.predict_features(batch_features(batch)[None, :])[0]
            assert vec == pytest.approx(p.total_s, rel=1e-9)
    # the scalar path's fixed part alone: same calibration, curve untouched, fixed time doubled
    doc2 = cal.to_dict()
    doc2["params"]["t_gemm_fixed_s"]["value"] *= 2
    doubled = StepModel("h200", "llama-3.1-8b", calibration=Cal.from_dict(doc2))
    p1, p2 = with_fixed.predict([(1, 128)] * 4), doubled.predict([(1, 128)] * 4)
    kernels = sum(op.num_kernels for op in p1.ops.values() if op.kind == "gemm")
    assert doubled.predict_time([(1, 128)] * 4) - with_fixed.predict_time([(1, 128)] * 4) == pytest.approx(
        kernels * fixed.value, rel=1e-9)
    assert p2.total_s - p1.total_s == pytest.approx(kernels * fixed.value, rel=1e-9)


def test_rows_of_another_gpu_than_the_sku_are_scored_with_a_warning(tmp_path, capsys):
    assert main(["score-kernels", str(ROWS[0]), "--sku", "h100", "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: --sku h100") and "NVIDIA H200" in err
    assert main(["score-kernels", str(ROWS[0]), "--sku", "h200", "--out", str(tmp_path / "p")]) == 0
    assert capsys.readouterr().err == ""


def test_force_calibration_uses_another_skus_efficiencies_on_the_targets_device(tmp_path, capsys):
    """--force-calibration with the H200 calibration on an H100: a warning, then the H200's fitted
    efficiencies with the H100's own SMs and L2 (the device figures the H200 run read stay with it);
    without --force one line and exit 2, and never across backends."""
    from predictor.calibration_model import retarget

    cal_path = str(H200 / "calibration.json")
    base = ["predict", "--sku", "h100", "--calibration", cal_path, "--model", "llama-3.1-8b", "--batch", "4",
            "--context", "1024", "--engine", "torch", "--json"]
    assert main(base) == 2
    assert "--force-calibration" in capsys.readouterr().err
    assert main([*base, "--force-calibration"]) == 0
    io = capsys.readouterr()
    assert io.err.startswith("warning: the calibration is for SKU 'h200', not 'h100-sxm' (forced)")
    cal = retarget(Calibration.load(cal_path), "h100-sxm")
    model = StepModel("h100-sxm", "llama-3.1-8b", calibration=cal)
    assert json.loads(io.out)["total_s"] == pytest.approx(model.predict([(1, 1024)] * 4).total_s)
    assert model.hardware.l2_bytes == StepModel("h100-sxm", "llama-3.1-8b").hardware.l2_bytes != 62914560
    assert model.t_gemm_fixed_s == pytest.approx(Calibration.load(cal_path).params["t_gemm_fixed_s"].value)
    assert main(["predict", "--sku", "cpu", "--calibration", cal_path, "--force-calibration"]) == 2
    assert "cannot describe the cpu SKU" in capsys.readouterr().err
    out = tmp_path / "k"
    assert main(["score-kernels", str(ROWS[0]), "--sku", "h100", "--calibration", cal_path, "--force-calibration",
                 "--out", str(out)]) == 0
    assert "--force-calibration" in (out / "COMMAND").read_text().splitlines()[0]


def test_breakdown_with_async_scheduling_totals_the_headline_and_shows_the_fixed_time(capsys, monkeypatch):
    """`predict --breakdown --async-scheduling`: the total row is the headline (max of device and
    host), not the synchronous sum; the host row says it overlaps; the fixed GEMM time has its own
    column; a batch-1 GEMV, which streams its weights, is memory bound whatever its calibrated t_c."""
    import re

    from predictor.cli import breakdown_rows

    monkeypatch.chdir(ROOT)
    cal = "results/h200/calibration.json"
    assert main(["predict", "--calibration", cal, "--model", "llama-3.1-8b", "--batch", "1", "--context", "1024",
                 "--cuda-graphs", "--async-scheduling", "--breakdown"]) == 0
    out = capsys.readouterr().out
    headline_ms = float(re.search(r": ([0-9.]+) ms \[additive, async\]", out).group(1))
    total_row = next(line for line in out.splitlines() if "total = max(device, host)" in line)
    assert float(total_row.split("│")[-4]) == pytest.approx(headline_ms, abs=1e-3)
    assert "overlapped" in next(line for line in out.splitlines() if "host residual" in line)

    model = StepModel.for_names(sku="h200", model="llama-3.1-8b", calibration=cal, cuda_graphs=True)
    batch = [(1, 1024)]
    pred = model.predict(batch)
    total_async = model.predict_time(batch, async_scheduling=True)
    assert total_async < pred.total_s  # the host overlaps: the two totals differ, so the check means something
    cols, rows = breakdown_rows(pred, total_async, overlap=True)
    assert rows[-1][cols.index("t ms")] == f"{total_async * 1e3:.4f}"
    gemms = [op for op in pred.ops.values() if op.kind == "gemm"]
    assert all(op.bound == "memory" for op in gemms)
    assert any(op.t_c_s > op.t_m_s for op in gemms)  # what the old label read as "compute bound"
    assert sum(op.t_fixed_s for op in gemms) == pytest.approx(
        model.t_gemm_fixed_s * sum(op.num_kernels for op in gemms))
    # synchronous: the rows sum to the total
    cols, rows = breakdown_rows(pred, pred.total_s, overlap=False)
    t = [float(r[cols.index("t ms")]) for r in rows[:-1]]
    assert sum(t) == pytest.approx(pred.total_s * 1e3, rel=1e-4)
    assert pred.total_s > total_async
    # prefill of 8K tokens is compute bound, op by op and as a whole, but for the LM head, which
    # projects only the sequence's last token (M = 1)
    prefill = model.predict([(8192, 0)])
    assert prefill.bound == "compute" and prefill.ops["lm_head"].bound == "memory"
    assert all(op.bound == "compute" for op in prefill.ops.values() if op.kind == "gemm" and op.name != "lm_head")


def test_evaluate_takes_a_forced_calibration_of_another_gpu(tmp_path, capsys):
    """`evaluate --force-calibration` across GPU SKUs scores with the retargeted calibration (it
    warned "(forced)" and then exited 2, as predict did before calibration_for)."""
    rows = str(H200 / "steps" / "gpu-qwen2.5-0.5b.parquet")
    cal = str(H200 / "calibration.json")
    base = ["evaluate", rows, "--calibration", cal, "--sku", "h100"]
    assert main([*base, "--out", str(tmp_path / "refused")]) == 2
    assert "pass --force-calibration" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    assert main([*base, "--force-calibration", "--out", str(tmp_path / "forced")]) == 0
    assert "(forced)" in capsys.readouterr().err
    assert "--force-calibration" in (tmp_path / "forced" / "COMMAND").read_text().splitlines()[0]
    written = Calibration.load(tmp_path / "forced" / "calibration.json")
    assert written.sku == "h100-sxm"  # the retargeted calibration, with its fitted efficiencies
    assert written.params["t_gemm_fixed_s"].value == pytest.approx(Calibration.load(cal).params["t_gemm_fixed_s"].value)
