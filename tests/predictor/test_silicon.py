"""gpubench silicon: the measured tables of the installed aiconfigurator-core wheel, the GEMM grid's
interpolation, and the step model's kernel prices scored against them through the CLI."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from common.errors import ConfigError
from predictor import silicon_tables as st
from predictor.silicon_match import GemmGrid, bracket_ratio
from tests.gpubench.conftest import run_cli


def _affine_grid() -> GemmGrid:
    """A table whose time is exactly affine in N and in K at each M: interpolation must be exact."""
    rows = [(m, n, k, 1e-6 * (3 + 0.002 * n + 0.001 * k + 0.0005 * m))
            for m in (1, 16, 128) for n in (1024, 2048, 4096, 8192) for k in (1024, 4096, 16384)]
    return GemmGrid(pd.DataFrame(rows, columns=["m", "n", "k", "latency_s"]))


def test_gemm_grid_exact_interpolated_and_outside():
    grid = _affine_grid()
    t, how = grid.lookup(16, 2048, 4096)
    assert how == "exact" and t == pytest.approx(1e-6 * (3 + 4.096 + 4.096 + 0.008))
    for (n, k), expected_how in {(3000, 4096): "interp-n", (2048, 10000): "interp-k", (6000, 2000): "interp-nk"}.items():
        t, how = grid.lookup(128, n, k)
        assert how == expected_how
        assert t == pytest.approx(1e-6 * (3 + 0.002 * n + 0.001 * k + 0.064))
    assert grid.lookup(17, 2048, 4096) is None  # M is never interpolated
    assert grid.lookup(16, 16384, 4096) is None  # outside the N grid
    assert bracket_ratio(grid.n_grid, 3000) == 2.0 and bracket_ratio(grid.n_grid, 4096) == 1.0


def test_interpolation_check_is_exact_on_an_affine_table_and_not_on_a_curved_one():
    check = _affine_grid().interpolation_check()
    assert len(check) and check["signed_pct"].abs().max() < 1e-9
    curved = GemmGrid(pd.DataFrame([(1, n, 1024, 1e-9 * n ** 1.5) for n in (1024, 2048, 4096)],
                                   columns=["m", "n", "k", "latency_s"]))
    err = curved.interpolation_check()
    assert len(err) == 1 and err["signed_pct"].iloc[0] > 1  # the check can fail


def test_the_wheels_tables_read_as_published():
    """Spot values published with the tables: H200 bf16 GEMM 4096x6144x4096 reads 0.248 ms; FA3 decode
    batch 32, 32 q / 8 KV heads of 128, step 1023 reads 0.0468 ms."""
    ts = st.table_set("h200_sxm", "vllm")
    assert ts.sku == "h200" and ts.version == "0.24.0"
    gemm = st.read_gemm(ts)
    t = gemm[(gemm.m == 4096) & (gemm.n == 6144) & (gemm.k == 4096)]["latency_s"]
    assert len(t) == 1 and t.iloc[0] == pytest.approx(0.248e-3, rel=0.01)
    decode, source = st.read_attention(ts.decode)
    assert source == "vllm_flash_attn_fa3"
    row = decode[(decode.batch_size == 32) & (decode.num_heads == 32) & (decode.num_key_value_heads == 8)
                 & (decode.head_dim == 128) & (decode.step == 1023)]
    assert len(row) == 1 and row["latency_s"].iloc[0] == pytest.approx(0.0468e-3, rel=0.02)
    prefill, psource = st.read_attention(st.table_set("b200_sxm").prefill)
    assert psource == "vllm_flashinfer_trtllmprefill" and (prefill["step"] == 0).all()


def test_no_wheel_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setattr(st.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"gpubench\[reference\]"):
        st.data_root()


def test_op_call_times_agree_with_predicts_breakdown():
    """The per-kernel price silicon scores is the op time predict() reports, per call."""
    from predictor.ops import batch_features
    from predictor.step import StepModel

    sm = StepModel("h200", "llama-3.1-8b", cuda_graphs=True)
    batch = [(1, 700)] * 48
    pred = sm.predict(batch)
    per_call = sm.op_call_times(batch_features(batch)[None, :])[0]
    for name in ("qkv_proj", "gate_up", "down", "lm_head"):
        assert per_call[sm.graph.names.index(name)] == pytest.approx(pred.ops[name].t_s / pred.ops[name].num_calls)
    assert sm.attention_call_time(batch) == pytest.approx(pred.ops["attention"].t_s / sm.model.num_layers)


def test_silicon_cli_scores_h200_and_writes_its_files(tmp_path):
    out = tmp_path / "sil"
    proc = run_cli("silicon", "--systems", "h200_sxm", "--out", str(out), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    kinds = {s["kind"]: s for s in doc["scores"] if s["predictor"] == "default"}
    assert set(kinds) == {"gemm", "decode_attention", "prefill_attention"}
    assert all(s["n"] > 100 and np.isfinite(s["mape_pct"]) for s in kinds.values())
    for name in ("silicon.csv.gz", "summary.csv", "interpolation.csv", "steps.csv", "silicon.md", "h200_sxm.png", "COMMAND"):
        assert (out / name).is_file(), name
    rows = pd.read_csv(out / "silicon.csv.gz")
    # a GEMM row's price is the model's own: recompute one from StepModel
    from predictor.step import StepModel

    r = rows[(rows.kind == "gemm") & (rows.op == "down") & (rows.n == 4096) & (rows.k == 14336) & (rows.m == 64)].iloc[0]
    assert r["match"] == "interp-k"  # 14336 lies between 12288 and 16384
    sm = StepModel("h200", "llama-3.1-8b", cuda_graphs=True)
    assert r["predicted_op_s"] == pytest.approx(sm.predict([(1, 0)] * 64).ops["down"].t_s / 32, rel=1e-5)
    assert "gpubench silicon --systems h200_sxm" in (out / "COMMAND").read_text()
    interp = pd.read_csv(out / "interpolation.csv")
    assert set(interp["direction"]) == {"n", "k"} and (interp["mape_pct"] < 15).all()


@pytest.mark.parametrize("args, message", [
    (["--systems", "b60"], "no gpubench SKU"),
    (["--systems", "nope"], "no measured tables for 'nope'"),
    ([], "--out is required"),
    (["--calibration", "results/eval/cpu/calibration-probes.json"], "a CPU calibration cannot price GPU kernels"),
])
def test_silicon_bad_input_is_one_line(tmp_path, args, message):
    extra = ["--out", str(tmp_path / "o")] if args else []
    proc = run_cli("silicon", *args, *extra, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o").exists()


def test_silicon_list_names_every_system():
    proc = run_cli("silicon", "--list", timeout=120)
    assert proc.returncode == 0, proc.stderr
    for system in ("h200_sxm", "b300_sxm", "l40s"):
        assert system in proc.stdout
    assert "sku=h200" in proc.stdout


def test_a_composed_decode_step_is_the_sum_of_its_measured_kernels_and_the_models_price():
    from predictor.silicon_score import Predictor, score_tables
    from predictor.silicon_steps import LAYER_GEMMS
    from predictor.step import StepModel

    ts = st.table_set("h100_sxm")
    steps = score_tables([ts], [Predictor("default")]).steps
    row = steps[(steps.model == "llama-3.1-8b") & (steps.batch == 32) & (steps.context == 1024)].iloc[0]
    grid = GemmGrid(st.read_gemm(ts))
    decode, _ = st.read_attention(ts.decode)
    attn = decode[(decode.batch_size == 32) & (decode.step == 1023) & (decode.num_heads == 32)
                  & (decode.num_key_value_heads == 8) & (decode.head_dim == 128)]["latency_s"].iloc[0]
    shapes = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    gemm = sum(grid.lookup(32, n, k)[0] for n, k in shapes.values())
    assert row["measured_s"] == pytest.approx(32 * (gemm + attn))
    sm = StepModel("h100-sxm", "llama-3.1-8b", cuda_graphs=True)
    pred = sm.predict([(1, 1023)] * 32)
    per_layer = sum(pred.ops[op].t_s for op in (*LAYER_GEMMS, "attention")) / 32 + 5 * sm.t_launch_s
    assert row["predicted_s"] == pytest.approx(32 * per_layer)
    assert "qwen2.5-7b" not in set(steps.model)  # 28 query heads: not in the attention table, so skipped
    # a mixed step: 256 decodes at 1024 and a 512-token chunk; GEMMs at M = 768, two attention kernels
    mixed = steps[(steps.model == "llama-3.1-8b") & (steps.step == "mixed") & (steps.batch == 256)
                  & (steps.chunk == 512) & (steps.context == 1024)].iloc[0]
    prefill, _ = st.read_attention(ts.prefill)
    heads = (decode.num_heads == 32) & (decode.num_key_value_heads == 8) & (decode.head_dim == 128)
    dec = decode[heads & (decode.batch_size == 256) & (decode.step == 1023)]["latency_s"].iloc[0]
    pre = prefill[(prefill.num_heads == 32) & (prefill.num_key_value_heads == 8) & (prefill.head_dim == 128)
                  & (prefill.batch_size == 1) & (prefill.isl == 512) & (prefill.step == 0)]["latency_s"].iloc[0]
    gemm = sum(grid.lookup(768, n, k)[0] for n, k in shapes.values())
    assert mixed["measured_s"] == pytest.approx(32 * (gemm + dec + pre))
    batch = [(1, 1023)] * 256
    ops = sm.predict(batch + [(512, 0)]).ops
    layer = sum(ops[op].t_s for op in LAYER_GEMMS) / 32 + sm.attention_call_time(batch) + sm.attention_call_time([(512, 0)])
    assert mixed["predicted_s"] == pytest.approx(32 * (layer + 6 * sm.t_launch_s))


@pytest.mark.parametrize("framework", ["vllm", "sglang", "trtllm"])
def test_the_committed_silicon_scores_regenerate(tmp_path, framework):
    """results/silicon/<framework>/summary.csv and steps.csv come back from the first line of its COMMAND
    (no timing is involved: the same wheel gives the same figures on any host)."""
    import shlex
    from pathlib import Path

    committed = Path(__file__).resolve().parents[2] / "results" / "silicon" / framework
    args = shlex.split((committed / "COMMAND").read_text().splitlines()[0])[1:]
    args[args.index("--out") + 1] = str(tmp_path / "again")
    proc = run_cli(*args, timeout=600, cwd=str(committed.parents[2]))
    assert proc.returncode == 0, proc.stderr
    for name in ("summary.csv", "steps.csv"):
        again, before = pd.read_csv(tmp_path / "again" / name), pd.read_csv(committed / name)
        # percentages near 0 carry the last bits of the float sums (an AVX2 host and an AVX-512 one part
        # at 0.2104 vs 0.2107 %): to 0.01 percentage points; every other column to 1e-3 relative
        pct = [c for c in before.columns if c.endswith("_pct")]
        pd.testing.assert_frame_equal(again.drop(columns=pct), before.drop(columns=pct), check_exact=False, rtol=1e-3)
        pd.testing.assert_frame_equal(again[pct], before[pct], check_exact=False, rtol=1e-3, atol=0.01)


def test_learned_baseline_is_in_sample_on_its_source_and_spec_scaled_elsewhere():
    from predictor.silicon_learned import LearnedBaseline, add_learned
    from predictor.silicon_score import Predictor, score_tables

    learned = LearnedBaseline(st.table_set("h100_sxm"))
    ts = st.table_set("h100_sxm")
    gemm = st.read_gemm(ts)
    row = gemm[(gemm.m == 64) & (gemm.n == 4096) & (gemm.k == 4096)].iloc[0]
    on_source = learned.gemm("h100-sxm", [64], [4096], [4096])[0]
    assert on_source == pytest.approx(row["latency_s"], rel=0.15)  # a forest reproduces its training rows
    # carried to the H200, a memory-bound GEMV scales by the spec bandwidths (3.35 -> 4.8 TB/s)
    gemv_h100, gemv_h200 = learned.gemm("h100-sxm", [1], [8192], [8192])[0], learned.gemm("h200", [1], [8192], [8192])[0]
    assert gemv_h200 / gemv_h100 == pytest.approx(3350 / 4800, rel=1e-6)
    score = score_tables([st.table_set("h200_sxm")], [Predictor("default")])
    n = len(score.rows)
    add_learned(score, learned)
    mine = score.rows[score.rows["predictor"] == "learned (h100_sxm forest)"]
    assert len(mine) == n and mine["predicted_s"].notna().all()
    assert set(score.steps["predictor"]) == {"default", "learned (h100_sxm forest)"}


def test_learned_from_a_system_without_a_sku_is_one_line(tmp_path):
    proc = run_cli("silicon", "--systems", "h200_sxm", "--learned-from", "b60", "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 2 and "no gpubench SKU" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_rerun_replaces_the_earlier_runs_files_and_an_interrupted_write_leaves_no_half(tmp_path, monkeypatch):
    from predictor import silicon_report
    from predictor.silicon_score import Predictor, score_tables

    out = tmp_path / "s"
    both = score_tables([st.table_set("h200_sxm"), st.table_set("l40s")], [Predictor("default")])
    silicon_report.write(both, str(out), "gpubench silicon --out s", wheel="test")
    assert {p.name for p in out.glob("*.png")} == {"h200_sxm.png", "l40s.png"}
    one = score_tables([st.table_set("l40s")], [Predictor("default")])
    silicon_report.write(one, str(out), "gpubench silicon --systems l40s --out s", wheel="test")
    assert {p.name for p in out.glob("*.png")} == {"l40s.png"}  # no plot of a GPU this run did not score
    before = (out / "silicon.md").read_text()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(silicon_report, "plot_system", interrupted)
    with pytest.raises(KeyboardInterrupt):
        silicon_report.write(both, str(out), "gpubench silicon --out s", wheel="test")
    assert (out / "silicon.md").read_text() == before  # the earlier result stands whole
    monkeypatch.undo()
    silicon_report.write(one, str(out), "gpubench silicon --systems l40s --out s", wheel="test")
    assert not (out / silicon_report.STAGE).exists()


def test_silicon_list_json_and_steps_in_json(tmp_path):
    proc = run_cli("silicon", "--list", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {"system": "h200_sxm", "sku": "h200"}.items() <= next(r for r in doc["systems"] if r["system"] == "h200_sxm").items()
    (tmp_path / "afile").write_text("x")
    bad = run_cli("silicon", "--systems", "h200_sxm", "--out", str(tmp_path / "afile"), timeout=120)
    assert bad.returncode == 2 and "not a directory" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_aiconfigurators_own_step_estimates_sit_beside_the_composed_steps():
    """Its SILICON mode looks up the very tables the measured step is summed from (within a few % where it
    interpolates); its SOL mode reads no table and prices below the measured kernels (no efficiency loss);
    Mistral, an architecture it does not model, gets no row; its whole step is never less than the same kernels."""
    from predictor.silicon_aic import add_aiconfigurator
    from predictor.silicon_score import Predictor, score_tables

    score = score_tables([st.table_set("h200_sxm")], [Predictor("default")])
    n = int((score.steps.step == "decode").sum())  # its estimates sit beside the decode steps
    add_aiconfigurator(score)
    steps = score.steps
    aic, sol = steps[steps.predictor == "aiconfigurator"], steps[steps.predictor == "aiconfigurator SOL"]
    mistral = (steps.predictor == "default") & (steps.model == "mistral-7b") & (steps.step == "decode")
    assert len(aic) == len(sol) == n - int(mistral.sum()) > 100
    assert aic["ape_pct"].mean() < 3 and (sol["signed_pct"] < 0).all()
    assert (aic["aic_step_s"] >= aic["predicted_s"]).all()
    cell = aic[(aic.model == "llama-3.1-8b") & (aic.batch == 16) & (aic.context == 4096)].iloc[0]
    assert cell["predicted_s"] == pytest.approx(cell["measured_s"], rel=0.03)


def test_the_new_skus_price_the_blackwell_tables_they_map_to():
    assert {st.SYSTEM_SKUS[s] for s in ("b300_sxm", "gb200", "gb300", "rtx_pro_6000_server")} == \
        {"b300", "gb200", "gb300", "rtx-pro-6000"}
    from gpubench import skus

    assert skus.detect("NVIDIA GB200").id == "gb200" and skus.detect("NVIDIA B300 SXM6 AC").id == "b300"
    assert skus.detect("NVIDIA RTX PRO 6000 Blackwell Server Edition").id == "rtx-pro-6000"
    assert skus.get("gb300").peak_flops("bf16") == pytest.approx(2.5e15, rel=1e-3)
