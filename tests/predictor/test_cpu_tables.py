"""CPU op tables: the torch_ops probe on tiny sizes (real torch kernels), fitted by the real fit path,
used by StepModel; the interpolation and law fits checked against values computed independently."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from common.errors import ConfigError
from predictor.calibrate import Calibration, fit_run
from predictor.cpu_tables import CpuOpTables, decode_terms
from predictor.cpu_tables_fit import _nnls_relative
from predictor.step import StepModel

TINY = ["torch_ops.size_scale=0.03", "torch_ops.max_m=6", "torch_ops.max_rows=16"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from tests.gpubench.conftest import tiny_probe_run

    run_dir = tiny_probe_run(tmp_path_factory.mktemp("torch_ops"), "torch_ops", TINY, timeout=600)
    rows = [json.loads(line) for line in (run_dir / "torch_ops.jsonl").read_text().splitlines()]
    return run_dir, pd.DataFrame(rows)


def test_probe_rows_are_valid_and_cover_every_family(tiny_run):
    _, rows = tiny_run
    assert rows.valid.all(), rows[~rows.valid][["key", "invalid_reason"]].to_string()
    assert set(rows.family) == {"linear", "attn_decode", "attn_prefill", "segment"}
    assert rows.key.is_unique
    assert (rows.timer == "thread_cpu").all() and (rows.num_threads == 1).all()
    streaming = rows[rows.family.isin(["linear", "attn_decode"])]
    assert streaming.ref_times_s.map(len).min() >= 5  # the reference GEMV timed next to each row
    seg = rows[rows.family == "segment"]
    assert set(seg.segment) == {"rmsnorm", "residual_add", "silu_mul", "rope", "kv_write", "embed", "argmax"}
    # T = 1 after several contexts, including none at all
    assert (seg[seg.rows == 1].groupby(["segment", "width"]).context_elements.nunique() >= 3).all()
    assert (seg[seg.rows == 1].context_elements == 0).any()
    lin = rows[rows.family == "linear"]
    assert (lin.flops == 2 * lin.m * lin.n * lin.k).all()


def test_fit_writes_tables_that_reproduce_the_probe_nodes(tiny_run, tmp_path):
    run_dir, rows = tiny_run
    cal = fit_run(run_dir, argv=["test"], allow_contended=True)
    assert "fp32" in cal.cpu_ops
    path = tmp_path / "cal.json"
    cal.save(path)
    tables = Calibration.load(path).cpu_ops["fp32"]  # round trip through the file
    lin = rows[rows.family == "linear"]
    node = lin.groupby(["k", "n"]).m.count().idxmax()
    k, n = node
    sub = lin[(lin.k == k) & (lin.n == n)]
    assert sub.groupby("m")["pass"].nunique().eq(2).all()  # --quick times every cell in two passes
    ms = sorted(sub.m.unique().tolist())
    curve = tables.linear_curve(int(n), int(k), ms)
    raw = tables.d["linear"]["nodes"]
    stored = next(x for x in raw if x["k"] == k and x["n"] == n)
    # at a grid node, the table is the stored per-element cost times N*K (no smoothing, no envelope)
    assert np.allclose(curve.y, np.array(stored["s_per_element"]) * n * k)
    # past the largest measured M, cost is proportional to M
    past = tables.linear_curve(int(n), int(k), [ms[-1], 4 * ms[-1]])
    assert past.y[1] == pytest.approx(4 * past.y[0])


def test_phase_normalization_uses_the_row_reference_ratio(tiny_run):
    from predictor.cpu_tables_fit import _phase_normalized

    _, rows = tiny_run
    lin = rows[(rows.family == "linear")].copy()
    ref = lin.ref_times_s.map(lambda r: float(np.median(r[1:])))
    got = _phase_normalized(lin)
    expect = lin.t_median_s.to_numpy() * ref.median() / ref.to_numpy()
    assert np.allclose(got, expect)


def test_a_cell_is_the_median_of_its_passes_each_phase_normalized():
    from predictor.cpu_tables_fit import _linear_nodes

    def row(m, t, ref, p):
        return {"k": 64, "n": 32, "m": m, "t_median_s": t, "ref_times_s": [9.0, ref, ref], "pass": p,
                "t_p20_s": t, "t_p80_s": t, "num_threads": 1}
    # M = 2's second pass fell in a slow moment its reference did not see: the other two outvote it
    lin = pd.DataFrame([row(1, 1.0, 1.0, 0), row(2, 1.1, 1.0, 0), row(1, 2.0, 2.0, 1), row(2, 3.0, 1.0, 1),
                        row(1, 1.0, 1.0, 2), row(2, 1.2, 1.0, 2)])
    node = _linear_nodes(lin)["nodes"][0]
    assert node["m"] == [1, 2]
    # the reference median is 1.0: pass 1 of M = 1 (2.0 at a reference of 2.0) normalizes to 1.0
    np.testing.assert_allclose(node["s_per_element"], np.array([1.0, 1.2]) / (64 * 32))


def test_linear_sweeps_rotate_and_keep_the_single_pass_key():
    from gpubench.backends.cpu.probes import torch_ops_grid as grid

    order = grid.linear_sweep((1, 2, 3, 4), 2)
    assert order == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 3), (1, 4), (1, 1), (1, 2)]
    assert [m for p, m in grid.linear_sweep((1, 2, 3), 1)] == [1, 2, 3]
    assert grid.linear_key("torch_linear", "fp32", 256, 512, 4, 0) == "torch_linear_fp32_n256_k512_m4"
    assert grid.linear_key("torch_linear", "fp32", 256, 512, 4, 2) == "torch_linear_fp32_n256_k512_m4_p2"
    with pytest.raises(ConfigError, match="linear_passes must be >= 1"):
        grid.linear_sweep((1, 2), 0)


def test_phase_matched_decode_mape_is_the_prediction_times_the_reference_ratio(tiny_run):
    import numpy as np
    import pandas as pd

    from predictor.evaluate import phase_matched_text

    run_dir, _ = tiny_run
    cal = fit_run(run_dir, argv=["test"], allow_contended=True)
    probe_ref = cal.cpu_ops["fp32"].d["phase_spread"]["reference_median_s"]
    assert probe_ref > 0
    df = pd.DataFrame({"dtype": ["fp32"] * 3, "phase": ["decode", "decode", "prefill"],
                       "wall_s": [1.0, 2.0, 3.0], "ref_gemv_s": [probe_ref * 1.1, probe_ref * 0.5, probe_ref]})
    predicted = pd.Series([1.0, 3.0, 3.0])
    text = phase_matched_text(df, predicted, cal, "wall_s")
    # decode rows: as predicted |1-1|/1 and |3-2|/2 -> 25 %; matched |1.1-1|/1 and |1.5-2|/2 -> 17.5 %
    assert "decode MAPE 17.50 % against 25.00 % as predicted (n = 2" in text
    assert phase_matched_text(df.drop(columns="ref_gemv_s"), predicted, cal, "wall_s") == ""
    assert np.isfinite(probe_ref)
    # a disturbed reference (over 3x the probes') is left out and counted, not taken as a phase
    disturbed = df.assign(ref_gemv_s=[probe_ref * 1.1, probe_ref * 200, probe_ref])
    text = phase_matched_text(disturbed, predicted, cal, "wall_s")
    assert "decode MAPE 10.00 % against 0.00 % as predicted (n = 1, 1 rows whose reference was over 3x off left out" in text


def test_segment_context_delta_interpolates_between_measured_contexts(tiny_run):
    run_dir, rows = tiny_run
    tables = fit_run(run_dir, argv=["test"], allow_contended=True).cpu_ops["fp32"]
    seg = rows[(rows.family == "segment") & (rows.segment == "rmsnorm")]
    w = int(seg.width.min())
    t1 = seg[(seg.width == w) & (seg.rows == 1)].set_index("context_elements").t_median_s
    main_ctx = int(seg[seg.rows > 1].context_elements.max())
    full = tables.segment_curve("rmsnorm", w, [1]).y[0]
    assert full == pytest.approx(t1.loc[main_ctx])
    cold0 = tables.segment_curve("rmsnorm", w, [1], context_bytes=0).y[0]
    # a context never makes a segment dearer than the grid's own (the delta is clipped at 0: at
    # these tiny sizes the hot row can come out a little slower than the cold one)
    assert cold0 == pytest.approx(max(min(t1.loc[0], full), 0.05 * full))
    # the main grid's own context changes nothing
    assert tables.segment_curve("rmsnorm", w, [1], context_bytes=main_ctx * 4).y[0] == pytest.approx(full)


def test_decode_law_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    b = rng.integers(1, 64, 80).astype(float)
    ctx = rng.integers(32, 8192, 80).astype(float)
    h = rng.choice([8, 12, 16, 32], 80).astype(float)
    hkv = h / rng.choice([1, 2, 4], 80)
    d = rng.choice([64, 128], 80).astype(float)
    f = decode_terms(b, b * ctx, h, hkv, d)
    true = np.array([20e-6, 3e-6, 7e-11, 1.5e-9])
    coef, resid = _nnls_relative(f, f @ true)
    assert np.allclose(coef, true, rtol=1e-6) and np.abs(resid).max() < 1e-9


def test_step_model_uses_tables_and_breakdown_sums(tiny_run):
    run_dir, _ = tiny_run
    cal = fit_run(run_dir, argv=["test"], allow_contended=True)
    batch = [(1, 100), (1, 300), (16, 0)]
    tab = StepModel("cpu", "tiny-llama", calibration=cal)
    roof = StepModel("cpu", "tiny-llama", calibration=cal, form="max")
    assert tab.cpu_table is not None and roof.cpu_table is None
    p = tab.predict(batch)
    assert p.form == "cpu_ops"
    assert p.total_s == pytest.approx(sum(o.t_s for o in p.ops.values()))
    assert p.total_s == pytest.approx(tab.predict_time(batch))
    assert tab.predict_many([batch])[0] == pytest.approx(p.total_s)
    fused = StepModel("cpu", "tiny-llama", calibration=cal, gemm_layout="fused")
    assert fused.predict_time(batch) != pytest.approx(p.total_s)
    # the torch engine pads its decode group to the longest sequence; vLLM reads each sequence's own keys
    uneven, even = [(1, 3900), (1, 100)], [(1, 2000), (1, 2000)]
    assert tab.predict_time(uneven) > tab.predict_time(even)
    assert fused.predict_time(uneven) == pytest.approx(fused.predict_time(even))
    assert math.isfinite(p.total_s) and p.total_s > 0
    with pytest.raises(ConfigError, match="layout"):
        StepModel("cpu", "tiny-llama", calibration=cal, gemm_layout="sideways")


def test_malformed_tables_are_one_line_errors(tiny_run):
    run_dir, _ = tiny_run
    d = fit_run(run_dir, argv=["test"], allow_contended=True).to_dict()
    assert isinstance(CpuOpTables.from_dict(d["cpu_ops"]["fp32"], "ok"), CpuOpTables)  # the intact tables load
    del d["cpu_ops"]["fp32"]["segments"]["argmax"]
    with pytest.raises(ConfigError, match="segments lack argmax"):
        Calibration.from_dict(d)
    d["cpu_ops"]["fp32"] = {"linear": 3}
    with pytest.raises(ConfigError, match="cpu_ops.fp32"):
        Calibration.from_dict(d)


COMMITTED_CPU_CAL = "results/eval/cpu/calibration.json"


def test_moe_is_refused_by_the_op_tables_and_qwen3_is_priced():
    from pathlib import Path

    from predictor.hardware import HardwareSpec

    cal = Calibration.load(Path(__file__).resolve().parents[2] / COMMITTED_CPU_CAL)
    hw = HardwareSpec.from_sku("cpu")
    with pytest.raises(ConfigError, match="mixture-of-experts model, which the CPU op tables do not price"):
        StepModel(hw, "mixtral-8x7b", calibration=cal)
    roofline = StepModel(hw, "mixtral-8x7b", calibration=cal, form="max")
    assert roofline.cpu_table is None and roofline.predict_time([(1, 100)]) > 0
    qwen3 = StepModel(hw, "qwen3-0.6b", calibration=cal)
    assert qwen3.cpu_table is not None
    pred = qwen3.predict([(1, 100), (1, 200)])
    assert pred.ops["qk_norm"].t_s > 0
    assert pred.total_s == pytest.approx(sum(o.t_s for o in pred.ops.values()), rel=1e-9)
    assert pred.total_s == pytest.approx(qwen3.predict_time([(1, 100), (1, 200)]), rel=1e-9)
