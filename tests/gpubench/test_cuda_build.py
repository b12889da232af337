"""The CI compile check (scripts/check_cuda_build.sh) on small real .cu files: it must pass clean
code, and fail on a compile error and on register spills in the bandwidth probes' files."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_cuda_build.sh"

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")

CLEAN = r"""
__global__ void triad(double2* a, const double2* b, const double2* c, double s, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        a[i] = make_double2(b[i].x + s * c[i].x, b[i].y + s * c[i].y);
}
"""

# 64 values live at once: with 16 registers per thread ptxas must spill.
SPILLING = r"""
__global__ void pressure(float* out, const float* in, int n) {
    float v[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) v[i] = in[threadIdx.x + i * n];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) s += v[i] * v[63 - i] + v[(i * 7) & 63];
    out[threadIdx.x] = s;
}
"""


def _check(tmp_path, name: str, source: str, **env) -> subprocess.CompletedProcess:
    cu = tmp_path / name
    cu.write_text(source)
    e = dict(os.environ, CHECK_ARCHS="80", **env)
    return subprocess.run(["bash", str(SCRIPT), str(cu)], capture_output=True, text=True, env=e, timeout=170)


def test_clean_file_passes_with_the_spill_report(tmp_path):
    p = _check(tmp_path, "stream.cu", CLEAN)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no spills in" in p.stdout


def test_spills_in_a_bandwidth_probe_file_fail(tmp_path):
    p = _check(tmp_path, "l2.cu", SPILLING, NVCC_EXTRA_FLAGS="-maxrregcount=16")
    assert p.returncode == 1
    assert "l2.cu spills registers for sm_80" in p.stdout and "bytes spill" in p.stdout


def test_compile_error_fails_naming_file_and_arch(tmp_path):
    p = _check(tmp_path, "broken.cu", CLEAN + "\n__global__ void oops( { }\n")
    assert p.returncode == 1
    assert "broken.cu failed for sm_80" in p.stdout
