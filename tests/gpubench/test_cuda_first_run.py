"""What must hold before a GPU ever runs the CUDA code, checked here without one: the compiled loops
are what their rows claim (SASS counts), the extension builds without setuptools, every kernel a
probe queues behind its spin gate is preloaded (lazy module loading), and scripts/device_check.sh
returns a handful of files within its time budget (rehearsed end to end on a CPU run)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_SRC = ROOT / "csrc" / "cuda"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on this machine")


def test_every_kernel_queued_behind_a_spin_gate_is_preloaded():
    """Since CUDA 12.2 a kernel's module loads at its first launch and that load waits for the
    device to go idle: a first launch behind a held gate deadlocks until the gate times out. Every
    kernel launched after a file's SpinGate must be preloaded (preload_kernels) or launched once
    before it."""
    launch = re.compile(r"\b(\w+)(?:<[^<>]*>)?<<<")
    checked = 0
    for cu in sorted(CUDA_SRC.glob("*.cu")):
        text = cu.read_text()
        gate = text.find("SpinGate gate")
        if gate < 0:
            continue
        before, after = text[:gate], text[gate:]
        preloaded = set()
        for args in re.findall(r"preload_kernels\(([^)]*)\)", text):
            preloaded |= {a.strip() for a in args.split(",")}
        launched_before = set(launch.findall(before))
        for kernel in set(launch.findall(after)):
            assert kernel in preloaded or kernel in launched_before, f"{cu.name}: {kernel} is not preloaded"
            checked += 1
    assert checked >= 7  # stream (4 kernels), l2 (read), launch (empty) at least
    assert "preload_kernel(reinterpret_cast<const void*>(spin_kernel))" in (CUDA_SRC / "common.cu").read_text()


@needs_nvcc
def test_peak_loops_compile_to_the_units_their_rows_count():
    """scripts/check_sass.py over every shipped architecture: HMMA/QMMA/HGMMA/QGMMA/FFMA counts per
    loop, no uniform-datapath FMA, fp8 planned only where it is native, 128-bit STREAM accesses."""
    # CI's scripts/check_cuda_build.sh keeps its objects there; elsewhere (or when stale) they compile here
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_sass.py"), "--json",
                           "--objects", str(ROOT / "build" / "cuda-objects")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    by = {(r["arch"], r["kernel"]): r for r in rows}
    assert all(r["ok"] for r in rows)
    assert {a for a, _ in by} == {"80", "86", "89", "90a", "100", "120"}
    assert ("90a", "wgmma_loop_k<bf16>") in by and ("89", "mma_loop_k<fp8>") in by and ("120", "mma_loop_k<fp8>") in by
    assert "QGMMA" in by[("90a", "wgmma_loop_k<fp8>")]["counted"]  # Hopper's native fp8: wgmma e4m3
    assert all(by[(a, "l2 read_k")]["ok"] for a in ("80", "90a", "100"))  # four loads in flight, every arch
    assert ("90a", "mma_loop_k<fp8> (emulated: skipped at run time)") in by  # the emulation is seen and avoided
    assert "UFFMA 0" in by[("120", "fma_loop_k")]["counted"]


def test_sass_check_disassembles_kept_objects_only_when_newer_than_every_source(tmp_path):
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("check_sass", ROOT / "scripts" / "check_sass.py")
    check_sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_sass)
    kept = tmp_path / "kept"
    kept.mkdir()
    obj = kept / "peak.cu.80.o"
    obj.write_bytes(b"kept")
    # newer than the sources: used as it is (an nvcc that fails proves nothing was compiled)
    assert check_sass.compiled_object("peak.cu", "80", "false", tmp_path, kept) == obj
    # older than a source (a .cu edited since): compiled again, and the failing nvcc says so
    old = min(f.stat().st_mtime for f in (ROOT / "csrc" / "cuda").iterdir()) - 3600
    os.utime(obj, (time.time(), old))
    with pytest.raises(subprocess.CalledProcessError):
        check_sass.compiled_object("peak.cu", "80", "false", tmp_path, kept)
    with pytest.raises(subprocess.CalledProcessError):  # and without a directory of kept objects
        check_sass.compiled_object("peak.cu", "80", "false", tmp_path, None)


@needs_nvcc
def test_extension_builds_without_setuptools_and_reports_no_device(tmp_path):
    out = tmp_path / "_cuda.so"
    env = dict(os.environ, PYTHON=sys.executable, BUILD_OUT=str(out))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_cuda_ext.sh"), "80"], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compute_80 PTX" in proc.stdout
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('gpubench._cuda', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            "try:\n    m.device_count()\nexcept m.NoDeviceError as e:\n    print('no device:', e)\n"
            "else:\n    print('device')")
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(("no device:", "device"))


def test_device_check_step_limits_fit_one_call():
    """The limits of the script's steps add up to under 8 minutes (a device call may run 10)."""
    text = (ROOT / "scripts" / "device_check.sh").read_text()
    limits = [int(n) for n in re.findall(r"^\s*(?:if ! )?step \w+ (\d+) ", text, flags=re.M)]
    gpu_steps = [int(n) for n in re.findall(r"^(?:if ! )?step (?:build|sass|selfchecks|stress|run) (\d+) ", text, flags=re.M)]
    assert len(gpu_steps) == 5 and sum(gpu_steps) <= 480, gpu_steps
    assert limits


def test_device_check_dry_run_returns_a_handful_of_files(tmp_path):
    """The whole script on a CPU run (DRY_RUN=1): seven files directly in OUT, the run and the step
    rows (the graph engine's and the eager one's) archived by the EXIT trap (what a device tool can
    return: at most 8 files, at most two folders deep)."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), DRY_RUN="1", PYTHON=sys.executable,
               STEP_MODELS="tiny-llama llama-60m", GRAPH_MODELS="tiny-llama", DEADLINE_S="0")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["device_check.log", "env.txt", "run.tar.gz", "sass_summary.txt", "spec_table.txt", "steps.tar.gz",
                     "stress.txt"]
    assert all(p.parent == out for p in out.rglob("*"))
    with tarfile.open(out / "run.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("/manifest.json") for n in names) and any(n.endswith("/stream.jsonl") for n in names)
    assert "stream" in (out / "spec_table.txt").read_text()
    with tarfile.open(out / "steps.tar.gz") as tar:
        tar.extractall(tmp_path / "steps", filter="data")
    rows = pd.read_parquet(tmp_path / "steps" / "gpu-tiny-llama.parquet")
    assert len(rows) == 2 and (rows["wall_s"] > 0).all() and set(rows["model"]) == {"tiny-llama"}
    assert (tmp_path / "steps" / "gpu-llama-60m.parquet").exists()
    graph = pd.read_parquet(tmp_path / "steps" / "graph-tiny-llama.parquet")
    assert len(graph) == 2 and set(graph["engine"]) == {"torch-graph"} and (graph["host_step_s"] > 0).all()
    assert (out / "stress.txt").read_text().startswith("stress: 3 of 3 runs clean")


def test_device_check_skips_step_models_the_deadline_leaves_no_time_for(tmp_path):
    """A model is started only with 30 s or more left before DEADLINE_S: otherwise one line says so,
    and no step archive is written."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), DRY_RUN="1", PYTHON=sys.executable, STEP_MODELS="tiny-llama", DEADLINE_S="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "steps: tiny-llama (torch) skipped" in (out / "device_check.log").read_text()
    assert not (out / "steps.tar.gz").exists()
