"""Cache sweep on the CPU: read bandwidth vs working set, warm and cold (compiled C++, all threads).

Working sets from 16 KiB to 4x the last-level cache in ~x1.25 steps (x2 with --quick).
- warm: one untimed pass, then each repetition makes `passes` passes over the same buffer, so it
  is served by the smallest cache level that holds it; `passes` keeps a repetition near 256 MiB read.
- cold: before every timed pass each thread writes its share of a flush buffer of 2x LLC (the
  writes evict the working set from every level), then one timed pass.
Both time the team window inside one parallel region: from the first thread's start (after a
barrier, so every thread is awake) to the last thread's end, so OpenMP fork/join and thread
wake-up (milliseconds on a shared machine) are not counted as memory time.
Bytes = working set x passes. The read kernel accumulates in 8 vector registers and the sum of the
integer-valued data is checked exactly, so the reads cannot be optimized away or skipped.
"""
from __future__ import annotations

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.backends.probe_common import geometric, llc_bytes, opt

TARGET_BYTES_PER_REP = 256 * 2**20


class CacheSweepProbe(Probe):
    name = "l2"
    description = "read bandwidth vs working set, warm and cold (flush buffer 2x LLC)"
    timer = "steady_clock"
    time_budget_s = 600.0

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        llc = llc_bytes(cfg.device)
        lo = opt(cfg, "l2", "min_bytes", 16 * 1024)
        hi = opt(cfg, "l2", "max_bytes", 4 * llc)
        flush = opt(cfg, "l2", "flush_bytes", 2 * llc)
        factor = opt(cfg, "l2", "factor", 2.0 if cfg.quick else 1.25)
        reps = opt(cfg, "l2", "num_reps", cfg.num_reps)
        specs = []
        for mode in ("warm", "cold"):
            for ws in geometric(lo, max(lo, hi), factor, align=4096):
                passes = max(1, TARGET_BYTES_PER_REP // ws) if mode == "warm" else 1
                specs.append(MeasurementSpec(
                    key=f"l2_{mode}_fp64_{ws}",
                    params={"mode": mode, "working_set_bytes": ws, "passes": passes, "num_reps": reps,
                            "flush_bytes": flush},
                    label=f"{mode} {ws / 1024:.0f} KiB",
                ))
        return specs

    def measure(self, spec: MeasurementSpec) -> dict:
        from gpubench import _cpu

        p = spec.params
        ws = p["working_set_bytes"]
        if p["mode"] == "warm":
            out = _cpu.cache_read_warm(ws, p["passes"], p["num_reps"])
        else:
            out = _cpu.cache_read_cold(ws, p["flush_bytes"], p["num_reps"])
        # The kernel reads whole 512-byte blocks: the bytes actually read are a multiple of 512.
        ws_read = max(512, ws // 512 * 512)
        row = {
            "mode": p["mode"],
            "dtype": "fp64",
            "working_set_bytes": ws_read,
            "passes": p["passes"],
            "bytes": ws_read * p["passes"],
            "flush_bytes": p["flush_bytes"] if p["mode"] == "cold" else 0,
            "threads": out["threads"],
            "times_s": list(out["times_s"]),
            "valid": bool(out["valid"]),
            "checksum": out["checksum"],
            "checksum_expected": out["expected"],
        }
        if not out["valid"]:
            row["invalid_reason"] = f"read checksum {out['checksum']!r} != expected {out['expected']!r}"
        return row
