"""The compiled probes of ``gpubench._cuda``: stream, l2, launch and peak (GEMM is in ``gemm``)."""
from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from common import errors
from gpubench import skus
from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.backends.cuda.extension import NUM_WARMUP, Extension
from gpubench.probes.common import STREAM_KERNEL_ARRAYS, opt

if TYPE_CHECKING:
    from gpubench.backends.cuda.backend import CudaBackend

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def fp8_mma_native(cc: int) -> bool:
    """fp8 ``mma.sync`` is a tensor-core QMMA on compute capability 8.9 (Ada) and 12.x (consumer
    Blackwell) only; on 9.0 and 10.x ptxas emulates it with fp16 HMMA + FADD (scripts/check_sass.py
    counts it), so a row there would credit the tensor cores with work they did not do. The same
    rule is ``fp8_mma_native`` in csrc/cuda/peak.cu."""
    return cc == 89 or cc // 10 == 12


def probe_row(key: str, res: dict, timer: str, **fields) -> dict:
    """Row fields common to the CUDA probes from an extension result dict."""
    row = {"key": key, "timer": timer, "times_s": [float(t) for t in res["times_s"]],
           "valid": bool(res["valid"]), "check": res["check"]}
    row.update(fields)
    if not row["valid"]:
        row["invalid_reason"] = res["check"]
    return row


def _geometric(lo: int, hi: int, factor: float, align: int) -> list[int]:
    """lo, lo*factor, ... (aligned, increasing), with hi itself as the last size.

    Not ``gpubench.probes.common.geometric``: there a step that rounds up past ``hi`` ends the
    sweep above it, here ``hi`` (the free-device-memory bound) is never exceeded; the two give
    different sizes for some bounds, so sharing one would change one backend's plan."""
    if lo <= 0 or hi < lo or factor <= 1:
        raise errors.ConfigError(f"bad size sweep: lo={lo} hi={hi} factor={factor}")
    out: list[int] = []
    v = float(lo)
    while v < hi * (1 - 1e-9):
        a = max(align, int(round(v / align)) * align)
        if not out or a > out[-1]:
            out.append(a)
        v *= factor
    top = max(align, hi // align * align)
    if not out or top > out[-1]:
        out.append(top)
    return out


def device_props(cfg: ProbeConfig) -> dict:
    return cfg.device.get("properties", {})


def spec_tflops(sku: skus.SKU | None, dtype: str) -> float | None:
    if sku is None:
        return None
    try:
        return sku.peak_flops(dtype) / 1e12
    except errors.ConfigError:
        return None


class CudaProbe(Probe):
    def __init__(self, backend: "CudaBackend"):
        self.backend = backend

    @property
    def ext(self) -> Extension:
        return self.backend.ext


class StreamProbe(CudaProbe):
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

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        p = device_props(cfg)
        l2 = int(p.get("l2_bytes") or 0)
        if l2 <= 0:
            raise errors.ConfigError("stream: the device reported no L2 size (cudaDevAttrL2CacheSize)")
        lo = opt(cfg, "stream", "min_array_bytes", l2 // 8)
        hi = opt(cfg, "stream", "max_array_bytes", 4 * l2)
        free = int(p.get("free_mem_bytes") or 0)
        self._bounded = bool(free and 3 * hi > free // 2)
        if self._bounded:
            hi = free // 6
        # 100 repetitions (BabelStream's default), not 10: the first ones run while the clocks ramp.
        reps = max(100, opt(cfg, "stream", "num_reps", cfg.num_reps))
        specs = []
        for array_bytes in _geometric(lo, max(lo, hi), 4.0 if cfg.quick else 2.0, align=4 * KiB):
            n = array_bytes // 8
            specs.append(MeasurementSpec(
                key=f"stream_fp64_{n}", params={"n_elements": n, "num_reps": reps},
                label=f"{array_bytes / MiB:.1f} MiB x 3",
                row_keys=tuple(f"stream_{k}_fp64_{n}" for k in STREAM_KERNEL_ARRAYS)))
        return specs

    def notes(self, cfg: ProbeConfig) -> list[str]:
        self.plan(cfg)
        return ["largest array bounded by free device memory (< 4x L2)"] if self._bounded else []

    def measure(self, spec: MeasurementSpec) -> list[dict]:
        n, reps = spec.params["n_elements"], spec.params["num_reps"]
        out = self.ext.stream(self.backend.index, n, reps, NUM_WARMUP)
        spec_gbps = self.backend.sku.memory_bw_gbs if self.backend.sku else None
        rows = []
        for kernel in STREAM_KERNEL_ARRAYS:
            r = out[kernel]
            rows.append(probe_row(
                f"stream_{kernel}_fp64_{n}", r, "cuda_events", kernel=kernel, dtype="fp64", n_elements=n,
                array_bytes=int(r["array_bytes"]), bytes=int(r["bytes"]), threads=int(r["grid"] * r["block"]),
                grid=int(r["grid"]), block=int(r["block"]), write_allocate_counted=False, spec_gbps=spec_gbps))
        return rows


class L2Probe(CudaProbe):
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
        p = device_props(cfg)
        l2 = int(p.get("l2_bytes") or 0)
        if l2 <= 0:
            raise errors.ConfigError("l2: the device reported no L2 size (cudaDevAttrL2CacheSize)")
        lo = opt(cfg, "l2", "min_bytes", 64 * KiB)
        # --quick caps the sweep at 4x L2 and 512 MiB read per warm repetition: the full settings read
        # ~780 GB on an H200 (100-150 s), more than a short device window can spend on one probe.
        hi = opt(cfg, "l2", "max_bytes", (4 if cfg.quick else 8) * l2)
        warm_bytes = opt(cfg, "l2", "warm_bytes_per_rep", (GiB // 2) if cfg.quick else 4 * GiB)
        reps = max(10, opt(cfg, "l2", "num_reps", cfg.num_reps))
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
        return probe_row(spec.key, r, "cuda_events", mode=p["mode"], dtype="fp64", working_set_bytes=p["bytes"],
                    bytes=int(r["bytes"]), passes=int(r["passes"]), l2_bytes=l2,
                    working_set_over_l2=p["bytes"] / l2 if l2 else None, flush_bytes=int(r["flush_bytes"]),
                    grid=int(r["grid"]), block=int(r["block"]))


class LaunchProbe(CudaProbe):
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
        reps = max(30, opt(cfg, "launch", "num_reps", cfg.num_reps))
        table = self.QUICK_COUNTS if cfg.quick else self.COUNTS
        return [MeasurementSpec(key=f"launch_{kind}_{count}", params={"kind": kind, "count": count, "num_reps": reps},
                                label=f"{kind} x{count}")
                for kind, counts in table.items() for count in counts]

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        r = self.ext.launch(self.backend.index, p["kind"], p["count"], p["num_reps"], NUM_WARMUP)
        return probe_row(spec.key, r, self.TIMERS[p["kind"]], kind=p["kind"], count=p["count"],
                    gated=bool(r.get("gated", 0)))

    def derive(self, row: dict, summary: dict) -> dict[str, Any]:
        c = row["count"]
        return {"per_launch_s_median": summary["t_median_s"] / c, "per_launch_s_min": summary["t_min_s"] / c,
                "per_launch_us_median": summary["t_median_s"] / c * 1e6}


class PeakProbe(CudaProbe):
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
        p = device_props(cfg)
        return int(p.get("cc_major", 0)) * 10 + int(p.get("cc_minor", 0))

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        reps = max(10, opt(cfg, "peak", "num_reps", cfg.num_reps))
        target_s = opt(cfg, "peak", "target_s", 0.02)
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
        return probe_row(spec.key, r, "cuda_events", dtype=p["dtype"],
                    unit="cuda_core" if p["dtype"] == "fp32" else "tensor_core", flops=float(r["flops"]),
                    iters=int(r["iters"]), grid=int(r["grid"]), block=int(r["block"]),
                    spec_tflops=spec_tflops(sku, p["dtype"]),
                    spec_clock_mhz=(sku.max_boost_mhz if p["dtype"] == "fp32" else sku.spec_clock_mhz) if sku else None,
                    spec_formula=spec_formula(sku, p["dtype"]),
                    instruction=instruction)

    def derive(self, row: dict, summary: dict) -> dict[str, Any]:
        out = super().derive(row, summary)
        spec = row.get("spec_tflops")
        out["pct_of_spec"] = 100.0 * out["tflops_best"] / spec if spec else None
        return out


def spec_formula(sku: skus.SKU | None, dtype: str) -> str | None:
    """The SKU identity behind spec_tflops, spelled out (SMs x units x FMA/clk x 2 x clock)."""
    if sku is None or spec_tflops(sku, dtype) is None:
        return None
    if dtype == "fp32":
        return f"{sku.sm_count} SM x {sku.fp32_fma_per_sm_per_clk} FMA/clk x 2 x {sku.max_boost_mhz:.0f} MHz"
    return (f"{sku.sm_count} SM x {sku.tensor_cores_per_sm} TC x {sku.fma_per_tc_per_clk[dtype]} FMA/clk x 2 x "
            f"{sku.spec_clock_mhz:.0f} MHz")
