"""STREAM on the CPU: copy, scale, add, triad in fp64 (McCalpin's stream.c method, compiled C++).

Bytes per repetition follow the STREAM convention: 2, 2, 3, 3 arrays x n x 8 bytes; the
write-allocate read of the destination is not counted (as in stream.c). Array sizes sweep from 1/8
of the last-level cache to >= 4x it (each array), the top size also bounded so the three arrays
use at most half of MemAvailable. The headline is the best rate (min time, first repetition
discarded), as stream.c reports; the median is kept too. Validation is stream.c's: replay the
kernel sequence on scalars and compare every element (average relative error <= 1e-13). A failed
check makes all four rows invalid.
"""
from __future__ import annotations

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.backends.probe_common import STREAM_KERNEL_ARRAYS, geometric, llc_bytes, mem_available_bytes, opt, stream_bytes

WORD_BYTES = 8  # fp64
CORRUPT_TARGETS = {"": 0, "a": 1, "b": 2, "c": 3}


class StreamProbe(Probe):
    name = "stream"
    description = "STREAM copy/scale/add/triad, fp64, OpenMP, stream.c validation"
    timer = "steady_clock"
    time_budget_s = 600.0

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        llc = llc_bytes(cfg.device)
        lo = opt(cfg, "stream", "min_array_bytes", llc // 8)
        hi = opt(cfg, "stream", "max_array_bytes", 4 * llc)
        avail = mem_available_bytes()
        if avail and 3 * hi > avail // 2:
            hi = avail // 6  # three arrays within half of what is free
        factor = 4.0 if cfg.quick else 2.0
        reps = max(10, opt(cfg, "stream", "num_reps", cfg.num_reps))
        corrupt = str(opt(cfg, "stream", "debug_corrupt", ""))
        if corrupt not in CORRUPT_TARGETS:
            from common.errors import ConfigError

            raise ConfigError(f"stream.debug_corrupt must be one of a, b, c (got '{corrupt}')")
        specs = []
        for array_bytes in geometric(lo, max(lo, hi), factor, align=64 * WORD_BYTES):
            n = array_bytes // WORD_BYTES
            specs.append(MeasurementSpec(
                key=f"stream_fp64_{n}",
                params={"n_elements": n, "num_reps": reps, "corrupt": CORRUPT_TARGETS[corrupt],
                        "top_bounded_by_memory": hi < 4 * llc},
                label=f"{array_bytes / 2**20:.1f} MiB x 3",
                row_keys=tuple(f"stream_{k}_fp64_{n}" for k in STREAM_KERNEL_ARRAYS),
            ))
        return specs

    def measure(self, spec: MeasurementSpec) -> list[dict]:
        from gpubench import _cpu

        p = spec.params
        n = p["n_elements"]
        out = _cpu.stream(n, p["num_reps"], p["corrupt"])
        rows = []
        for kernel in STREAM_KERNEL_ARRAYS:
            row = {
                "key": f"stream_{kernel}_fp64_{n}",
                "kernel": kernel,
                "dtype": "fp64",
                "n_elements": n,
                "array_bytes": n * WORD_BYTES,
                "bytes": stream_bytes(kernel, n, WORD_BYTES),
                "threads": out["threads"],
                "times_s": list(out[kernel]),
                "valid": bool(out["valid"]),
                "write_allocate_counted": False,
            }
            if not out["valid"]:
                row["invalid_reason"] = out["reason"]
            if p.get("top_bounded_by_memory"):
                row["note"] = "largest size bounded by MemAvailable (< 4x LLC)"
            rows.append(row)
        return rows
