"""Shared helpers for the bench-stage tests: tiny probe sizes and the real console script."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Probe options that make a full `gpubench run` take seconds: real kernels, tiny sweeps.
TINY_SETS = [
    "stream.min_array_bytes=131072", "stream.max_array_bytes=524288",
    "l2.min_bytes=16384", "l2.max_bytes=262144", "l2.factor=4", "l2.flush_bytes=1048576",
    "launch.max_count=100",
    "peak.num_reps=5", "peak.iters=20000",
    "gemm.max_m=4", "gemm.shape_scale=0.0625", "gemm.max_square=256", "gemm.num_reps=3",
    "torch_ops.size_scale=0.03", "torch_ops.max_m=4", "torch_ops.max_rows=16",
    "vllm_ops.size_scale=0.03", "vllm_ops.max_m=2", "vllm_ops.max_batch=1",
    # vLLM's engine-step rows start an engine per row (~2.5 min in all here): tests/vllmref takes them
    "vllm_ops.engine_steps=false",
]


def tiny_args() -> list[str]:
    out = []
    for s in TINY_SETS:
        out += ["--set", s]
    return out


def gpubench_exe() -> list[str]:
    """The installed console script (falls back to the module when it is not on PATH)."""
    exe = Path(sys.executable).with_name("gpubench")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("gpubench")
    return [found] if found else [sys.executable, "-m", "gpubench"]


def run_cli(*args, timeout=300, cwd=None, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, COLUMNS="200")
    return subprocess.run([*gpubench_exe(), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def tiny_probe_run(out: Path, probes: str, sets: list[str], timeout: int = 900) -> Path:
    """A real `gpubench run --device cpu --quick` of ``probes`` with ``--set`` options into ``out``;
    returns the run directory (the command must succeed)."""
    args = ["run", "--device", "cpu", "--quick", "--probes", probes, "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    proc = run_cli(*args, timeout=timeout)
    assert proc.returncode == 0, (failed_probes(out), proc.stdout[-3000:], proc.stderr[-2000:])
    return next(out.glob("cpu/*"))


def failed_probes(root: Path) -> dict:
    """What the manifests under ``root`` say of each probe that did not finish (its reason), so a
    failed run in CI says why without the run directory."""
    import json

    out = {}
    for manifest in root.glob("*/*/manifest.json"):
        for name, info in (json.loads(manifest.read_text()).get("probes") or {}).items():
            if isinstance(info, dict) and info.get("status") != "done":
                out[name] = {k: info.get(k) for k in ("status", "reason", "num_rows", "num_invalid")}
    return out


def only_run_dir(root: Path) -> Path:
    dirs = [p.parent for p in root.glob("*/*/manifest.json")]
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """One real tiny `gpubench run --device cpu` of every probe, shared by the report tests."""
    root = tmp_path_factory.mktemp("tiny_run")
    res = run_cli("run", "--device", "cpu", "--out", str(root), *tiny_args())
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    return only_run_dir(root)
