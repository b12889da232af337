"""Peak FMA throughput on the CPU, fp64 and fp32, all cores, native vector width (compiled C++).

Each thread runs 12 (AVX-512: 16) independent FMA chains in vector registers; 2 FLOP per FMA per
lane. The checksum of all chains is compared with the closed form of the recurrence, so nothing
is elided. Each repetition is timed as the team window (first thread's start after a barrier to
the last thread's end), so fork/join and wake-up latency are excluded. Repetitions are short
(~0.5 ms at the spec rate) and many (10x num_reps): on a shared
machine a repetition is only as fast as its slowest thread, and the best (min-time) repetition is
the one in which no thread was descheduled; it is the headline (the median is kept too).

The reference ("spec") is cores x lanes x FMA units x 2 x clock, with the clock hostinfo reports
(sysfs cpuinfo_max_freq, or the nominal '/proc/cpuinfo cpu MHz' on a VM). Because a nominal figure
can be far from the real clock, the probe also measures the core clock (a chain of dependent
integer adds retires one per cycle) and reports the % of the peak at that measured clock. The
``peak_clock`` row holds that measurement.
"""
from __future__ import annotations

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.backends.probe_common import opt

TARGET_REP_S = 0.0005
ADDS_PER_ITER = 32


def measured_clock_mhz(num_reps: int = 40, iters: int = 50_000) -> tuple[float, list[float]]:
    """Core clock in MHz from the best of `num_reps` dependent-add chains (one thread)."""
    from gpubench import _cpu

    times = list(_cpu.dependent_add_seconds(iters, num_reps))
    good = [t for t in times if t > 0]
    return (ADDS_PER_ITER * iters / min(good) / 1e6 if good else float("nan")), times


class PeakProbe(Probe):
    name = "peak"
    description = "FMA chains at the native vector width, fp64 and fp32, all cores"
    timer = "steady_clock"
    time_budget_s = 300.0

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        reps = opt(cfg, "peak", "num_reps", 10 * cfg.num_reps)
        specs = [MeasurementSpec(key="peak_clock_int64", params={"kind": "clock", "num_reps": max(reps, 20)},
                                 label="core clock")]
        for dtype in ("fp64", "fp32"):
            specs.append(MeasurementSpec(key=f"peak_fma_{dtype}",
                                         params={"kind": "fma", "dtype": dtype, "num_reps": reps,
                                                 "iters": opt(cfg, "peak", "iters", 0)},
                                         label=f"fma {dtype}"))
        return specs

    def measure(self, spec: MeasurementSpec) -> dict:
        from gpubench import _cpu
        from gpubench.hostinfo import host_cpu

        p = spec.params
        h = host_cpu()
        opt_iters = p.get("iters")
        if p["kind"] == "clock":
            iters = 50_000
            mhz, times = measured_clock_mhz(p["num_reps"], iters)
            return {"dtype": "int64", "unit": "dependent_add", "cycles": ADDS_PER_ITER * iters, "times_s": times,
                    "valid": all(t > 0 for t in times), "clock_mhz_measured": mhz,
                    "clock_mhz_reported": h.clock_mhz, "clock_source_reported": h.clock_source}
        dtype = p["dtype"]
        dtype_bytes = 8 if dtype == "fp64" else 4
        spec_flops = h.peak_flops(dtype_bytes)
        # Iterations for ~0.5 ms at the spec rate, from the FLOPs one iteration does (a tiny call
        # tells); not from a timed calibration, which a descheduled thread would skew.
        flops_per_iter = _cpu.peak_fma(dtype, 1, 1)["flops_per_rep"]
        iters = max(1_000, int(opt_iters or TARGET_REP_S * spec_flops / flops_per_iter))
        _cpu.peak_fma(dtype, iters, 2)  # warm-up: clock ramp, thread team start
        out = _cpu.peak_fma(dtype, iters, p["num_reps"])
        mhz, _ = measured_clock_mhz()
        at_measured = spec_flops * mhz / h.clock_mhz
        row = {
            "dtype": dtype, "unit": "vector_fma", "isa": out["isa"], "threads": out["threads"],
            "lanes": out["lanes"], "accumulators": out["accumulators"], "iters": iters,
            "flops": out["flops_per_rep"], "times_s": list(out["times_s"]), "valid": bool(out["valid"]),
            "checksum": out["checksum"], "checksum_expected": out["expected"],
            "spec_tflops": spec_flops / 1e12, "spec_clock_mhz": h.clock_mhz, "spec_clock_source": h.clock_source,
            "spec_formula": f"{h.num_cpus} cpus x {h.fp_lanes(dtype_bytes)} lanes x {h.fma_units_per_core} FMA units"
                            f" x 2 x {h.clock_mhz:.0f} MHz",
            "clock_mhz_measured": mhz, "measured_clock_tflops": at_measured / 1e12,
            # Diagnostic, not the headline: each thread's own best repetition, summed. It excludes
            # the moments a thread waited for a core, so on a shared host it shows what the FMA
            # units deliver when scheduled; on a quiet host it equals the team figure.
            "thread_sum_tflops_best": sum(out["flops_per_rep"] / out["threads"] / t for t in out["thread_best_s"]) / 1e12,
        }
        if not out["valid"]:
            row["invalid_reason"] = f"checksum {out['checksum']!r} != closed form {out['expected']!r}"
        return row

    def derive(self, row: dict, summary: dict) -> dict:
        if row.get("unit") == "dependent_add":
            return {"clock_mhz_median": row["cycles"] / summary["t_median_s"] / 1e6}
        d = super().derive(row, summary)
        d["pct_of_spec"] = 100 * d["tflops_best"] / row["spec_tflops"]
        d["pct_of_measured_clock_peak"] = 100 * d["tflops_best"] / row["measured_clock_tflops"]
        return d
