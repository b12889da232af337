"""Library GEMM (cuBLAS through torch, else through CuPy) over Llama-3.1-8B shapes, and how its calls are timed."""
from __future__ import annotations

import math

from common import errors
from gpubench.backends.base import Backend, MeasurementSpec, ProbeConfig
from gpubench.backends.cuda.extension import NUM_WARMUP
from gpubench.backends.cuda.probes.common import CudaProbe, probe_row, spec_tflops
from gpubench.backends.cuda.probes.gemm_common import (  # noqa: F401 (re-exported: the backend's public names)
    GEMM_EPS,
    GRAPH_CALLS,
    GRAPH_TIMING_BELOW_S,
    gemm_check_result,
    gemm_tolerance,
    weight_copies,
)
from gpubench.backends.cuda.probes.gemm_cupy import CUPY_DTYPES, CUPY_LIBRARY, cupy_gemm, import_cupy, tf32_enabled
from gpubench.backends.probe_common import opt

# Llama-3.1-8B projections (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, head_dim 128),
# fixed here because gpubench must not import predictor; plus one square shape.
GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "square": (8192, 8192)}
GEMM_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192, 16384)
QUICK_GEMM_M = (1, 16, 128, 512, 2048, 16384)
GEMM_DTYPES = ("bf16", "fp16", "tf32")
DROOP_M = 16384
TORCH_LIBRARY = "torch-cublas"


def gemm_library() -> tuple[str | None, str]:
    """The library path GEMM takes on this machine: ("torch-cublas", "") when torch sees a CUDA
    device, else ("cupy-cublas", "") when CuPy does, else (None, why neither can). Checked at run time."""
    try:
        import torch
    except ImportError:
        torch_reason = "torch is not installed"
    else:
        if torch.cuda.is_available():
            return TORCH_LIBRARY, ""
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but sees no device"
        torch_reason = f"torch {torch.__version__} is {build}"
    # A torch-free (or CPU-torch) install on a GPU machine still gets library GEMM through CuPy.
    cupy, cupy_reason = import_cupy()
    if cupy is not None:
        return CUPY_LIBRARY, ""
    return None, f"no CUDA torch ({torch_reason}) and no usable CuPy ({cupy_reason}); cuBLAS is not linked in gpubench._cuda"


class GemmProbe(CudaProbe):
    """Library GEMM (cuBLAS through torch, else CuPy) over Llama-3.1-8B shapes, called as engines call it.

    ``C[M, N] = A[M, K] @ W[N, K]^T`` in bf16 and fp16 (fp32 accumulate) and tf32, M from 1 to 16384:
    the weight is stored as ``nn.Linear`` stores it ([N, K], row-major) and multiplied through its
    transposed view, which is the cuBLAS call ``F.linear`` makes (TN in cuBLAS's column-major terms;
    an NN ``A @ B`` with B stored [K, N] picks other kernels for some shapes). Rows say ``layout: TN``.
    FLOPs = 2 M N K; bytes = A, B and C once. The weight B is rotated among copies covering 2x L2 so
    repetitions stream it from memory. Repetitions are queued behind ``torch.cuda._sleep`` so host
    enqueue gaps do not enter event intervals; their count comes from a time budget (0.2 s, 2 s for
    the bf16 M = 16384 rows that clock droop is read from). Validation: up to 64 rows of C against a
    float64 product on the device, |err| <= 8 eps sqrt(K) for inputs in [-1, 1].

    The library path (``gemm_library``) is chosen once per probe object, i.e. once per run, so
    every row of a run comes from the same library; each row records it in ``library``. CuPy has
    no bfloat16, so on its path the bf16 rows (the droop rows among them) are left out with a note.
    """

    name = "gemm"
    description = "cuBLAS GEMM via torch (else CuPy) over Llama-3.1-8B shapes, bf16/fp16/tf32, float64-checked"
    timer = "cuda_events"
    time_budget_s = 600.0

    _selected: tuple[str | None, str] | None = None

    def library(self) -> tuple[str | None, str]:
        """``gemm_library()``, asked once: plan and measure must not switch library mid-run."""
        if self._selected is None:
            self._selected = gemm_library()
        return self._selected

    def supported(self, backend: Backend) -> tuple[bool, str]:
        lib, reason = self.library()
        return (lib is not None), reason

    def dtypes(self) -> tuple[str, ...]:
        if self.library()[0] != CUPY_LIBRARY:
            return GEMM_DTYPES
        return tuple(d for d in GEMM_DTYPES if d in CUPY_DTYPES and (d != "tf32" or tf32_enabled()))

    def notes(self, cfg: ProbeConfig) -> list[str]:
        if self.library()[0] != CUPY_LIBRARY:
            return []
        notes = ["bf16 left out: CuPy has no bfloat16 dtype (so no clock-droop rows)"]
        if not tf32_enabled():
            notes.append("tf32 left out: CuPy was imported before gpubench with CUPY_TF32 unset")
        return notes

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        ms = QUICK_GEMM_M if cfg.quick else GEMM_M
        max_m = opt(cfg, "gemm", "max_m", max(ms))
        scale = opt(cfg, "gemm", "shape_scale", 1.0)  # tests shrink N and K
        reps = max(10, opt(cfg, "gemm", "num_reps", cfg.num_reps))
        budget_s = opt(cfg, "gemm", "budget_s", 0.2)
        droop_budget_s = opt(cfg, "gemm", "droop_budget_s", 1.0 if cfg.quick else 2.0)
        specs = []
        for dtype in self.dtypes():
            # --quick: every M in bf16 (the droop rows too); two M values in fp16 and tf32.
            dms = ms if (dtype == "bf16" or not cfg.quick) else (16, 2048)
            for shape, (n0, k0) in GEMM_SHAPES.items():
                n, k = (max(8, int(v * scale)) for v in (n0, k0))
                for m in dms:
                    if m > max_m:
                        continue
                    droop = dtype == "bf16" and m == DROOP_M
                    specs.append(MeasurementSpec(
                        key=f"gemm_{shape}_{dtype}_{m}x{n}x{k}",
                        params={"dtype": dtype, "m": m, "n": n, "k": k, "shape": shape, "num_reps": reps,
                                "budget_s": droop_budget_s if droop else budget_s},
                        label=f"{dtype} {shape} M={m}"))
        return specs

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        timing_args = {"num_reps": p["num_reps"], "budget_s": p["budget_s"],
                       "l2_bytes": int(self.backend.properties.get("l2_bytes", 0)),
                       "clock_khz": float(self.backend.properties.get("clock_khz", 1.5e6))}
        if self.library()[0] == CUPY_LIBRARY:
            cupy, _ = import_cupy()
            res = cupy_gemm(cupy, self.backend.index, p["dtype"], p["m"], p["n"], p["k"], **timing_args)
        else:
            res = torch_gemm(self.backend.index, p["dtype"], p["m"], p["n"], p["k"], **timing_args)
        source = "square" if p["shape"] == "square" else f"llama-3.1-8b:{p['shape']}"
        return probe_row(spec.key, res, "cuda_events", dtype=p["dtype"], m=p["m"], n=p["n"], k=p["k"], shape=p["shape"],
                    flops=2.0 * p["m"] * p["n"] * p["k"], bytes=res["bytes"], library=res["library"],
                    library_version=res["library_version"],
                    shape_source=source, max_abs_err=res["max_abs_err"], tol=res["tol"],
                    num_weight_copies=res["num_weight_copies"], droop_row=p["dtype"] == "bf16" and p["m"] == DROOP_M,
                    timing=res.get("timing"), layout=res.get("layout", "NN"),
                    spec_tflops=spec_tflops(self.backend.sku, p["dtype"]))




def torch_gemm(index: int, dtype: str, m: int, n: int, k: int, *, num_reps: int, budget_s: float,
               l2_bytes: int, clock_khz: float) -> dict:
    """Time ``A @ W.t()`` into C on cuda:index with W stored [N, K] (``F.linear``'s cuBLAS call, TN);
    returns times_s, valid, check, errors."""
    import torch

    dev = torch.device("cuda", index)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}[dtype]
    elem = torch.tensor([], dtype=tdt).element_size()
    b_bytes = k * n * elem
    copies = weight_copies(b_bytes, l2_bytes)
    need = (m * k + copies * k * n + m * n) * elem
    free, _ = torch.cuda.mem_get_info(dev)
    if need > 0.9 * free:
        raise errors.DeviceMemoryError(f"cuda:{index}: gemm {m}x{n}x{k} {dtype} needs {need} bytes of device memory "
                                       f"but only {free} bytes are free")
    gen = torch.Generator(device=dev).manual_seed(1234 + m + n + k)
    a = (torch.rand(m, k, device=dev, generator=gen) * 2 - 1).to(tdt)
    # Weights as nn.Linear holds them, [N, K]; the calls below multiply by their transposed views, as
    # F.linear does (aten::linear -> mm(A, W.t())).
    bs = [(torch.rand(n, k, device=dev, generator=gen) * 2 - 1).to(tdt).t() for _ in range(copies)]
    c = torch.empty(m, n, device=dev, dtype=tdt)
    stream = torch.cuda.current_stream(dev)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        with torch.cuda.device(dev):
            # Estimate one call (after cuBLAS picked its kernel) to turn the budget into a count.
            for i in range(3):
                torch.matmul(a, bs[i % copies], out=c)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            for i in range(3):
                torch.matmul(a, bs[i % copies], out=c)
            e1.record(stream)
            torch.cuda.synchronize(dev)
            t_est = max(e0.elapsed_time(e1) * 1e-3 / 3, 1e-7)
            reps = int(min(2000, max(num_reps, math.ceil(budget_s / t_est))))
            timing, last_b = "event pair per call", (reps + NUM_WARMUP - 1) % copies
            times = None
            if t_est < GRAPH_TIMING_BELOW_S:
                # A call this short is of the order of an event pair's own cost: time one graph
                # replay of GRAPH_CALLS calls instead, and report the per-call mean of each replay.
                try:
                    times = _graph_timed_matmuls(torch, a, bs, c, reps + NUM_WARMUP, stream)[NUM_WARMUP:]
                    timing, last_b = f"one CUDA-graph replay of {GRAPH_CALLS} calls", (GRAPH_CALLS - 1) % copies
                except RuntimeError as exc:  # capture not possible here: say so, time call by call
                    timing = f"event pair per call (graph capture failed: {str(exc).splitlines()[0][:120]})"
            if times is None:
                times = _timed_matmuls(torch, a, bs, c, reps + NUM_WARMUP, stream, clock_khz)[NUM_WARMUP:]
            check = check_gemm(a, bs[last_b], c, dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return {"times_s": times, "num_weight_copies": copies, "bytes": (m * k + k * n + m * n) * elem,
            "library": TORCH_LIBRARY, "library_version": f"torch {torch.__version__}", "timing": timing, "layout": "TN",
            **check}


def check_gemm(a, b, c, dtype: str, max_rows: int = 64) -> dict:
    """Compare up to ``max_rows`` evenly spaced rows of ``c`` with a float64 ``a @ b`` (any torch device).

    Returns ``valid``, ``max_abs_err``, ``tol`` (``gemm_tolerance``) and a one-line ``check``.
    """
    import torch

    m, k = a.shape
    rows = torch.linspace(0, m - 1, steps=min(m, max_rows), device=a.device).long().unique()
    ref = a[rows].double() @ b.double()
    err = float((c[rows].double() - ref).abs().max().item())
    return gemm_check_result(err, dtype, k, len(rows))






def _graph_timed_matmuls(torch, a, bs, c, total: int, stream) -> list[float]:
    """Per-call seconds from event-timed replays of one CUDA graph of ``GRAPH_CALLS`` matmuls
    (cycling the weight copies, so consecutive calls do not hit the same B in L2); at least
    ``total`` calls in all. Raises RuntimeError when capture fails."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):  # warm cuBLAS (workspace, heuristics) outside the capture
        for i in range(3):
            torch.matmul(a, bs[i % len(bs)], out=c)
    stream.wait_stream(side)
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            torch.matmul(a, bs[i % len(bs)], out=c)
    times: list[float] = []
    replays = -(-total // GRAPH_CALLS)
    batch = 16
    for start in range(0, replays, batch):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(min(batch, replays - start))]
        for s, e in events:
            s.record(stream)
            graph.replay()
            e.record(stream)
        stream.synchronize()
        times += [s.elapsed_time(e) * 1e-3 / GRAPH_CALLS for s, e in events]
    return times


def _timed_matmuls(torch, a, bs, c, total: int, stream, clock_khz: float) -> list[float]:
    """Event-timed matmuls, queued in batches behind ``torch.cuda._sleep`` (a device-side spin)."""
    times: list[float] = []
    batch = 64
    for start in range(0, total, batch):
        num = min(batch, total - start)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(num)]
        # ~40 us of host enqueue per matmul, covered by the spin so the device never waits on the host.
        torch.cuda._sleep(int(num * 40e-6 * clock_khz * 1e3))
        for i, (s, e) in enumerate(events):
            s.record(stream)
            torch.matmul(a, bs[(start + i) % len(bs)], out=c)
            e.record(stream)
        stream.synchronize()
        times += [s.elapsed_time(e) * 1e-3 for s, e in events]
    return times
