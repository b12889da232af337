"""The vllm_ops probe: vLLM's real oneDNN linear (prepacked weights) timed in the vLLM environment,
fitted into the calibration's cpu_ops tables as ``linear_vllm`` and used for vLLM's fused layout.

Needs the vLLM reference environment: CI builds it with ``gpubench vllm setup`` before the tests (a CI
run without it is an error); elsewhere the module skips with the set-up command.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest

from gpubench.backends.cpu.probes.vllm_ops import LAYER_DEPTHS
from vllmref import env

if not env.is_ready():
    if os.environ.get("CI"):  # CI builds it before the tests: missing there is an error, not a skip
        raise RuntimeError(f"CI must set up the vLLM environment first: {env.SETUP_HINT}")
    pytest.skip(f"the vLLM environment is not set up: {env.SETUP_HINT}", allow_module_level=True)

# Its engines' steps are timed and judged (contended takes retaken): CI runs it after the parallel
# part of the suite, with nothing beside it.
pytestmark = pytest.mark.exclusive

TINY = ["torch_ops.size_scale=0.03", "torch_ops.max_m=6", "torch_ops.max_rows=16",
        "vllm_ops.size_scale=0.03", "vllm_ops.max_m=6", "vllm_ops.max_batch=4"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from tests.gpubench.conftest import tiny_probe_run

    run_dir = tiny_probe_run(tmp_path_factory.mktemp("vllm_ops"), "torch_ops,vllm_ops", TINY)
    rows = [json.loads(line) for line in (run_dir / "vllm_ops.jsonl").read_text().splitlines()]
    return run_dir, pd.DataFrame(rows)


def test_rows_time_vllms_kernel_cold_and_validated(tiny_run):
    _, every = tiny_run
    assert every.key.is_unique
    rows = every[every.family == "linear"]
    assert len(rows) > 10
    assert rows.valid.all(), rows[~rows.valid][["key", "invalid_reason"]].to_string()
    assert (rows.engine == "vllm").all() and (rows.family == "linear").all()
    assert (rows.vllm_version == env.VLLM_VERSION).all()
    assert (rows.timer == "thread_cpu").all() and (rows.num_threads == 1).all()
    assert (rows.flops == 2 * rows.m * rows.n * rows.k).all()
    # every repetition called a different prepacked weight, and the reference GEMV was timed beside it
    assert (rows.num_weights >= 2).all()
    assert rows.ref_times_s.map(len).min() >= 5
    assert (rows.t_median_s > 0).all()
    # real engine steps of the tiny model: one row per decode batch size, each of many steps
    eng = every[every.family == "engine_step"].sort_values("batch")
    assert eng.batch.tolist() == [1, 4] and eng.valid.all() and (eng.model == "tiny-llama").all()
    assert (eng.n_reps >= 10).all() and (eng.context_mean > 64).all()
    assert (eng.t_median_s > 1e-3).all()  # a vLLM engine step costs milliseconds even for a tiny model


def test_fit_writes_linear_vllm_and_the_fused_layout_uses_it(tiny_run, tmp_path):
    from predictor.calibrate import Calibration, fit_run
    from predictor.cpu_tables_fit import _reference_medians
    from predictor.step import StepModel

    run_dir, every = tiny_run
    rows = every[every.family == "linear"]
    cal = fit_run(run_dir, argv=["test"], allow_contended=True)
    path = tmp_path / "cal.json"
    cal.save(path)
    tables = Calibration.load(path).cpu_ops["fp32"]
    vl = tables.d["linear_vllm"]
    assert vl["engine"] == "vllm" and vl["num_rows"] == len(rows[rows.valid])
    # a node's per-element seconds are the row medians taken to the run's median reference phase,
    # each pass on its own, then the median over a cell's passes; recomputed here from the raw rows
    ref = _reference_medians(rows)
    typical = np.median(ref)
    node = vl["nodes"][0]
    sel = rows[(rows.k == node["k"]) & (rows.n == node["n"])]
    assert sorted(sel["pass"].unique()) == [0, 1]  # --quick times every cell in two passes
    normalized = pd.Series(sel.t_median_s.to_numpy() * typical / _reference_medians(sel), index=sel.m.to_numpy())
    want = normalized.groupby(level=0).median().sort_index()
    assert node["m"] == want.index.tolist()
    np.testing.assert_allclose(node["s_per_element"], want.to_numpy() / (node["k"] * node["n"]), rtol=1e-9)
    # at a probed node the vLLM engine's linear is priced from those rows, torch's from its own
    curve = tables.linear_curve(node["n"], node["k"], node["m"], engine="vllm")
    np.testing.assert_allclose(curve.y, np.array(node["s_per_element"]) * node["k"] * node["n"], rtol=1e-9)
    fused = StepModel("cpu", "llama-60m", calibration=path, gemm_layout="fused")
    separate = StepModel("cpu", "llama-60m", calibration=path, gemm_layout="separate")
    assert fused.cpu_table.linear_engine == "vllm" and separate.cpu_table.linear_engine == "torch"
    assert fused.predict_time([(1, 64)] * 4) != separate.predict_time([(1, 64)] * 4)
    # vLLM's engine cost: the tiny model's measured step minus the tables' price of its ops,
    # charged as the host term of every vLLM-layout step and never to the torch engine's
    from common.model_config import load_model_config
    from predictor.cpu_step import CpuTableStep

    eng = every[every.family == "engine_step"].sort_values("batch")
    # its layers priced with vLLM's measured rest of a layer, as the model's own are
    tiny = CpuTableStep(tables, load_model_config("tiny-llama"), "fused", engine_cost=False)
    b, t, ctx = int(eng.batch.iloc[-1]), float(eng.t_median_s.iloc[-1]), float(eng.context_mean.iloc[-1])
    priced = tiny.predict_time([(1, int(ctx))] * b)
    p = fused.predict([(1, 100)] * b)
    # clipped at zero: on a noisy host the short tiny-run grid can price the tiny model's ops above
    # its measured step, so whether this run's residual is positive depends on the host
    per_layer = max(0.0, fused.cpu_table.layer_extra_s(b, b))
    assert p.host_s == pytest.approx(max(0.0, t - priced) + fused.model.num_layers * per_layer, rel=1e-9)
    assert p.total_s == pytest.approx(sum(op.t_s for op in p.ops.values()) + p.host_s, rel=1e-12)
    assert separate.predict([(1, 100)] * b).host_s == 0.0
    # the same run with its engine steps measured 10x slower: every extra second is engine cost
    slow_dir = tmp_path / "slow-engine"
    shutil.copytree(run_dir, slow_dir)
    ops_file = slow_dir / "vllm_ops.jsonl"
    lines = []
    for line in ops_file.read_text().splitlines():
        row = json.loads(line)
        if row.get("family") == "engine_step":
            row["t_median_s"] *= 10
            row["times_s"] = [v * 10 for v in row["times_s"]]
        lines.append(json.dumps(row))
    ops_file.write_text("\n".join(lines) + "\n")
    slow_path = tmp_path / "slow.json"
    fit_run(slow_dir, argv=["test"], allow_contended=True).save(slow_path)
    slow = StepModel("cpu", "llama-60m", calibration=slow_path, gemm_layout="fused").predict([(1, 100)] * b)
    assert slow.host_s == pytest.approx(10 * t - priced + fused.model.num_layers * per_layer, rel=1e-9)
    assert slow.host_s > p.host_s
    assert slow.total_s - slow.host_s == pytest.approx(p.total_s - p.host_s, rel=1e-12)


def test_engine_layers_rows_give_vllms_per_layer_cost(tiny_run, tmp_path):
    """Synthetic Llamas at two depths per width: the fit keeps their configs and step times, and the
    step model charges each layer the measured time per added layer less the tables' price of one."""
    from predictor.calibrate import Calibration, fit_run
    from predictor.step import StepModel

    run_dir, every = tiny_run
    shallow, deep = LAYER_DEPTHS
    added = deep - shallow
    rows = every[every.family == "engine_layers"]
    assert rows.valid.all() and set(rows.layers) == {shallow, deep} and set(rows.width) == {384, 1024}
    assert (rows.batch == 1).all()  # vllm_ops.max_batch=4 leaves B = 1 of (1, 8)
    for r in rows.itertuples():  # the row's config is the model vLLM ran
        assert r.config["num_hidden_layers"] == r.layers and r.config["hidden_size"] == r.width
        assert r.config["num_attention_heads"] == r.width // 64
    # deeper is slower: each added layer streams its weights. At width 1024 eight more layers stream
    # ~400 MB, milliseconds on any host; at width 384 they add ~0.2 ms, inside a shared VM's noise,
    # so there the deeper model must only not be clearly faster.
    t_by_width = {w: rows[rows.width == w].set_index("layers").t_median_s for w in (384, 1024)}
    assert t_by_width[1024][deep] > t_by_width[1024][shallow]
    assert t_by_width[384][deep] > 0.9 * t_by_width[384][shallow]
    base_path = tmp_path / "cal.json"
    fit_run(run_dir, argv=["test"], allow_contended=True).save(base_path)
    nodes = Calibration.load(base_path).cpu_ops["fp32"].d["layers_vllm"]["nodes"]
    assert [n["width"] for n in nodes] == [384, 1024] and all(n["depths"] == [shallow, deep] for n in nodes)
    # the same run with every deeper step 0.4 s and 0.8 s slower: past any clipping at zero, each
    # added layer costs 0.4 s / added more between the two at every width, so the engine cost of a
    # model of L layers grows by L x that, and nothing else in its prediction moves
    def shifted_calibration(extra_s: float):
        shifted_dir = tmp_path / f"deeper-plus-{extra_s}"
        shutil.copytree(run_dir, shifted_dir)
        ops_file = shifted_dir / "vllm_ops.jsonl"
        lines = []
        for line in ops_file.read_text().splitlines():
            row = json.loads(line)
            if row.get("family") == "engine_layers" and row["layers"] == deep:
                row["t_median_s"] += extra_s
                row["times_s"] = [v + extra_s for v in row["times_s"]]
            lines.append(json.dumps(row))
        ops_file.write_text("\n".join(lines) + "\n")
        path = tmp_path / f"shifted-{extra_s}.json"
        fit_run(shifted_dir, argv=["test"], allow_contended=True).save(path)
        return path

    once, twice = shifted_calibration(0.4), shifted_calibration(0.8)
    for model, width in (("llama-3.2-1b", 2048), ("llama-60m", 512)):
        a = StepModel("cpu", model, calibration=once, gemm_layout="fused")
        b = StepModel("cpu", model, calibration=twice, gemm_layout="fused")
        assert a.model.hidden_size == width
        per_layer = [m.cpu_table.layer_rest.at(1, proportional_past_end=False) for m in (a, b)]
        assert per_layer[1] - per_layer[0] == pytest.approx(0.4 / added, rel=1e-9)
        pa, pb = a.predict([(1, 100)]), b.predict([(1, 100)])
        assert pb.host_s - pa.host_s == pytest.approx(a.model.num_layers * 0.4 / added, rel=1e-9)
        assert pb.total_s - pb.host_s == pytest.approx(pa.total_s - pa.host_s, rel=1e-12)
    # the torch engine's layout pays no vLLM engine cost
    assert StepModel("cpu", "llama-60m", calibration=twice, gemm_layout="separate").predict([(1, 100)]).host_s == 0


def test_a_layer_rest_below_the_torch_segment_prices_replaces_them(tiny_run, tmp_path):
    """vLLM's own kernels can cost less than the torch segment tables say (after an MKL GEMM of
    several rows a small torch op is slow on some hosts): with the deeper rows set to cost exactly the
    added layers' projections and attention, a layer's rest is zero, so a decode step pays no segment
    cost, and a prefill chunk pays only the tables' growth past one row."""
    from common.model_config import from_dict
    from predictor.calibrate import fit_run
    from predictor.cpu_step import CpuTableStep
    from predictor.step import StepModel

    run_dir, _ = tiny_run
    base_path = tmp_path / "base.json"
    fit_run(run_dir, argv=["test"], allow_contended=True).save(base_path)
    tables = StepModel("cpu", "llama-60m", calibration=base_path, gemm_layout="fused").cpu_table.tables
    flat_dir = tmp_path / "rest-zero"
    shutil.copytree(run_dir, flat_dir)
    ops_file = flat_dir / "vllm_ops.jsonl"
    rows = [json.loads(line) for line in ops_file.read_text().splitlines()]
    shallow_depth, deep_depth = LAYER_DEPTHS
    shallow = {(r["width"], r["batch"]): r for r in rows
               if r.get("family") == "engine_layers" and r["layers"] == shallow_depth}
    for r in rows:
        if r.get("family") == "engine_layers" and r["layers"] == deep_depth:
            lo = shallow[(r["width"], r["batch"])]
            lo_step, hi_step = (CpuTableStep(tables, from_dict(x["config"], name=f"l{x['layers']}"), "fused",
                                             engine_cost=False, layer_rest=False) for x in (lo, r))
            b = int(r["batch"])
            # the deeper model's step: the shallow one's plus what its added layers' projections and
            # attention are priced at (segments left out), less 1 us so the rest clips to zero
            added = (hi_step.predict_time([(1, int(r["context_mean"]))] * b)
                     - lo_step.predict_time([(1, int(lo["context_mean"]))] * b)
                     - (deep_depth - shallow_depth) * hi_step.segments_s(b))
            r["t_median_s"] = lo["t_median_s"] + added - 1e-6
            r["times_s"] = [r["t_median_s"]] * len(r["times_s"])
    ops_file.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    flat_path = tmp_path / "flat.json"
    fit_run(flat_dir, argv=["test"], allow_contended=True).save(flat_path)
    model = StepModel("cpu", "llama-60m", calibration=flat_path, gemm_layout="fused")
    table = model.cpu_table
    assert table.layer_rest.at(1, proportional_past_end=False) == 0.0
    segment_ops = ("input_norm", "rope", "residual", "post_norm", "act_mul", "residual2")
    decode = table.op_times([(1, 100)])
    assert sum(decode[k] for k in segment_ops) == pytest.approx(0.0, abs=1e-12)
    assert decode["engine"] == pytest.approx(table.engine_s(1), rel=1e-12)
    layers = model.model.num_layers
    prefill = table.op_times([(64, 0)])
    grown = layers * (table.segments_s(64) - table.segments_s(1))
    kv_write = layers * table.kv_write.at(64) * grown / (layers * table.segments_s(64))
    assert sum(prefill[k] for k in segment_ops) + kv_write == pytest.approx(grown, rel=1e-9)
    for batch in ([(1, 100)], [(1, 100)] * 3, [(64, 0)], [(1, 50), (32, 10)]):
        assert table.predict_time(batch) == pytest.approx(sum(table.op_times(batch).values()), rel=1e-12)
    # the torch engine's layout prices its segments from the torch tables whatever vLLM measured
    separate = StepModel("cpu", "llama-60m", calibration=flat_path, gemm_layout="separate").cpu_table
    assert sum(separate.op_times([(1, 100)])[k] for k in segment_ops) > 0


def test_attention_rows_time_vllms_paged_kernel_and_count_what_it_computes(tiny_run):
    _, every = tiny_run
    dec = every[every.family == "attn_decode"]
    pre = every[every.family == "attn_prefill"]
    assert len(dec) and len(pre)
    for rows in (dec, pre):
        assert rows.valid.all(), rows[~rows.valid][["key", "invalid_reason"]].to_string()
        assert (rows.engine == "vllm").all() and (rows.block_size == 128).all()
        assert (rows.max_abs_err < 1e-4).all()  # one problem per head configuration against float64
        assert rows.isa.notna().all() and (rows.t_median_s > 0).all()
        assert rows.ref_times_s.map(len).min() >= 5
        # the KV pool holds more blocks than one repetition reads: every repetition reads fresh ones
        assert (rows.pool_blocks > 1).all()
    # a decode query attends its own key too (L + 1); a causal chunk computes n*c + n(n+1)/2 pairs
    b, ctx, h, hkv, d = (dec[c].to_numpy() for c in ("batch", "context", "heads", "kv_heads", "head_dim"))
    assert (dec.flops.to_numpy() == 4 * b * (ctx + 1) * h * d).all()
    assert (dec.bytes.to_numpy() == (2 * b * (ctx + 1) * hkv * d + 2 * b * h * d) * 4).all()
    n, c, h = (pre[col].to_numpy() for col in ("new_tokens", "cached_tokens", "heads"))
    assert (pre.flops.to_numpy() == 4 * (n * c + n * (n + 1) // 2) * h * pre.head_dim.to_numpy()).all()
    # more keys cost more (same head configuration and batch)
    one = dec[(dec.heads == dec.heads.iloc[0]) & (dec.batch == dec.batch.min())].sort_values("context")
    assert one.t_median_s.iloc[-1] > one.t_median_s.iloc[0]


def test_fused_layout_prices_attention_with_vllms_kernel(tiny_run, tmp_path):
    from common.model_config import load_model_config
    from predictor.calibrate import Calibration, fit_run
    from predictor.cpu_step import CpuTableStep
    from predictor.cpu_tables import config_coef

    run_dir, every = tiny_run
    cal = fit_run(run_dir, argv=["test"], allow_contended=True)
    path = tmp_path / "cal.json"
    cal.save(path)
    tables = Calibration.load(path).cpu_ops["fp32"]
    law = tables.d["attn_vllm"]
    assert law["engine"] == "vllm" and law["block_size"] == 128
    assert law["decode"]["num_rows"] == int(every[(every.family == "attn_decode")].valid.sum())
    model = load_model_config("llama-60m")
    fused = CpuTableStep(tables, model, "fused")
    separate = CpuTableStep(tables, model, "separate")
    assert fused.attention_engine == "vllm" and separate.attention_engine == "torch"
    # a prefill chunk over a cache: vLLM's law, causal pairs n*c + n(n+1)/2, recomputed by hand
    hd, h, hkv = model.head_dim, model.num_heads, model.num_kv_heads
    pc = config_coef(law["prefill"], h, hkv, hd)
    n, c = 40, 300
    want = pc["a"] + pc["b_new"] * h * hd * n + pc["e_kv"] * hkv * hd * (c + n) + pc["p_pairs"] * h * hd * (n * c + n * (n + 1) / 2)
    assert fused.attention_s([(n, c)]) == pytest.approx(want, rel=1e-12)
    dc = config_coef(law["decode"], h, hkv, hd)
    want_dec = dc["a"] + dc["b"] * 3 + (dc["c_q"] * h * hd + dc["e_kv"] * hkv * hd) * (101 + 201 + 301)
    assert fused.attention_s([(1, 100), (1, 200), (1, 300)]) == pytest.approx(want_dec, rel=1e-12)
    assert separate.attention_s([(n, c)]) != fused.attention_s([(n, c)])


def test_probe_is_skipped_with_the_reason_without_the_environment(tmp_path):
    from tests.gpubench.conftest import run_cli

    out = tmp_path / "runs"
    proc = run_cli("run", "--device", "cpu", "--probes", "vllm_ops", "--out", str(out),
                   env={**os.environ, "GPUBENCH_VLLM_PYTHON": str(tmp_path / "no-such-python")}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]
    manifest = json.loads(next(out.glob("cpu/*/manifest.json")).read_text())
    status = manifest["probes"]["vllm_ops"]
    assert status["status"] == "skipped" and "gpubench vllm setup" in status["reason"]
