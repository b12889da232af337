"""fit and evaluate price the CPU a run recorded, not the host they run on: a committed probe run fits to
its committed calibration on any machine, and `gpubench evaluate` scores rows against the CPU the
calibration describes (real committed runs and rows of this project's hosts)."""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gpubench import results
from gpubench.hostinfo import HostCPU, host_cpu
from predictor.calibrate import Calibration, fit_run, run_spec
from predictor.host_match import current_cpu_identity, mismatches, recorded_cpu_spec
from tests.conftest import gpubench

ROOT = Path(__file__).resolve().parents[2]
INTEL_RUN = ROOT / "results/eval/cpu/probes/cpu/20261201T112057Z-vm"   # 2-vCPU Intel Xeon, AVX-512
AMD_AVX2_RUN = ROOT / "results/eval/cpu/probes/cpu/20261129T171339Z-vm"  # AMD EPYC, AVX2
# every committed CPU calibration, with the run its COMMAND fits
COMMITTED = {
    "results/eval/cpu/calibration-probes.json": "results/eval/cpu/probes/cpu/20261204T154125Z-vm",
    "results/eval/cpu-2t/calibration-probes.json": "results/eval/cpu-2t/probes/cpu/20261206T110432Z-vm",
    "results/slo/cpu-probes/calibration-cpu.json": "results/slo/cpu-probes/cpu/20261206T164610Z-vm",
    "results/vllm-cpu/calibration-cpu.json": "results/vllm-cpu/probes/cpu/20261203T082553Z-vm",
}
ROWS_2T = [f"results/vllm-cpu/steps-2t/vllm-{m}.parquet" for m in ("llama-60m", "smollm2-135m", "qwen2.5-0.5b")]


def _close(a, b, where: str) -> None:
    """Two JSON trees equal, floats to 1e-9 relative (another vector ISA moves the last bits)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            if k != "source":
                _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and np.isclose(a, b, rtol=1e-9, atol=0.0), (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_the_spec_of_a_run_is_the_cpu_it_recorded():
    for run_dir in (INTEL_RUN, AMD_AVX2_RUN):
        run = results.load(run_dir)
        props = run.manifest["device"]["properties"]
        spec = run_spec(run)
        recorded = HostCPU.from_dict(props)
        assert spec.peak("fp32") == pytest.approx(recorded.peak_flops(4))
        assert spec.num_sms == props["num_cpus"] and spec.l2_bytes == pytest.approx(props["llc_bytes"])
        assert spec.spec_clock_mhz == props["clock_mhz"] and "host" in spec.source
    # the two hosts' vector widths part (512 and 256 bits), whichever machine reads them
    peaks = [run_spec(results.load(r)).peak("fp32") / run_spec(results.load(r)).spec_clock_mhz
             for r in (INTEL_RUN, AMD_AVX2_RUN)]
    assert peaks[0] != peaks[1]
    assert HostCPU.from_dict(host_cpu().to_dict()) == host_cpu()  # the record round-trips


@pytest.mark.parametrize("calibration", sorted(COMMITTED))
def test_a_committed_probe_run_fits_to_its_committed_calibration_on_any_host(calibration):
    committed = json.loads((ROOT / calibration).read_text())
    again = fit_run(ROOT / COMMITTED[calibration]).to_dict()
    for block in ("params", "curves", "cpu_ops", "hardware", "host_residual"):
        _close(committed[block], again[block], block)
    assert again["meta"]["host"] == committed["meta"]["host"]
    assert recorded_cpu_spec(committed["meta"]["host"]) is not None  # the record holds the whole spec


def _metrics(out: Path) -> pd.DataFrame:
    m = pd.read_csv(out / "metrics.csv")
    return m[(m.split == "by_model") & (m.fold == "pooled") & (m.phase == "decode") & (m.rows == "all")].set_index("method")


def test_evaluate_prices_the_calibrations_cpu_and_checks_the_rows_against_it(tmp_path):
    """A calibration recording a CPU that is not this host (the committed two-thread one, its vector
    width made 128 bits) is not refused by evaluate, and its roofline form moves with the recorded
    peak, not with this host's; predict still refuses it. One recording another CPU model than the
    rows' is refused in one line."""
    cal = json.loads((ROOT / "results/eval/cpu-2t/calibration-probes.json").read_text())
    narrow = json.loads(json.dumps(cal))
    narrow["meta"]["host"].update(vector_bits=128, isa_flags=["sse4_2"])
    assert mismatches(narrow["meta"]["host"], current_cpu_identity())
    path = tmp_path / "narrow.json"
    path.write_text(json.dumps(narrow))
    rows = [str(ROOT / r) for r in ROWS_2T]
    p = gpubench("evaluate", *rows, "--calibration", str(path), "--sku", "cpu", "--target", "wall_s",
                 "--out", str(tmp_path / "narrow"), timeout=900)
    assert p.returncode == 0, p.stderr
    assert "describes another CPU" not in p.stderr
    committed = _metrics(ROOT / "results/eval/cpu-vllm-2t")
    here = _metrics(tmp_path / "narrow")
    # the probe-only predictor reads op tables, not the peak: the same figure; the roofline max form
    # prices a quarter of the recorded peak: another figure
    assert here.loc["cpu_ops", "mape_pct"] == pytest.approx(committed.loc["cpu_ops", "mape_pct"], rel=1e-9)
    assert abs(here.loc["max", "mape_pct"] - committed.loc["max", "mape_pct"]) > 1.0
    refused = gpubench("predict", "--sku", "cpu", "--model", "smollm2-135m", "--batch", "2", "--context", "64",
                       "--calibration", str(path))
    assert refused.returncode == 2 and "describes another CPU" in refused.stderr

    other = json.loads(json.dumps(cal))
    other["meta"]["host"]["model_name"] = "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    p = gpubench("evaluate", *rows, "--calibration", str(path), "--sku", "cpu", "--out", str(tmp_path / "other"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "the rows were measured on AMD EPYC but the calibration describes Intel" in p.stderr
    assert not (tmp_path / "other").exists()


def test_an_old_calibration_without_the_whole_record_prices_this_host():
    cal = Calibration.load(ROOT / "results/eval/cpu/calibration-probes.json")
    cal.meta["host"] = {k: v for k, v in cal.meta["host"].items() if k != "clock_mhz"}
    from predictor.host_match import spec_for_calibration

    assert recorded_cpu_spec(cal.meta["host"]) is None
    assert spec_for_calibration("cpu", cal).spec_clock_mhz == host_cpu().clock_mhz


def test_a_replay_prices_the_cpu_its_calibration_recorded(tmp_path):
    """The simulator's step cost with a CPU calibration prices the CPU the calibration records (as
    evaluate does), so a committed replay regenerates alike on any host; predict's default stays this
    host (it refuses another host's calibration first)."""
    from predictor import HardwareSpec, StepModel, hardware_for_calibration
    from scheduling.engine.step_cost import PredictorStepCost

    doc = json.loads((ROOT / "results/slo/cpu-probes/calibration-cpu.json").read_text())
    doc["meta"]["host"].update(num_cpus=64, num_physical_cores=64, clock_mhz=1234.0)  # no host of this kind
    path = tmp_path / "calibration-cpu.json"
    path.write_text(json.dumps(doc))
    recorded = recorded_cpu_spec(doc["meta"]["host"])
    hw = PredictorStepCost("cpu", "smollm2-135m", calibration=str(path), cuda_graphs=False)._model.hardware
    assert hw.spec_clock_mhz == 1234.0 and hw.peak("fp32") == pytest.approx(recorded.peak("fp32"))
    here = StepModel.for_names(sku="cpu", model="smollm2-135m", calibration=str(path)).hardware
    assert here.peak("fp32") != pytest.approx(hw.peak("fp32"))
    assert hardware_for_calibration("h100-sxm", str(path)) == HardwareSpec.from_sku("h100-sxm")
    proc = gpubench("replay", "--jobs", "2", "--preset", "scaled-cpu", "--jps", "1", "--sku", "cpu", "--model",
                    "smollm2-135m", "--no-cuda-graphs", "--calibration", str(path), "--no-progress", "--json",
                    "--out", str(tmp_path / "replay"))
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "replay" / "summary.json").read_text())["metrics"]
    assert metrics["num_jobs"] == 2 and metrics["jct_mean_s"] > 0
