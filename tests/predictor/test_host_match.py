"""A calibration records its host; predict/evaluate refuse one from another CPU or SKU; fit refuses
a run taken under contention (real committed runs from two different hosts of this project)."""
import json
import shutil
from pathlib import Path

import pytest

from common.errors import ConfigError
from predictor.calibrate import Calibration, fit_run
from predictor.host_match import check_calibration_host, current_cpu_identity, identity_from_device, mismatches
from tests.conftest import gpubench

ROOT = Path(__file__).resolve().parents[2]
INTEL_RUN = ROOT / "results/eval/cpu/probes/cpu/20261201T112057Z-vm"   # 2-vCPU Intel Xeon, AVX-512
AMD_RUN = ROOT / "results/eval/cpu/probes/cpu/20261129T171339Z-vm"     # AMD EPYC, AVX2


def test_fit_records_the_host_of_the_run():
    intel, amd = fit_run(INTEL_RUN), fit_run(AMD_RUN)
    assert intel.meta["host"]["model_name"].startswith("Intel") and intel.meta["host"]["vector_bits"] == 512
    assert amd.meta["host"]["model_name"].startswith("AMD") and "avx512f" not in amd.meta["host"]["isa_flags"]
    assert mismatches(intel.meta["host"], amd.meta["host"])  # the two hosts are told apart
    assert intel.meta["contended"] is None


def test_a_calibration_of_another_cpu_is_refused_with_one_line(tmp_path):
    """Whichever of the two runs describes another CPU than this one is refused; a calibration of
    this host's own kind (fitted here from a fresh identity) is accepted."""
    here = current_cpu_identity()
    for run in (INTEL_RUN, AMD_RUN):
        cal = fit_run(run)
        path = tmp_path / f"{run.name}.json"
        cal.save(path)
        p = gpubench("predict", "--sku", "cpu", "--model", "smollm2-135m", "--batch", "2", "--context", "64",
                     "--calibration", str(path))
        if mismatches(cal.meta["host"], here):
            assert p.returncode == 2 and "describes another CPU" in p.stderr and "Traceback" not in p.stderr
            assert len(p.stderr.strip().splitlines()) == 1
            forced = gpubench("predict", "--sku", "cpu", "--model", "smollm2-135m", "--batch", "2", "--context", "64",
                              "--calibration", str(path), "--force-calibration")
            assert forced.returncode == 0 and "(forced)" in forced.stderr
        else:
            assert p.returncode == 0, p.stderr
    same = Calibration.load(tmp_path / f"{INTEL_RUN.name}.json")
    same.meta["host"] = {**here, "blas": "any"}
    assert check_calibration_host(same, "cpu") == []
    with pytest.raises(ConfigError, match="for SKU 'cpu', not 'h100-sxm'"):
        check_calibration_host(same, "h100-sxm")
    same.meta.pop("host")
    assert any("records no host" in w for w in check_calibration_host(same, "cpu"))


def test_fit_refuses_a_contended_run_or_marks_it(tmp_path):
    run = tmp_path / INTEL_RUN.name
    shutil.copytree(INTEL_RUN, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["telemetry"]["loadavg_at_start"] = [9.5, 8.0, 7.0]  # two CPUs and a load of 9.5
    (run / "manifest.json").write_text(json.dumps(manifest))
    p = gpubench("fit", str(run), "-o", str(tmp_path / "c.json"))
    assert p.returncode == 2 and "under contention" in p.stderr and "load up to 9.5 on 2 CPUs" in p.stderr
    assert not (tmp_path / "c.json").exists()
    p = gpubench("fit", str(run), "-o", str(tmp_path / "c.json"), "--allow-contended")
    assert p.returncode == 0 and "contention" in p.stderr
    cal = Calibration.load(tmp_path / "c.json")
    assert "9.5" in cal.meta["contended"]
    cal.meta["host"] = current_cpu_identity()  # so that only the contention speaks
    assert any("under contention" in w for w in check_calibration_host(cal, "cpu"))


def test_gpu_run_identity_is_its_device():
    ident = identity_from_device({"backend": "cuda", "name": "NVIDIA H200", "driver": "580.65"})
    assert ident == {"backend": "cuda", "name": "NVIDIA H200", "driver": "580.65"}


def test_hugging_face_ids_of_shipped_configs_resolve_and_unknown_ids_say_why():
    from common.errors import GpubenchError
    from predictor import load_model_config

    assert load_model_config("meta-llama/Llama-3.1-8B").name == load_model_config("llama-3.1-8b").name
    assert load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct").num_layers == load_model_config("smollm2-135m").num_layers
    with pytest.raises(GpubenchError, match="not a shipped config's Hugging Face id"):
        load_model_config("google/gemma-2-9b")


CONTENDED_RUN = ROOT / "results/cpu/20261129T174152Z-vm"  # committed: load 12.5, 0.34 CPUs per row


def test_fit_of_a_contended_run_names_the_way_out_and_warns_in_two_short_lines(tmp_path):
    out = tmp_path / "c.json"
    p = gpubench("fit", str(CONTENDED_RUN), "-o", str(out))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and not out.exists()
    assert "rerun when the machine is quiet, or pass --allow-contended to fit anyway" in lines[0]
    p = gpubench("fit", str(CONTENDED_RUN), "-o", str(out), "--allow-contended")
    assert p.returncode == 0, p.stderr
    lines = p.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2 and all(len(ln) <= 110 for ln in lines), lines
    assert "contention" in lines[0] and "--verbose" in lines[1] and "warning" not in p.stdout
    cal = Calibration.load(out)
    assert "load up to 12.7" in cal.meta["contended"] and len(cal.meta["fit"]["warnings"]) >= 3
    verbose = gpubench("fit", str(CONTENDED_RUN), "-o", str(out), "--allow-contended", "--verbose")
    assert verbose.returncode == 0
    full = verbose.stderr.strip().splitlines()
    assert len(full) == 1 + len(cal.meta["fit"]["warnings"]) and "load up to 12.7" in full[0]
    js = gpubench("fit", str(CONTENDED_RUN), "-o", str(out), "--allow-contended", "--json")
    assert js.returncode == 0 and len(js.stderr.strip().splitlines()) <= 2
    assert json.loads(js.stdout)["meta"]["fit"]["warnings"] == cal.meta["fit"]["warnings"]
