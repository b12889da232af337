"""gpubench fit --from-silicon: a GPU calibration from one system's measured kernel tables, and the two
attention parameters it brings to the step model."""
from __future__ import annotations

import json

import pytest

from predictor import silicon_tables as st
from predictor.calibration_model import Calibration, Param
from predictor.silicon_fit import fit_from_silicon
from tests.gpubench.conftest import run_cli


@pytest.fixture(scope="module")
def h100_fit() -> Calibration:
    return fit_from_silicon(st.table_set("h100_sxm", "vllm"))


def test_the_fit_gives_plausible_measured_parameters(h100_fit):
    p = h100_fit.params
    assert {"t_gemm_fixed_s", "eta_max", "eta_duty", "t_attn_fixed_s", "eta_attn"} <= set(p)
    assert all(p[k].tier == "measured" and "h100_sxm/vllm" in p[k].source for k in p)
    assert 0.6 < p["eta_max"].value < 1.0  # HBM3 streams at 60-100 % of its 3.35 TB/s
    assert 0 < p["t_gemm_fixed_s"].value < 10e-6 and 3e-6 < p["t_attn_fixed_s"].value < 30e-6
    assert 0.1 < p["eta_attn"].value < 1.5
    assert h100_fit.curve("eta_duty_by_m", "bf16") is not None
    assert h100_fit.meta["from"].startswith("silicon")


def test_the_fit_reproduces_the_steps_of_the_gpu_it_was_fitted_on(h100_fit):
    """In-sample, decode steps composed from the H100's measured kernels come back within 10 % (a check
    that can fail: the default pricing misses them by ~14 %)."""
    from predictor.silicon_score import Predictor, score_tables

    steps = score_tables([st.table_set("h100_sxm")], [Predictor("fit", calibration=h100_fit), Predictor("default")]).steps
    mape = steps.groupby("predictor")["ape_pct"].mean()
    assert mape["fit"] < 10 < mape["default"]


def test_attention_parameters_change_only_attention_and_both_paths_agree(h100_fit):
    from predictor.step import StepModel

    base = StepModel("h100-sxm", "llama-3.1-8b", cuda_graphs=True)
    cal = Calibration(sku="h100-sxm", backend="cuda", dtype="bf16",
                      params={"t_attn_fixed_s": Param(5e-6, None, "measured", "test"),
                              "eta_attn": Param(0.5, None, "measured", "test")})
    sm = StepModel("h100-sxm", "llama-3.1-8b", cuda_graphs=True, calibration=cal)
    decode = [(1, 4)] * 2  # almost no KV to read: the fixed time is the whole difference
    assert sm.attention_call_time(decode) - base.attention_call_time(decode) == pytest.approx(5e-6, rel=1e-3)
    prefill = [(8192, 0)]  # compute bound: half the rate doubles the work time
    assert sm.attention_call_time(prefill) - 5e-6 == pytest.approx(2 * base.attention_call_time(prefill), rel=1e-3)
    for batch in (decode, prefill, [(512, 1024), (1, 300), (1, 2000)]):
        assert sm.predict_time(batch) == pytest.approx(sm.predict(batch).total_s, rel=1e-12)
        gemm = {n: o.t_s for n, o in sm.predict(batch).ops.items() if o.kind == "gemm"}
        assert gemm == {n: o.t_s for n, o in base.predict(batch).ops.items() if o.kind == "gemm"}


def test_fit_from_silicon_cli_writes_a_calibration_predict_uses(tmp_path):
    out = tmp_path / "h200.json"
    proc = run_cli("fit", "--from-silicon", "h200_sxm", "-o", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    cal = Calibration.load(out)
    assert cal.sku == "h200" and "t_attn_fixed_s" in cal.params
    pred = run_cli("predict", "--sku", "h200", "--calibration", str(out), "--batch", "8", "--context", "1024",
                   "--cuda-graphs", "--json", timeout=300)
    assert pred.returncode == 0, pred.stderr
    assert json.loads(pred.stdout)["total_s"] > 0


@pytest.mark.parametrize("args, message", [
    (["--from-silicon", "nope"], "no measured tables for 'nope'"),
    (["--from-silicon", "b300_sxm"], "no gpubench SKU"),
    (["results/h200/20261204T122331Z-vm", "--from-silicon", "h100_sxm"], "not both"),
    ([], "needs a RUN_DIR, or --from-silicon"),
])
def test_fit_from_silicon_bad_input_is_one_line(tmp_path, args, message):
    proc = run_cli("fit", *args, "-o", str(tmp_path / "c.json"), timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "c.json").exists()


def test_the_committed_silicon_fit_regenerates(tmp_path):
    from pathlib import Path

    committed = Path(__file__).resolve().parents[2] / "results" / "silicon" / "fits" / "h100_sxm-vllm.json"
    again = fit_from_silicon(st.table_set("h100_sxm", "vllm"))
    old = Calibration.load(committed)
    assert set(again.params) == set(old.params)
    for name, p in old.params.items():
        assert again.params[name].value == pytest.approx(p.value, rel=1e-9), name
    assert again.curve("eta_duty_by_m", "bf16").value == pytest.approx(old.curve("eta_duty_by_m", "bf16").value)
