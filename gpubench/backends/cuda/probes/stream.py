"""CUDA STREAM: copy, scale, add, triad over device arrays (the compiled kernels of gpubench._cuda)."""
from __future__ import annotations

from common import errors
from gpubench.backends.base import MeasurementSpec, ProbeConfig
from gpubench.backends.cuda.extension import NUM_WARMUP
from gpubench.backends.cuda.probes.common import CudaProbe, KiB, MiB, _geometric, device_props, probe_row
from gpubench.backends.probe_common import STREAM_KERNEL_ARRAYS, opt


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
