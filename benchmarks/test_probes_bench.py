"""Probe speed figures with pytest-benchmark (cheap sizes; figures of merit in extra_info).

Run: .venv/bin/python -m pytest benchmarks/test_probes_bench.py --benchmark-only
"""
from __future__ import annotations

import pytest

from gpubench import _cpu
from gpubench.hostinfo import host_cpu

pytest.importorskip("pytest_benchmark")


def _info(benchmark, **kw):
    benchmark.extra_info.update({"device": host_cpu().model_name, "threads": _cpu.max_threads(), **kw})


def test_stream_triad_in_llc(benchmark):
    """STREAM sequence on 1 MiB arrays (in cache): the triad GB/s of the best rep."""
    n = 1 << 17
    out = benchmark.pedantic(_cpu.stream, args=(n, 10, 0), rounds=5, warmup_rounds=1)
    assert out["valid"]
    _info(benchmark, n_elements=n, triad_gbps_best=3 * 8 * n / min(out["triad"][1:]) / 1e9)


def test_omp_fork_join(benchmark):
    """1000 empty parallel regions: per-region microseconds."""
    times = benchmark.pedantic(_cpu.omp_fork_join, args=(1000, 5), rounds=5, warmup_rounds=1)
    _info(benchmark, fork_join_us_min=min(times) / 1000 * 1e6)


def test_peak_fma_fp64(benchmark):
    """FMA chains, fp64, ~2 ms reps: GFLOP/s of the best rep."""
    out = benchmark.pedantic(_cpu.peak_fma, args=("fp64", 100_000, 10), rounds=3, warmup_rounds=1)
    assert out["valid"]
    _info(benchmark, gflops_best=out["flops_per_rep"] / min(out["times_s"]) / 1e9)
