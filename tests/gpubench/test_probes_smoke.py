"""Each CPU probe on tiny sizes through the Python API, on the real compiled extension."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpubench import _cpu
from gpubench.backends import get_backend
from gpubench.backends.base import ProbeConfig
from gpubench.backends.cpu.probes import cpu_probes
from gpubench.backends.cpu.probes.gemm import _check
from gpubench.backends.probe_common import geometric
from gpubench.probe_worker import build_rows

from .conftest import TINY_SETS


@pytest.fixture(scope="module")
def cfg():
    backend, _ = get_backend("cpu")
    opts = dict(s.split("=", 1) for s in TINY_SETS)
    return ProbeConfig(quick=True, num_reps=3, device=backend.device_info(), options=opts)


def _rows(probe, spec):
    return build_rows(probe, "cpu", spec, probe.measure(spec), {})


def test_stream_rows_valid_and_weights(cfg):
    probe = cpu_probes()["stream"]
    specs = probe.plan(cfg)
    assert specs and all(len(s.keys) == 4 for s in specs)
    rows = _rows(probe, specs[0])
    n = specs[0].params["n_elements"]
    assert [r["kernel"] for r in rows] == ["copy", "scale", "add", "triad"]
    assert [r["bytes"] for r in rows] == [2 * 8 * n, 2 * 8 * n, 3 * 8 * n, 3 * 8 * n]
    for r in rows:
        assert r["valid"] and len(r["times_s"]) >= 10 and r["n_reps"] == len(r["times_s"]) - 1
        assert r["gbps_best"] >= r["gbps_median"] > 0


@pytest.mark.parametrize("target", [1, 2, 3])
def test_stream_validation_catches_corrupted_array(target):
    out = _cpu.stream(1 << 16, 10, target)
    assert not out["valid"]
    assert "validation failed" in out["reason"] and out["num_bad_elements"] >= 1
    assert _cpu.stream(1 << 16, 10, 0)["valid"]


def test_stream_full_plan_spans_llc(cfg):
    probe = cpu_probes()["stream"]
    full = ProbeConfig(device=cfg.device)
    specs = probe.plan(full)
    llc = cfg.device["properties"]["llc_bytes"]
    sizes = [s.params["n_elements"] * 8 for s in specs]
    assert sizes[0] <= llc // 8 + 512 and (sizes[-1] >= 4 * llc or specs[-1].params["top_bounded_by_memory"])


def test_l2_warm_and_cold(cfg):
    probe = cpu_probes()["l2"]
    specs = probe.plan(cfg)
    assert {s.params["mode"] for s in specs} == {"warm", "cold"}
    for spec in (specs[0], specs[-1]):
        (row,) = _rows(probe, spec)
        assert row["valid"] and row["checksum"] == row["checksum_expected"] > 0
        assert row["bytes"] == row["working_set_bytes"] * row["passes"]


def test_l2_full_sweep_steps():
    sizes = geometric(16 * 1024, 4 * 32 * 2**20, 1.25, align=4096)
    assert sizes[0] == 16384 and sizes[-1] == 128 * 2**20
    ratios = np.array(sizes[1:]) / np.array(sizes[:-1])
    assert np.all(ratios > 1.05) and np.all(ratios < 1.4)


def test_launch_kinds(cfg):
    probe = cpu_probes()["launch"]
    specs = probe.plan(cfg)
    kinds = {s.params["kind"] for s in specs}
    assert {"omp_fork_join", "py_ext_call"} <= kinds
    for spec in specs:
        (row,) = _rows(probe, spec)
        assert row["valid"] and row["per_launch_s_min"] <= row["per_launch_s_median"]
        assert row["per_launch_s_median"] < 0.05


def test_peak_checksum_and_spec(cfg):
    probe = cpu_probes()["peak"]
    for spec in probe.plan(cfg):
        (row,) = _rows(probe, spec)
        assert row["valid"], row.get("invalid_reason")
        if row["unit"] == "vector_fma":
            assert row["flops"] == pytest.approx(2 * row["iters"] * row["accumulators"] * row["lanes"] * row["threads"])
            assert row["spec_tflops"] > 0 and row["pct_of_spec"] > 0
        else:
            assert row["clock_mhz_measured"] > 100


# One thread's FMA loop and the clock, in a fresh process (OpenMP fixes its team size at first use).
FMA_ONE_THREAD = """
import json
from gpubench import _cpu
from gpubench.hostinfo import host_cpu
from gpubench.backends.cpu.probes.peak import measured_clock_mhz
h = host_cpu()
for dtype, size in (("fp64", 8), ("fp32", 4)):
    _cpu.peak_fma(dtype, 50000, 2)
    out = _cpu.peak_fma(dtype, 50000, 40)
    mhz, _ = measured_clock_mhz()
    per_core_at_mhz = h.peak_flops(size) / h.num_cpus * mhz / h.clock_mhz
    print(json.dumps({"dtype": dtype, "threads": out["threads"], "share": out["flops_per_rep"] / min(out["times_s"]) / per_core_at_mhz,
                      "formula": f"{h.fp_lanes(size)} lanes x {h.fma_units_per_core} FMA units x 2 x {mhz:.0f} MHz"}))
"""


def test_the_fma_loop_reaches_the_spec_at_its_measured_clock():
    """The spec's FMA units per core, checked on this host: one thread's best repetition, at the
    measured clock, lands near 100 % of lanes x units x 2 per core. A wrong unit count shows as
    ~50 % (Zen 4 counted with two 512-bit units) or ~200 %. One thread, not the team: two vCPUs
    the hypervisor places on one core's hyperthreads share its FMA units (CI saw the team at 61 %).
    Best of up to three tries, so a neighbour's burst does not fail it; a wrong count fails them all."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for attempt in range(3):
        res = subprocess.run([sys.executable, "-c", FMA_ONE_THREAD], capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        rows = [json.loads(line) for line in res.stdout.splitlines()]
        assert [r["threads"] for r in rows] == [1, 1]
        if all(0.7 <= r["share"] <= 1.1 for r in rows):
            return
    pytest.fail("; ".join(f"{r['dtype']}: {r['share']:.0%} of {r['formula']}" for r in rows))


def test_fma_units_per_core_by_microarchitecture():
    from gpubench.hostinfo import fma_units_per_core

    assert fma_units_per_core("AuthenticAMD", "25", 512)[0] == 1    # Zen 4: 2 x 256-bit pipes
    assert fma_units_per_core("AuthenticAMD", "25", 256)[0] == 2    # Zen 3
    assert fma_units_per_core("AuthenticAMD", "26", 512)[0] == 2    # Zen 5 server
    assert fma_units_per_core("GenuineIntel", "6", 512)[0] == 2     # Xeon Gold/Platinum
    assert fma_units_per_core("", "", 128)[0] == 2


def test_gemm_valid_and_flops(cfg):
    probe = cpu_probes()["gemm"]
    specs = probe.plan(cfg)
    assert {s.params["dtype"] for s in specs} == {"fp32", "fp64"}
    (row,) = _rows(probe, specs[0])
    assert row["valid"] and row["flops"] == 2 * row["m"] * row["n"] * row["k"]
    assert row["library"].startswith("numpy-blas:") and row["max_abs_err"] <= row["tol"]


def test_gemm_check_catches_a_wrong_product():
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (8, 64)).astype(np.float32)
    w = rng.uniform(-1, 1, (32, 64)).astype(np.float32)
    c = a @ w.T
    assert _check(a, w, c, np.random.default_rng(1))[2]
    c[:, :] += 0.01
    assert not _check(a, w, c, np.random.default_rng(1))[2]


def test_dependent_add_clock_is_plausible():
    times = _cpu.dependent_add_seconds(20000, 10)
    mhz = 32 * 20000 / min(times) / 1e6
    assert 200 < mhz < 7000
