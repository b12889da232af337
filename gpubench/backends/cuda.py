"""The CUDA backend: the compiled probes of ``gpubench._cuda`` plus library GEMM through torch.

Importing this module needs no GPU and no driver (``gpubench._cuda`` links cudart statically and
is imported lazily); constructing ``CudaBackend`` is the first call, and raises
``gpubench.errors.NoDeviceError`` with the driver's reason when no device can be used.

Device properties (SM count, L2 size, clocks, memory) are read from the device at run time; the
SKU table (``gpubench.skus``) is used only for spec peaks (``spec_tflops``, ``spec_gbps``).

Probes, in the order a run takes them (docs/cuda.md):

    stream  copy/scale/add/triad, fp64 as double2, 1/8 L2 .. >= 4x L2    cuda_events, gated
    peak    mma.sync bf16 fp16 tf32 fp8 (native only), fp32 FMA; wgmma    cuda_events
    launch  host_enqueue | device_interval | launch_sync | graph_node     host_clock / cuda_events
    gemm    torch.matmul (cuBLAS) over Llama-3.1-8B shapes, bf16/fp16/tf32, checked vs float64
    l2      cold (flushed) and warm read sweeps, 64 KiB .. 8x L2          cuda_events, gated
"""
from __future__ import annotations

import math
import re
import sys
from typing import Any

from gpubench import errors, skus
from gpubench.backends.base import Backend, MeasurementSpec, Probe, ProbeConfig

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def fp8_mma_native(cc: int) -> bool:
    """fp8 ``mma.sync`` is a tensor-core QMMA on compute capability 8.9 (Ada) and 12.x (consumer
    Blackwell) only; on 9.0 and 10.x ptxas emulates it with fp16 HMMA + FADD (scripts/check_sass.py
    counts it), so a row there would credit the tensor cores with work they did not do. The same
    rule is ``fp8_mma_native`` in csrc/cuda/peak.cu."""
    return cc == 89 or cc // 10 == 12
NUM_WARMUP = 2  # untimed repetitions before the recorded ones (the stats also drop the first recorded)


# ---------------------------------------------------------------- extension access --------------

def load_extension():
    """``gpubench._cuda``, or NoDeviceError saying why it cannot be imported.

    Sets ``CUDA_MODULE_LOADING=EAGER`` (unless the user set it) before the runtime starts: with
    lazy loading (the default since CUDA 12.2) a kernel's first launch waits for the device to go
    idle, which deadlocks behind the probes' spin gate. The kernels preload themselves too
    (``preload_kernels`` in csrc/cuda); this covers a runtime the process had not started yet.
    """
    import os

    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    try:
        from gpubench import _cuda
    except ImportError as exc:
        raise errors.NoDeviceError(
            f"gpubench._cuda is not built ({exc}); rebuild with nvcc on PATH (GPUBENCH_CUDA=1 pip install -e .)"
        ) from None
    return _cuda


class Extension:
    """Calls into ``gpubench._cuda`` (or a stand-in with the same functions) with its errors mapped.

    ``NoDeviceError`` -> ``gpubench.errors.NoDeviceError``; ``DeviceMemoryError`` ->
    ``gpubench.errors.DeviceMemoryError``; ``CudaError`` (a failing CUDA call, named with file:line)
    stays a RuntimeError: it is a fault of the device or of gpubench, not of the user.
    """

    def __init__(self, module, index: int):
        self.module = module
        self.index = index

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)

        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - mapped below by the extension's own classes
                mapped = self._map(exc)
                if mapped is None:
                    raise
                raise mapped from None

        return call

    def _map(self, exc: Exception) -> Exception | None:
        no_dev = getattr(self.module, "NoDeviceError", None)
        no_mem = getattr(self.module, "DeviceMemoryError", None)
        if no_dev is not None and isinstance(exc, no_dev):
            return errors.NoDeviceError(f"cuda:{self.index}: {exc}")
        if no_mem is not None and isinstance(exc, no_mem):
            return errors.DeviceMemoryError(f"cuda:{self.index}: {exc}")
        return None


def _row(key: str, res: dict, timer: str, **fields) -> dict:
    """Row fields common to the CUDA probes from an extension result dict."""
    row = {"key": key, "timer": timer, "times_s": [float(t) for t in res["times_s"]],
           "valid": bool(res["valid"]), "check": res["check"]}
    row.update(fields)
    if not row["valid"]:
        row["invalid_reason"] = res["check"]
    return row


def _opt(cfg: ProbeConfig, probe: str, name: str, default):
    """``cfg.options["<probe>.<name>"]`` (``--set probe.name=value``) in default's type."""
    v = cfg.options.get(f"{probe}.{name}", default)
    if isinstance(default, bool):
        return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(float(v))
    if isinstance(default, float):
        return float(v)
    return v


def _geometric(lo: int, hi: int, factor: float, align: int) -> list[int]:
    """lo, lo*factor, ... (aligned, increasing), with hi itself as the last size."""
    if lo <= 0 or hi < lo or factor <= 1:
        raise errors.ConfigError(f"bad size sweep: lo={lo} hi={hi} factor={factor}")
    out, v = [], float(lo)
    while v < hi * (1 - 1e-9):
        a = max(align, int(round(v / align)) * align)
        if not out or a > out[-1]:
            out.append(a)
        v *= factor
    top = max(align, hi // align * align)
    if not out or top > out[-1]:
        out.append(top)
    return out


def _props(cfg: ProbeConfig) -> dict:
    return cfg.device.get("properties", {})


def _spec_tflops(sku: skus.SKU | None, dtype: str) -> float | None:
    if sku is None:
        return None
    try:
        return sku.peak_flops(dtype) / 1e12
    except errors.ConfigError:
        return None


# ---------------------------------------------------------------- probes ------------------------

class _CudaProbe(Probe):
    def __init__(self, backend: "CudaBackend"):
        self.backend = backend

    @property
    def ext(self) -> Extension:
        return self.backend.ext


class StreamProbe(_CudaProbe):
    """STREAM on the GPU: copy, scale, add, triad over three fp64 arrays read/written as double2.

    Sizes (each array) sweep from 1/8 of L2 to >= 4x L2 by x2 (x4 with --quick), the top bounded so
    the three arrays take at most half of the free device memory. Bytes follow STREAM (2, 2, 3, 3
    arrays x n x 8; write-allocate not counted). Device time by CUDA events with the four kernels of
    a repetition queued behind a spin gate. Headline: best (min time), median kept. The arrays are
    checked on the device against a golden replay of the whole kernel sequence; a mismatch makes
    all four rows of that size invalid.
    """

    name = "stream"
    description = "STREAM copy/scale/add/triad, fp64 as double2, CUDA events, golden check on device"
    timer = "cuda_events"
    time_budget_s = 300.0
    KERNEL_ARRAYS = {"copy": 2, "scale": 2, "add": 3, "triad": 3}

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        p = _props(cfg)
        l2 = int(p.get("l2_bytes") or 0)
        if l2 <= 0:
            raise errors.ConfigError("stream: the device reported no L2 size (cudaDevAttrL2CacheSize)")
        lo = _opt(cfg, "stream", "min_array_bytes", l2 // 8)
        hi = _opt(cfg, "stream", "max_array_bytes", 4 * l2)
        free = int(p.get("free_mem_bytes") or 0)
        self._bounded = bool(free and 3 * hi > free // 2)
        if self._bounded:
            hi = free // 6
        # 100 repetitions (BabelStream's default), not 10: the first ones run while the clocks ramp.
        reps = max(100, _opt(cfg, "stream", "num_reps", cfg.num_reps))
        specs = []
        for array_bytes in _geometric(lo, max(lo, hi), 4.0 if cfg.quick else 2.0, align=4 * KiB):
            n = array_bytes // 8
            specs.append(MeasurementSpec(
                key=f"stream_fp64_{n}", params={"n_elements": n, "num_reps": reps},
                label=f"{array_bytes / MiB:.1f} MiB x 3",
                row_keys=tuple(f"stream_{k}_fp64_{n}" for k in self.KERNEL_ARRAYS)))
        return specs

    def notes(self, cfg: ProbeConfig) -> list[str]:
        self.plan(cfg)
        return ["largest array bounded by free device memory (< 4x L2)"] if self._bounded else []

    def measure(self, spec: MeasurementSpec) -> list[dict]:
        n, reps = spec.params["n_elements"], spec.params["num_reps"]
        out = self.ext.stream(self.backend.index, n, reps, NUM_WARMUP)
        spec_gbps = self.backend.sku.memory_bw_gbs if self.backend.sku else None
        rows = []
        for kernel in self.KERNEL_ARRAYS:
            r = out[kernel]
            rows.append(_row(
                f"stream_{kernel}_fp64_{n}", r, "cuda_events", kernel=kernel, dtype="fp64", n_elements=n,
                array_bytes=int(r["array_bytes"]), bytes=int(r["bytes"]), threads=int(r["grid"] * r["block"]),
                grid=int(r["grid"]), block=int(r["block"]), write_allocate_counted=False, spec_gbps=spec_gbps))
        return rows


class L2Probe(_CudaProbe):
    """Read bandwidth against working set, 64 KiB .. 8x L2 by x1.25 (4x L2 by x2 with --quick).

    Loads bypass L1 (``ld.global.cg``). ``cold``: before each timed single pass a clean buffer of
    >= 2x L2 is read, so the pass finds none of the set in L2 and no dirty line to write back.
    ``warm``: after an untimed pass, each repetition makes ``passes`` passes over the same set
    (about 4 GiB read, 512 MiB with --quick; the cache is not flushed on purpose). --quick sweeps
    to 4x L2. Bytes = bytes read per repetition. Each repetition's sum is checked.
    """

    name = "l2"
    description = "L2/DRAM read bandwidth vs working set, cold (flushed) and warm"
    timer = "cuda_events"
    time_budget_s = 300.0
    MODES = ("cold", "warm")

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        p = _props(cfg)
        l2 = int(p.get("l2_bytes") or 0)
        if l2 <= 0:
            raise errors.ConfigError("l2: the device reported no L2 size (cudaDevAttrL2CacheSize)")
        lo = _opt(cfg, "l2", "min_bytes", 64 * KiB)
        # --quick caps the sweep at 4x L2 and 512 MiB read per warm repetition: the full settings read
        # ~780 GB on an H200 (100-150 s), more than a short device window can spend on one probe.
        hi = _opt(cfg, "l2", "max_bytes", (4 if cfg.quick else 8) * l2)
        warm_bytes = _opt(cfg, "l2", "warm_bytes_per_rep", (GiB // 2) if cfg.quick else 4 * GiB)
        reps = max(10, _opt(cfg, "l2", "num_reps", cfg.num_reps))
        specs = []
        for ws in _geometric(lo, max(lo, hi), 2.0 if cfg.quick else 1.25, align=4 * KiB):
            for mode in self.MODES:
                passes = 1 if mode == "cold" else max(2, math.ceil(warm_bytes / ws))
                specs.append(MeasurementSpec(
                    key=f"l2_{mode}_fp64_{ws}", params={"mode": mode, "bytes": ws, "passes": passes, "num_reps": reps},
                    label=f"{mode} {ws / MiB:.2f} MiB"))
        return specs

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        r = self.ext.l2(self.backend.index, p["bytes"], p["mode"], p["passes"], p["num_reps"], NUM_WARMUP)
        l2 = int(r["l2_bytes"])
        return _row(spec.key, r, "cuda_events", mode=p["mode"], dtype="fp64", working_set_bytes=p["bytes"],
                    bytes=int(r["bytes"]), passes=int(r["passes"]), l2_bytes=l2,
                    working_set_over_l2=p["bytes"] / l2 if l2 else None, flush_bytes=int(r["flush_bytes"]),
                    grid=int(r["grid"]), block=int(r["block"]))


class LaunchProbe(_CudaProbe):
    """The four launch costs, reported apart (each row: ``count`` empty kernels per repetition).

    ``host_enqueue`` (host clock; queued behind a spin gate), ``device_interval`` (CUDA events
    around back-to-back kernels behind the gate: enqueue excluded), ``launch_sync`` (host clock
    around launch + synchronize), ``graph_node`` (events around one replay of a graph of ``count``
    kernels). Per-launch figures divide by ``count``.
    """

    name = "launch"
    description = "kernel launch: host enqueue, device interval, launch+sync, CUDA-graph node"
    timer = "cuda_events"
    time_budget_s = 120.0
    COUNTS = {"host_enqueue": (1, 16, 256), "device_interval": (1, 16, 256), "launch_sync": (1, 16, 256),
              "graph_node": (1, 16, 256, 4096)}
    QUICK_COUNTS = {"host_enqueue": (1, 256), "device_interval": (1, 256), "launch_sync": (1, 64),
                    "graph_node": (256, 4096)}
    TIMERS = {"host_enqueue": "host_clock", "device_interval": "cuda_events", "launch_sync": "host_clock",
              "graph_node": "cuda_events"}

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        reps = max(30, _opt(cfg, "launch", "num_reps", cfg.num_reps))
        table = self.QUICK_COUNTS if cfg.quick else self.COUNTS
        return [MeasurementSpec(key=f"launch_{kind}_{count}", params={"kind": kind, "count": count, "num_reps": reps},
                                label=f"{kind} x{count}")
                for kind, counts in table.items() for count in counts]

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        r = self.ext.launch(self.backend.index, p["kind"], p["count"], p["num_reps"], NUM_WARMUP)
        return _row(spec.key, r, self.TIMERS[p["kind"]], kind=p["kind"], count=p["count"],
                    gated=bool(r.get("gated", 0)))

    def derive(self, row: dict, summary: dict) -> dict[str, Any]:
        c = row["count"]
        return {"per_launch_s_median": summary["t_median_s"] / c, "per_launch_s_min": summary["t_min_s"] / c,
                "per_launch_us_median": summary["t_median_s"] / c * 1e6}


class PeakProbe(_CudaProbe):
    """Compute ceilings with operands in registers: tensor-core ``mma.sync`` per dtype, fp32 FMA.

    bf16 and fp16 (m16n8k16, fp32 accumulate), tf32 (m16n8k8), fp8 e4m3 (m16n8k32, where it is a
    native QMMA: compute capability 8.9 and 12.x; left out with a note elsewhere, emulated on 9.0
    and 10.x, absent before 8.9), fp32 FMA on CUDA cores; on compute
    capability 9.0 also ``wgmma`` bf16 (m64n128k16, B in shared memory), the only instruction that
    reaches Hopper's tensor-core peak (needs a build with sm_90a code). About 20 ms per repetition.
    Every accumulator is checked exactly (csrc/cuda/peak.cu, wgmma.cu). ``spec_tflops`` is the SKU
    identity at its spec clock; compare with ``clock_mhz_mean`` for the share at the real clock.
    """

    name = "peak"
    description = "tensor-core mma.sync (bf16, fp16, tf32, fp8) and fp32 FMA ceilings"
    timer = "cuda_events"
    time_budget_s = 120.0
    DTYPES = ("bf16", "fp16", "tf32", "fp8", "fp32")
    MIN_CC = {"fp8": 89}

    def _cc(self, cfg: ProbeConfig) -> int:
        p = _props(cfg)
        return int(p.get("cc_major", 0)) * 10 + int(p.get("cc_minor", 0))

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        reps = max(10, _opt(cfg, "peak", "num_reps", cfg.num_reps))
        target_s = _opt(cfg, "peak", "target_s", 0.02)
        cc = self._cc(cfg)
        specs = [MeasurementSpec(key=f"peak_{'fma' if d == 'fp32' else 'mma'}_{d}",
                                 params={"dtype": d, "num_reps": reps, "target_s": target_s, "instruction":
                                         "fma.rn.f32" if d == "fp32" else "mma.sync"}, label=d)
                 for d in self.DTYPES if cc >= self.MIN_CC.get(d, 0) and (d != "fp8" or fp8_mma_native(cc))]
        if cc == 90:  # last: a fault in the sm_90a-only kernel must not cost the other rows
            specs.append(MeasurementSpec(key="peak_wgmma_bf16", label="bf16 wgmma", params={
                "dtype": "bf16", "num_reps": reps, "target_s": target_s, "instruction": "wgmma"}))
        return specs

    def notes(self, cfg: ProbeConfig) -> list[str]:
        cc = self._cc(cfg)
        notes = [f"{d} left out: needs compute capability {m // 10}.{m % 10}+ (device is {cc // 10}.{cc % 10})"
                 for d, m in self.MIN_CC.items() if cc < m]
        if cc >= self.MIN_CC["fp8"] and not fp8_mma_native(cc):
            notes.append(f"fp8 left out: mma.sync e4m3 is emulated on compute capability {cc // 10}.{cc % 10} "
                         "(fp16 HMMA + FADD; native only on 8.9 and 12.x)")
        return notes

    def measure(self, spec: MeasurementSpec) -> dict | list:
        p = spec.params
        instruction = p.get("instruction", "mma.sync")
        if instruction == "wgmma":
            r = self.ext.peak_wgmma(self.backend.index, p["num_reps"], NUM_WARMUP, p["target_s"])
        else:
            r = self.ext.peak(self.backend.index, p["dtype"], p["num_reps"], NUM_WARMUP, p["target_s"])
        if not r.get("supported", 1):
            # The device has the dtype but this build has no code for it (e.g. built for sm_80 only and
            # run on an sm_90 part): skip the row, say why on stderr (the worker's log), keep going.
            print(f"gpubench: peak {p['dtype']} {instruction}: {r['check']}", file=sys.stderr)
            return []
        sku = self.backend.sku
        return _row(spec.key, r, "cuda_events", dtype=p["dtype"],
                    unit="cuda_core" if p["dtype"] == "fp32" else "tensor_core", flops=float(r["flops"]),
                    iters=int(r["iters"]), grid=int(r["grid"]), block=int(r["block"]),
                    spec_tflops=_spec_tflops(sku, p["dtype"]),
                    spec_clock_mhz=(sku.max_boost_mhz if p["dtype"] == "fp32" else sku.spec_clock_mhz) if sku else None,
                    spec_formula=_spec_formula(sku, p["dtype"]),
                    instruction=instruction)

    def derive(self, row: dict, summary: dict) -> dict[str, Any]:
        out = super().derive(row, summary)
        spec = row.get("spec_tflops")
        out["pct_of_spec"] = 100.0 * out["tflops_best"] / spec if spec else None
        return out


def _spec_formula(sku: skus.SKU | None, dtype: str) -> str | None:
    """The SKU identity behind spec_tflops, spelled out (SMs x units x FMA/clk x 2 x clock)."""
    if sku is None or _spec_tflops(sku, dtype) is None:
        return None
    if dtype == "fp32":
        return f"{sku.sm_count} SM x {sku.fp32_fma_per_sm_per_clk} FMA/clk x 2 x {sku.max_boost_mhz:.0f} MHz"
    return (f"{sku.sm_count} SM x {sku.tensor_cores_per_sm} TC x {sku.fma_per_tc_per_clk[dtype]} FMA/clk x 2 x "
            f"{sku.spec_clock_mhz:.0f} MHz")


# Llama-3.1-8B projections (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, head_dim 128),
# fixed here because gpubench must not import predictor; plus one square shape.
GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "square": (8192, 8192)}
GEMM_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192, 16384)
QUICK_GEMM_M = (1, 16, 128, 512, 2048, 16384)
GEMM_DTYPES = ("bf16", "fp16", "tf32")
# Unit roundoff of the inputs (tf32 keeps 10 mantissa bits) for the validation tolerance.
GEMM_EPS = {"bf16": 2.0**-8, "fp16": 2.0**-11, "tf32": 2.0**-11}
DROOP_M = 16384


def gemm_library() -> tuple[str | None, str]:
    """(library, "") when GEMM can run on the GPU, else (None, reason). Checked at run time."""
    try:
        import torch
    except ImportError:
        return None, "no CUDA torch (torch is not installed); cuBLAS is not linked in gpubench._cuda"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but sees no device"
        return None, f"no CUDA torch (torch {torch.__version__} is {build}); cuBLAS is not linked in gpubench._cuda"
    return "torch", ""


class GemmProbe(_CudaProbe):
    """Library GEMM (cuBLAS through ``torch.matmul``) over Llama-3.1-8B decode/prefill shapes.

    ``C[M, N] = A[M, K] @ B[K, N]`` in bf16 and fp16 (fp32 accumulate) and tf32, M from 1 to 16384.
    FLOPs = 2 M N K; bytes = A, B and C once. The weight B is rotated among copies covering 2x L2 so
    repetitions stream it from memory. Repetitions are queued behind ``torch.cuda._sleep`` so host
    enqueue gaps do not enter event intervals; their count comes from a time budget (0.2 s, 2 s for
    the bf16 M = 16384 rows that clock droop is read from). Validation: up to 64 rows of C against a
    float64 product on the device, |err| <= 8 eps sqrt(K) for inputs in [-1, 1].
    """

    name = "gemm"
    description = "cuBLAS GEMM via torch over Llama-3.1-8B shapes, bf16/fp16/tf32, float64-checked"
    timer = "cuda_events"
    time_budget_s = 600.0

    def supported(self, backend: Backend) -> tuple[bool, str]:
        lib, reason = gemm_library()
        return (lib is not None), reason

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        ms = QUICK_GEMM_M if cfg.quick else GEMM_M
        max_m = _opt(cfg, "gemm", "max_m", max(ms))
        scale = _opt(cfg, "gemm", "shape_scale", 1.0)  # tests shrink N and K
        reps = max(10, _opt(cfg, "gemm", "num_reps", cfg.num_reps))
        budget_s = _opt(cfg, "gemm", "budget_s", 0.2)
        droop_budget_s = _opt(cfg, "gemm", "droop_budget_s", 1.0 if cfg.quick else 2.0)
        specs = []
        for dtype in GEMM_DTYPES:
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
        res = torch_gemm(self.backend.index, p["dtype"], p["m"], p["n"], p["k"], num_reps=p["num_reps"],
                         budget_s=p["budget_s"], l2_bytes=int(self.backend.properties.get("l2_bytes", 0)),
                         clock_khz=float(self.backend.properties.get("clock_khz", 1.5e6)))
        source = "square" if p["shape"] == "square" else f"llama-3.1-8b:{p['shape']}"
        return _row(spec.key, res, "cuda_events", dtype=p["dtype"], m=p["m"], n=p["n"], k=p["k"], shape=p["shape"],
                    flops=2.0 * p["m"] * p["n"] * p["k"], bytes=res["bytes"], library=res["library"],
                    shape_source=source, max_abs_err=res["max_abs_err"], tol=res["tol"],
                    num_weight_copies=res["num_weight_copies"], droop_row=p["dtype"] == "bf16" and p["m"] == DROOP_M,
                    timing=res.get("timing"),
                    spec_tflops=_spec_tflops(self.backend.sku, p["dtype"]))


def gemm_tolerance(dtype: str, k: int) -> float:
    """Max |C - C_ref| accepted for inputs in [-1, 1]: 8 eps sqrt(K) (rounding errors add like a walk)."""
    return 8.0 * GEMM_EPS[dtype] * math.sqrt(k)


def torch_gemm(index: int, dtype: str, m: int, n: int, k: int, *, num_reps: int, budget_s: float,
               l2_bytes: int, clock_khz: float) -> dict:
    """Time ``torch.matmul(A, B, out=C)`` on cuda:index; returns times_s, valid, check, errors."""
    import torch

    dev = torch.device("cuda", index)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}[dtype]
    elem = torch.tensor([], dtype=tdt).element_size()
    b_bytes = k * n * elem
    copies = max(1, min(8, math.ceil(2 * l2_bytes / b_bytes))) if l2_bytes else 1
    need = (m * k + copies * k * n + m * n) * elem
    free, _ = torch.cuda.mem_get_info(dev)
    if need > 0.9 * free:
        raise errors.DeviceMemoryError(f"cuda:{index}: gemm {m}x{n}x{k} {dtype} needs {need} bytes of device memory "
                                       f"but only {free} bytes are free")
    gen = torch.Generator(device=dev).manual_seed(1234 + m + n + k)
    a = (torch.rand(m, k, device=dev, generator=gen) * 2 - 1).to(tdt)
    bs = [(torch.rand(k, n, device=dev, generator=gen) * 2 - 1).to(tdt) for _ in range(copies)]
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
            "library": f"torch {torch.__version__} (cuBLAS)", "timing": timing, **check}


def check_gemm(a, b, c, dtype: str, max_rows: int = 64) -> dict:
    """Compare up to ``max_rows`` evenly spaced rows of ``c`` with a float64 ``a @ b`` (any torch device).

    Returns ``valid``, ``max_abs_err``, ``tol`` (``gemm_tolerance``) and a one-line ``check``.
    """
    import torch

    m, k = a.shape
    rows = torch.linspace(0, m - 1, steps=min(m, max_rows), device=a.device).long().unique()
    ref = a[rows].double() @ b.double()
    err = float((c[rows].double() - ref).abs().max().item())
    tol = gemm_tolerance(dtype, k)
    ok = math.isfinite(err) and err <= tol
    return {"valid": ok, "max_abs_err": err, "tol": tol,
            "check": f"{len(rows)} rows of C vs a float64 product: max |err| {err:.3g} {'<=' if ok else '>'} tol {tol:.3g}"}


GRAPH_TIMING_BELOW_S = 50e-6  # calls shorter than this are timed inside a CUDA graph
GRAPH_CALLS = 32               # matmuls per captured graph


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


# ---------------------------------------------------------------- backend -----------------------

_INT_PROPS = ("sm_count", "l2_bytes", "cc_major", "cc_minor", "clock_khz", "mem_clock_khz", "bus_width_bits",
              "max_threads_per_sm", "shared_mem_per_sm_bytes", "total_mem_bytes", "free_mem_bytes")


class CudaBackend(Backend):
    """One CUDA device. Raises ``NoDeviceError`` at construction when it cannot be used.

    Args:
        index: CUDA device index (``--device cuda:N``).
        ext: the extension module (tests pass a stand-in); ``gpubench._cuda`` when None.
        nvml: the ``pynvml`` module for telemetry (tests pass a fake); imported when None.
    """

    name = "cuda"

    def __init__(self, index: int = 0, *, ext=None, nvml=None):
        self.index = index
        self.ext = Extension(ext if ext is not None else load_extension(), index)
        count = self.ext.device_count()  # NoDeviceError with the driver's reason when none
        if not 0 <= index < count:
            raise errors.NoDeviceError(f"cuda:{index} does not exist (this machine has {count} CUDA "
                                       f"device{'s' if count != 1 else ''}: cuda:0..cuda:{count - 1})")
        self.identity = dict(self.ext.device_identity(index))
        self.properties = {k: (int(v) if k in _INT_PROPS else v) for k, v in self.ext.device_properties(index).items()}
        self._nvml = nvml
        self.sku = skus.detect(self.identity["name"])

    def device_name(self) -> str:
        return self.identity["name"]

    def device_info(self) -> dict:
        tel = self.telemetry_source()
        try:
            driver, mig, compute_mode = tel.driver_version, tel.mig_mode, tel.compute_mode
        finally:
            tel.close()
        return {"backend": "cuda", "name": self.identity["name"], "index": self.index,
                "driver": driver or f"supports CUDA {self.identity.get('driver_cuda_version')} (NVML unavailable)",
                # A MIG slice has a fraction of the SMs and bandwidth; a non-default compute mode
                # can make a probe share the GPU. Both belong with every figure of the run.
                "mig_enabled": None if mig is None else bool(mig),
                "compute_mode": {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}.get(
                    compute_mode, compute_mode),
                "driver_cuda_version": self.identity.get("driver_cuda_version"),
                "cuda_runtime": self.identity.get("cuda_runtime"), "pci_bus_id": self.identity.get("pci_bus_id"),
                "sku_detected": self.sku.id if self.sku else None, "properties": dict(self.properties)}

    def telemetry_source(self):
        from gpubench.telemetry_nvml import NvmlTelemetry

        return NvmlTelemetry(self.index, pci_bus_id=self.identity.get("pci_bus_id"), nvml=self._nvml)

    def probes(self) -> dict[str, Probe]:
        # Run order: the short probes and the GEMM (which carries MAMF and clock droop) before the
        # long L2 sweep, so a run cut short by a time limit keeps the headline figures.
        return {p.name: p for p in (StreamProbe(self), PeakProbe(self), LaunchProbe(self), GemmProbe(self),
                                    L2Probe(self))}

    def default_sku(self) -> str:
        """The detected SKU; an unknown GPU gets ``cuda-<name>`` (no spec peaks, and --sku must be given)."""
        if self.sku is not None:
            return self.sku.id
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", self.identity["name"].lower()).strip("-")


# ---------------------------------------------------------------- device-check table -------------

# What published measurements lead one to expect, per SKU and figure prefix of check_table, so that
# the first run on a card can be judged at a glance. H200: STREAM triad 75-90 % of the 4.8 TB/s
# spec (3.5 TB/s measured, 74 %; an L2-sweep DRAM plateau 3.9 TB/s), an L2 plateau near 10 TB/s up
# to ~40 MB, back-to-back launches ~2.5 us eager / ~1.3 us in a graph, bf16 dense GEMM ~790 TFLOP/s
# (80 % of spec, as on the H100).
EXPECTED: dict[str, dict[str, str]] = {
    "h200": {"stream triad": "expect 75-90 % of 4.8 TB/s", "l2 warm max": "expect ~10 TB/s up to ~40 MB",
             "launch device_interval": "expect ~2.5 us (eager)", "launch graph_node": "expect ~1.3 us (graph)",
             "gemm bf16 best": "expect ~790 TF/s", "peak bf16 wgmma": "expect 80-90 % of spec x f_clk"},
    "h100-sxm": {"gemm bf16 best": "expect ~795 TF/s (80 %)"},
    "a100-80": {"stream triad": "expect ~86 % of 2.04 TB/s", "gemm bf16 best": "expect ~270 TF/s (87 %)",
                "launch device_interval": "expect ~2.6 us (eager)", "launch graph_node": "expect ~1.4 us (graph)"},
}


def expected_note(sku_id: str | None, figure: str) -> str:
    """The published expectation for a check_table figure on this SKU ('' when none)."""
    for prefix, note in EXPECTED.get(sku_id or "", {}).items():
        if figure.startswith(prefix):
            return note
    return ""


def check_table(run) -> list[tuple[str, str, str, str]]:
    """(figure, value, % of spec, notes) lines of a CUDA run for scripts/device_check.sh.

    Stream/l2 bandwidth and peak/gemm TFLOP/s as % of the SKU's spec (peak also as % of
    spec x f_clk, f_clk = mean SM clock / spec clock), launch costs in us with p20-p80, clock droop
    and the clock-event reasons seen during the GEMMs. Invalid rows are never used as figures.
    """
    from gpubench.telemetry_nvml import clock_droop, decode_throttle

    try:
        sku = skus.get(run.manifest["sku"])
    except errors.GpubenchError:
        sku = None
    spec_bw = sku.memory_bw_gbs if sku else None

    def pct(x, ref):
        return f"{100 * x / ref:5.1f} %" if (x is not None and ref) else ""

    def valid(df):
        return df[df["valid"].astype(bool)]

    lines = []
    if "stream" in run:
        st = valid(run["stream"])
        if len(st):
            top = st[st["n_elements"] == st["n_elements"].max()]
            for kernel in ("copy", "triad"):
                for _, r in top[top["kernel"] == kernel].iterrows():
                    lines.append((f"stream {kernel} {r['array_bytes'] / MiB:.0f} MiB", f"{r['gbps_best']:.0f} GB/s",
                                  pct(r["gbps_best"], spec_bw), f"median {r['gbps_median']:.0f}, cv {r['cv']:.3f}"))
    if "l2" in run:
        l2 = valid(run["l2"])
        for mode in ("warm", "cold"):
            sel = l2[l2["mode"] == mode]
            if len(sel):
                best = sel.loc[sel["gbps_median"].idxmax()]
                big = sel.loc[sel["working_set_bytes"].idxmax()]
                lines.append((f"l2 {mode} max (at {best['working_set_bytes'] / MiB:.2f} MiB)",
                              f"{best['gbps_median']:.0f} GB/s", "",
                              f"{big['gbps_median']:.0f} GB/s ({pct(big['gbps_median'], spec_bw).strip() or '-'} of spec) "
                              f"at {big['working_set_bytes'] / MiB:.0f} MiB"))
    if "peak" in run:
        for _, r in valid(run["peak"]).iterrows():
            clock, spec_clock = r.get("clock_mhz_mean"), r.get("spec_clock_mhz")
            note = ""
            if _present(clock) and _present(spec_clock) and _present(r.get("spec_tflops")):
                f_clk = clock / spec_clock
                note = f"{pct(r['tflops_median'], r['spec_tflops'] * f_clk).strip()} of spec x f_clk ({f_clk:.3f})"
            lines.append((f"peak {r['dtype']} {r.get('instruction', r['unit'])}", f"{r['tflops_median']:.1f} TF/s",
                          pct(r["tflops_median"], r.get("spec_tflops") if _present(r.get("spec_tflops")) else None), note))
    if "launch" in run:
        la = valid(run["launch"])
        for kind in LaunchProbe.TIMERS:
            sel = la[la["kind"] == kind]
            if len(sel):
                r = sel.loc[sel["count"].idxmax()]
                c = r["count"]
                lines.append((f"launch {kind} (x{c})", f"{r['t_median_s'] / c * 1e6:.2f} us", "",
                              f"p20-p80 {r['t_p20_s'] / c * 1e6:.2f}-{r['t_p80_s'] / c * 1e6:.2f} us"))
    if "gemm" in run:
        g = valid(run["gemm"])
        for dtype in GEMM_DTYPES:
            sel = g[g["dtype"] == dtype]
            if len(sel):
                b = sel.loc[sel["tflops_median"].idxmax()]
                lines.append((f"gemm {dtype} best {b['m']}x{b['n']}x{b['k']}", f"{b['tflops_median']:.1f} TF/s",
                              pct(b["tflops_median"], b.get("spec_tflops") if _present(b.get("spec_tflops")) else None),
                              f"{len(sel)} valid of {int((run['gemm']['dtype'] == dtype).sum())}"))
        d = clock_droop(run["gemm"])
        lines.append(("clock droop (bf16 GEMM, M=16384)", f"{100 * d.droop:.1f} %" if d.droop is not None else "-", "",
                      f"mean {d.mean_clock_mhz:.0f} / max {d.max_clock_mhz:.0f} MHz over {d.num_rows} rows"
                      if d.droop is not None else d.reason))
        bits = 0
        for v in run["gemm"].get("throttle_bits", []):
            if _present(v):
                bits |= int(v)
        lines.append(("clock-event reasons during gemm", "", "", ", ".join(decode_throttle(bits)) or "none"))
    sku_id = sku.id if sku else None
    return [(a, b, c, "; ".join(x for x in (d, expected_note(sku_id, a)) if x)) for a, b, c, d in lines]


def format_table(lines: list[tuple[str, str, str, str]]) -> str:
    """The check_table lines as aligned text."""
    w = max([len(a) for a, *_ in lines] + [6])
    out = [f"{'figure':<{w}}  {'value':>12}  {'% spec':>7}  notes"]
    out += [f"{a:<{w}}  {b:>12}  {c:>7}  {d}" for a, b, c, d in lines]
    return "\n".join(out)


def _present(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))
