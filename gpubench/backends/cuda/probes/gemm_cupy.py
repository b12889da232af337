"""Library GEMM through CuPy's cuBLAS, for a GPU machine whose torch has no CUDA (or no torch at all).

The method is the torch path's (``gemm.torch_gemm``): the same weight rotation over 2x L2, the same
estimate-then-budget repetition count, short calls timed inside one captured graph, longer ones as
an event pair per call queued behind a device-side spin, the same float64 check on a row sample.
CuPy is imported only here and only when a run selects it, so gpubench imports without it.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys

from common import errors
from gpubench.backends.cuda.extension import NUM_WARMUP
from gpubench.backends.cuda.probes.gemm_common import GRAPH_CALLS, GRAPH_TIMING_BELOW_S, gemm_check_result, weight_copies

CUPY_LIBRARY = "cupy-cublas"
# CuPy has no bfloat16 array dtype, so the bf16 rows (and the clock-droop rows, which are bf16)
# cannot be taken through it.
CUPY_DTYPES = ("fp16", "tf32")

# A one-thread spin kernel: CuPy has no torch.cuda._sleep, and the event pairs must be queued while
# the device is busy so that host enqueue gaps do not enter them.
_SPIN_SOURCE = r"""
extern "C" __global__ void gpubench_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def import_cupy() -> tuple[object | None, str]:
    """(the cupy module, "") when CuPy is installed and sees a device, else (None, reason)."""
    if "cupy" not in sys.modules and importlib.util.find_spec("cupy") is not None:
        # CuPy decides once, at import, whether float32 matmuls may use TF32 (there is no public
        # switch afterwards); the tf32 rows need it and no other GEMM here is float32.
        os.environ["CUPY_TF32"] = "1"
    try:
        import cupy
    except ImportError as exc:
        return None, f"not importable: {exc}; pip install cupy-cuda12x"
    try:
        available = bool(cupy.cuda.is_available())
    except Exception as exc:  # noqa: BLE001 - a broken driver or runtime: say which, skip the probe
        return None, f"cupy {cupy.__version__} cannot reach a device: {str(exc).splitlines()[0][:120]}"
    if not available:
        return None, f"cupy {cupy.__version__} sees no CUDA device"
    return cupy, ""


def tf32_enabled() -> bool:
    """Whether CuPy was imported with TF32 allowed for float32 matmuls."""
    return os.environ.get("CUPY_TF32") == "1"


def cupy_gemm(cupy, index: int, dtype: str, m: int, n: int, k: int, *, num_reps: int, budget_s: float,
              l2_bytes: int, clock_khz: float) -> dict:
    """Time ``cupy.matmul(A, W.T, out=C)`` (W stored [N, K], TN as engines call it) on device ``index``; the
    same result dict as ``torch_gemm``."""

    cp = cupy
    cdt = {"fp16": cp.float16, "tf32": cp.float32}[dtype]
    elem = cp.dtype(cdt).itemsize
    copies = weight_copies(k * n * elem, l2_bytes)
    need = (m * k + copies * k * n + m * n) * elem
    with cp.cuda.Device(index):
        free, _ = cp.cuda.runtime.memGetInfo()
        if need > 0.9 * free:
            raise errors.DeviceMemoryError(f"cuda:{index}: gemm {m}x{n}x{k} {dtype} needs {need} bytes of device "
                                           f"memory but only {free} bytes are free")
        rng = cp.random.RandomState(1234 + m + n + k)
        a = (rng.random_sample((m, k), dtype=cp.float32) * 2 - 1).astype(cdt)
        # [N, K] weights multiplied through their transposed views: the TN call engines make
        bs = [(rng.random_sample((n, k), dtype=cp.float32) * 2 - 1).astype(cdt).T for _ in range(copies)]
        c = cp.empty((m, n), dtype=cdt)
        # Capture needs a stream other than the legacy default one; everything runs on this one.
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            # Estimate one call (after cuBLAS picked its kernel) to turn the budget into a count.
            for i in range(3):
                cp.matmul(a, bs[i % copies], out=c)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for i in range(3):
                cp.matmul(a, bs[i % copies], out=c)
            e1.record(stream)
            e1.synchronize()
            t_est = max(cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / 3, 1e-7)
            reps = int(min(2000, max(num_reps, math.ceil(budget_s / t_est))))
            timing, last_b = "event pair per call", (reps + NUM_WARMUP - 1) % copies
            times = None
            if t_est < GRAPH_TIMING_BELOW_S:
                try:
                    times = _graph_timed_matmuls(cp, a, bs, c, reps + NUM_WARMUP, stream, GRAPH_CALLS)[NUM_WARMUP:]
                    timing, last_b = f"one CUDA-graph replay of {GRAPH_CALLS} calls", (GRAPH_CALLS - 1) % copies
                except RuntimeError as exc:  # capture not possible here: say so, time call by call
                    timing = f"event pair per call (graph capture failed: {str(exc).splitlines()[0][:120]})"
            if times is None:
                times = _timed_matmuls(cp, a, bs, c, reps + NUM_WARMUP, stream, clock_khz)[NUM_WARMUP:]
            check = check_gemm_cupy(cp, a, bs[last_b], c, dtype)
    return {"times_s": times, "num_weight_copies": copies, "bytes": (m * k + k * n + m * n) * elem,
            "library": CUPY_LIBRARY, "library_version": f"cupy {cp.__version__}", "timing": timing, "layout": "TN",
            **check}


def check_gemm_cupy(cp, a, b, c, dtype: str, max_rows: int = 64) -> dict:
    """``gemm.check_gemm`` on CuPy arrays: up to ``max_rows`` evenly spaced rows against float64."""

    m, k = a.shape
    rows = cp.unique(cp.linspace(0, m - 1, num=min(m, max_rows)).astype(cp.int64))
    ref = a[rows].astype(cp.float64) @ b.astype(cp.float64)
    err = float(cp.abs(c[rows].astype(cp.float64) - ref).max())
    return gemm_check_result(err, dtype, k, len(rows))


def _graph_timed_matmuls(cp, a, bs, c, total: int, stream, graph_calls: int) -> list[float]:
    """Per-call seconds from event-timed launches of one captured graph of ``graph_calls`` matmuls
    (cycling the weight copies); at least ``total`` calls in all. Raises RuntimeError when capture fails."""
    stream.begin_capture()
    try:
        for i in range(graph_calls):
            cp.matmul(a, bs[i % len(bs)], out=c)
    finally:
        graph = stream.end_capture()
    times: list[float] = []
    replays = -(-total // graph_calls)
    batch = 16
    for start in range(0, replays, batch):
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(min(batch, replays - start))]
        for s, e in events:
            s.record(stream)
            graph.launch(stream)
            e.record(stream)
        stream.synchronize()
        times += [cp.cuda.get_elapsed_time(s, e) * 1e-3 / graph_calls for s, e in events]
    return times


def _timed_matmuls(cp, a, bs, c, total: int, stream, clock_khz: float) -> list[float]:
    """Event-timed matmuls, queued in batches behind the spin kernel."""
    spin = cp.RawKernel(_SPIN_SOURCE, "gpubench_spin")
    times: list[float] = []
    batch = 64
    for start in range(0, total, batch):
        num = min(batch, total - start)
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(num)]
        # ~40 us of host enqueue per matmul, covered by the spin so the device never waits on the host.
        spin((1,), (1,), (cp.int64(int(num * 40e-6 * clock_khz * 1e3)),), stream=stream)
        for i, (s, e) in enumerate(events):
            s.record(stream)
            cp.matmul(a, bs[(start + i) % len(bs)], out=c)
            e.record(stream)
        stream.synchronize()
        times += [cp.cuda.get_elapsed_time(s, e) * 1e-3 for s, e in events]
    return times
