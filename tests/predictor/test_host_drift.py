"""predict --check-drift: the probes' cold reference GEMV timed now, on this host, against the one a
CPU calibration's probe run recorded (the committed calibration, fitted from a real probe run)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpubench.cli import main
from predictor.calibrate import Calibration
from predictor.host_drift import DRIFT_TOLERANCE, HostDrift, measure_drift

ROOT = Path(__file__).resolve().parents[2]
CPU_CAL = ROOT / "results" / "eval" / "cpu" / "calibration-probes.json"
GPU_CAL = ROOT / "results" / "h200" / "calibration.json"


def _with_reference(tmp_path: Path, seconds) -> Path:
    doc = json.loads(CPU_CAL.read_text())
    if seconds is None:
        del doc["cpu_ops"]["fp32"]["phase_spread"]
    else:
        doc["cpu_ops"]["fp32"]["phase_spread"]["reference_median_s"] = seconds
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_reference_is_timed_here_and_compared_with_the_calibrations():
    cal = Calibration.load(CPU_CAL)
    drift = measure_drift(cal, "fp32", rounds=4)
    recorded = cal.cpu_ops["fp32"].d["phase_spread"]
    assert drift.reference_calibration_s == recorded["reference_median_s"]
    assert drift.num_timed == 4 * 6  # 7 repetitions a round, the first discarded
    # a cold 1024 x 1024 fp32 GEMV streams 4 MiB: between 0.5 and 200 GB/s on any CPU of this kind
    assert 4 * 2**20 / 200e9 < drift.reference_now_s < 4 * 2**20 / 0.5e9
    assert drift.ratio == pytest.approx(drift.reference_now_s / drift.reference_calibration_s)
    assert (drift.calibration_p10, drift.calibration_p90) == (recorded["p10"], recorded["p90"])


def test_drifted_is_beyond_the_tolerance_either_way():
    def at(ratio):
        return HostDrift("fp32", reference_now_s=ratio * 1e-4, reference_calibration_s=1e-4, num_timed=6)

    assert not at(1.0).drifted and not at(1 + DRIFT_TOLERANCE * 0.9).drifted and not at(1 - DRIFT_TOLERANCE * 0.9).drifted
    assert at(1 + DRIFT_TOLERANCE * 1.1).drifted and at(1 - DRIFT_TOLERANCE * 1.1).drifted
    assert "slower" in at(1.3).line() and "faster" in at(0.7).line()


def test_predict_warns_when_the_host_is_far_from_the_calibrations_phase(tmp_path, capsys):
    # a recorded reference of 1 us: no CPU streams 4 MiB that fast, so the host reads far slower
    cal = _with_reference(tmp_path, 1e-6)
    assert main(["predict", "--sku", "cpu", "--model", "llama-60m", "--calibration", str(cal), "--force-calibration",
                 "--check-drift", "--json"]) == 0
    out, err = capsys.readouterr()
    drift = json.loads(out)["host_drift"]
    assert drift["drifted"] and drift["ratio"] > 10 and drift["num_timed"] == 600
    assert "warning: host drift (fp32)" in err and "gpubench fit" in err


def test_bad_input_is_one_line_before_any_timing(tmp_path, capsys):
    cases = [
        ["--sku", "cpu", "--check-drift"],                                                  # nothing to compare with
        ["--sku", "h200", "--calibration", str(GPU_CAL), "--check-drift"],                   # a GPU calibration
        ["--sku", "cpu", "--calibration", str(_with_reference(tmp_path, None)), "--force-calibration",
         "--check-drift"],                                                                   # no reference recorded
        ["--sku", "cpu", "--calibration", str(CPU_CAL), "--force-calibration", "--batch", "0", "--check-drift"],
    ]
    for args in cases:
        assert main(["predict", *args]) == 2, args
        err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("warning:")]
        assert len(err) == 1 and err[0].startswith("gpubench: error:"), (args, err)
        assert "host drift" not in err[0]
