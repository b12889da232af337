"""Telemetry around every measurement: a sampler thread and pure aggregation.

A ``TelemetrySource`` reads one sample of the device's state; ``Sampler`` calls it on a thread
(default 50 Hz) while a measurement runs; ``aggregate`` turns the samples into the row fields of
docs/results-schema.md. What cannot be read is None in every sample and carries a reason in
``null_reasons()``, never a guess.

Sample keys (missing ones None): ``clock_mhz`` (mean over the cores/SMs the probe uses),
``mem_clock_mhz``, ``power_w``, ``temp_c``, ``throttle_bits`` (int bit mask), ``energy_j``
(a monotonic counter; the row gets its delta). Optional: ``proc_cpu_s`` (CPU seconds of the
measuring process, CPU source), which gives the row's ``proc_cpu_util``: CPU seconds per wall
second during the measurement, the contention indicator on a shared host.

The CPU source (``CpuTelemetry``) reads per-core frequency from sysfs cpufreq
``scaling_cur_freq`` or, without cpufreq (most VMs), the per-core ``cpu MHz`` lines of
/proc/cpuinfo (on a VM that is the hypervisor's nominal figure, and the manifest says so), and
RAPL package energy from /sys/class/powercap/intel-rapl*/energy_uj where readable.
"""
from __future__ import annotations

import abc
import glob
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gpubench.hostinfo import read_text

SAMPLE_FIELDS = ("clock_mhz", "mem_clock_mhz", "power_w", "temp_c", "throttle_bits", "energy_j")
LOW_CLOCK_FRACTION = 0.75  # samples under 75 % of the max clock are flagged (docs/bench.md)


class TelemetrySource(abc.ABC):
    """One device's telemetry. ``sample()`` must be cheap (it runs at up to 50 Hz beside a probe)."""

    @abc.abstractmethod
    def sample(self) -> dict:
        """One reading: every key of SAMPLE_FIELDS, None where it cannot be read."""

    @abc.abstractmethod
    def null_reasons(self) -> dict[str, str]:
        """Field -> why it is None (e.g. ``{"power_w": "no RAPL in /sys/class/powercap"}``)."""

    @property
    @abc.abstractmethod
    def max_clock_mhz(self) -> float | None:
        """The reference for ``low_clock_frac`` (max SM clock; CPU max frequency), None if unknown."""

    def describe(self) -> dict:
        """The manifest's ``telemetry`` entry: source name, readable fields, null reasons."""
        return {"source": type(self).__name__, "max_clock_mhz": self.max_clock_mhz,
                "null_reasons": self.null_reasons()}

    def close(self) -> None:
        """Release handles (NVML shutdown); default nothing."""


@dataclass
class Sampler:
    """Context manager: samples ``source`` on a daemon thread every 1/hz seconds.

    One sample is taken on entry and one on exit, so even a measurement shorter than the period has
    two. ``samples`` holds ``(monotonic_s, sample_dict)`` pairs. Errors raised by the source stop
    sampling and are kept in ``error`` (telemetry never breaks a measurement).
    """

    source: TelemetrySource
    hz: float = 50.0
    samples: list = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _take(self) -> None:
        if self.error is not None:
            return
        try:
            self.samples.append((time.monotonic(), self.source.sample()))
        except Exception as exc:  # noqa: BLE001 - a broken sensor must not lose the measurement
            self.error = f"{type(exc).__name__}: {exc}"

    def _loop(self) -> None:
        period_s = 1.0 / self.hz
        while not self._stop.wait(period_s):
            self._take()

    def __enter__(self) -> "Sampler":
        self._take()
        if self.hz > 0:
            self._thread = threading.Thread(target=self._loop, name="gpubench-telemetry", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()

    def aggregate(self, max_ref_mhz: float | None = None) -> dict:
        """``aggregate`` of the collected samples with the source's null reasons."""
        reasons = dict(self.source.null_reasons())
        if self.error:
            reasons["sampler"] = self.error
        ref = max_ref_mhz if max_ref_mhz is not None else self.source.max_clock_mhz
        return aggregate(self.samples, ref, null_reasons=reasons)


def _values(samples, key: str) -> list[float]:
    return [s[key] for _, s in samples if s.get(key) is not None]


def aggregate(samples, max_ref_mhz: float | None, null_reasons: dict | None = None) -> dict:
    """Row fields from ``(t, sample)`` pairs (or bare sample dicts). Pure; no I/O.

    Returns clock mean/min/max, ``clock_max_ref_mhz``, ``low_clock_frac`` (share of clock samples
    under 75 % of ``max_ref_mhz``), mean memory clock, mean power, energy delta (last - first
    counter reading; None if the counter went backwards), max temperature, OR of throttle bits,
    ``proc_cpu_util`` (when samples carry ``proc_cpu_s``), sample count, ``telemetry_busy_samples``
    (samples a GPU source saw a kernel running in; clocks, memory clock and power are averaged over
    those when there are any) and ``telemetry_null_reason`` (field -> reason, only for fields that are None).
    """
    pairs = [(s if isinstance(s, tuple) else (None, s)) for s in samples]
    # Samples a GPU source marked idle (no kernel running at that instant: between repetitions, in
    # setup) would average host gaps into "the clock under load"; clocks and power come from the
    # busy samples when the source says which those are and any exist.
    busy = [p for p in pairs if p[1].get("gpu_idle") is False]
    loaded = busy if busy else pairs
    clocks = _values(loaded, "clock_mhz")
    mem = _values(loaded, "mem_clock_mhz")
    power = _values(loaded, "power_w")
    temps = _values(pairs, "temp_c")
    bits = _values(pairs, "throttle_bits")
    energy = _values(pairs, "energy_j")
    out: dict[str, Any] = {
        "clock_mhz_mean": sum(clocks) / len(clocks) if clocks else None,
        "clock_mhz_min": min(clocks) if clocks else None,
        "clock_mhz_max": max(clocks) if clocks else None,
        "clock_max_ref_mhz": max_ref_mhz,
        "low_clock_frac": (sum(c < LOW_CLOCK_FRACTION * max_ref_mhz for c in clocks) / len(clocks)
                           if clocks and max_ref_mhz else None),
        "mem_clock_mhz_mean": sum(mem) / len(mem) if mem else None,
        "power_w_mean": sum(power) / len(power) if power else None,
        "energy_j": None,
        "temp_c_max": max(temps) if temps else None,
        "throttle_bits": None,
        "telemetry_samples": len(pairs),
        "telemetry_busy_samples": len(busy) if any("gpu_idle" in p[1] for p in pairs) else None,
    }
    # CPU seconds the measuring process used per wall second (CPU source only): ~ the number of
    # threads on a machine to itself, less when other work took the cores.
    cpu = [(t, s["proc_cpu_s"]) for t, s in pairs if t is not None and s.get("proc_cpu_s") is not None]
    out["proc_cpu_util"] = ((cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0])
                            if len(cpu) >= 2 and cpu[-1][0] > cpu[0][0] else None)
    if len(energy) >= 2 and energy[-1] >= energy[0]:
        out["energy_j"] = energy[-1] - energy[0]
    if bits:
        acc = 0
        for b in bits:
            acc |= int(b)
        out["throttle_bits"] = acc
    reasons = dict(null_reasons or {})
    missing = {}
    for row_field, sample_field in (("clock_mhz_mean", "clock_mhz"), ("mem_clock_mhz_mean", "mem_clock_mhz"),
                                    ("power_w_mean", "power_w"), ("energy_j", "energy_j"),
                                    ("temp_c_max", "temp_c"), ("throttle_bits", "throttle_bits")):
        if out[row_field] is None:
            if sample_field in reasons:
                missing[sample_field] = reasons[sample_field]
            elif not pairs:
                missing[sample_field] = "no samples"
            elif sample_field == "energy_j" and len(energy) >= 2:
                missing[sample_field] = "energy counter went backwards (wrapped or reset)"
            else:
                missing[sample_field] = "not reported by the source"
    if "sampler" in reasons:
        missing["sampler"] = reasons["sampler"]
    out["telemetry_null_reason"] = missing or None
    return out


# ---------------------------------------------------------------- CPU -------------------------



class CpuTelemetry(TelemetrySource):
    """Host CPU telemetry: per-core frequency (cpufreq or /proc/cpuinfo) and RAPL energy.

    Args:
        cpus: the logical CPUs the probes run on (default: this process's affinity).
    """

    def __init__(self, cpus: list[int] | None = None, *, sysfs_root: str = "/sys", procfs_root: str = "/proc"):
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self._proc_cpuinfo = os.path.join(procfs_root, "cpuinfo")
        freq = [os.path.join(sysfs_root, f"devices/system/cpu/cpu{c}/cpufreq/scaling_cur_freq") for c in self.cpus]
        self._freq_paths = freq if all(os.path.exists(p) for p in freq) else None
        self._reasons: dict[str, str] = {}
        if self._freq_paths is None:
            self._clock_source = "/proc/cpuinfo 'cpu MHz'"
            self._reasons_clock: str | None = ("no cpufreq in sysfs (VM or driver-less): per-core 'cpu MHz' from /proc/cpuinfo, "
                                   "which a hypervisor may report as a constant nominal figure")
        else:
            self._clock_source = "sysfs cpufreq scaling_cur_freq"
            self._reasons_clock = None
        mx = read_text(os.path.join(sysfs_root, "devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"))
        self._max_mhz = int(mx) / 1000.0 if mx else None
        if self._max_mhz is None:
            from gpubench.hostinfo import host_cpu

            self._max_mhz = host_cpu().clock_mhz
        self._rapl = self._find_rapl(sysfs_root)
        self._reasons.update({
            "mem_clock_mhz": "not readable on a CPU host",
            "temp_c": "no CPU temperature source read (hwmon not used)",
            "throttle_bits": "no CPU throttle reasons exposed",
            "power_w": "power is not sampled on the CPU (energy_j is, where RAPL is readable)",
        })
        if isinstance(self._rapl, str):
            self._reasons["energy_j"] = self._rapl
            self._rapl = None
        if self._freq_paths is None and not self._cpuinfo_mhz():
            self._reasons["clock_mhz"] = "no cpufreq in sysfs and no 'cpu MHz' in /proc/cpuinfo"

    @staticmethod
    def _find_rapl(sysfs_root: str):
        """Paths of readable RAPL package energy counters, or a reason string."""
        zones = sorted(glob.glob(os.path.join(sysfs_root, "class/powercap/intel-rapl:[0-9]*")))
        zones = [z for z in zones if z.count(":") == 1]  # packages, not their subzones
        if not zones:
            return "no RAPL (no /sys/class/powercap/intel-rapl* zones: VM or unsupported CPU)"
        paths = [os.path.join(z, "energy_uj") for z in zones]
        if any(read_text(p) is None for p in paths):
            return "RAPL energy_uj is not readable by this user (root-only since Linux 5.10)"
        return paths

    def _cpuinfo_mhz(self) -> list[float]:
        text = read_text(self._proc_cpuinfo) or ""
        mhz, cpu = {}, None
        for line in text.splitlines():
            if line.startswith("processor"):
                cpu = int(line.split(":")[1])
            elif line.startswith("cpu MHz") and cpu is not None:
                mhz[cpu] = float(line.split(":")[1])
        return [mhz[c] for c in self.cpus if c in mhz]

    def sample(self) -> dict:
        if self._freq_paths is not None:
            vals = [float(v) / 1000.0 for v in (read_text(p) for p in self._freq_paths) if v]
        else:
            vals = self._cpuinfo_mhz()
        energy = None
        if self._rapl:
            readings = [read_text(p) for p in self._rapl]
            if all(readings):
                energy = sum(int(r) for r in readings if r is not None) / 1e6  # all(readings): none is None
        return {"clock_mhz": sum(vals) / len(vals) if vals else None, "mem_clock_mhz": None, "power_w": None,
                "temp_c": None, "throttle_bits": None, "energy_j": energy, "proc_cpu_s": time.process_time()}

    def null_reasons(self) -> dict[str, str]:
        return dict(self._reasons)

    @property
    def max_clock_mhz(self) -> float | None:
        return self._max_mhz

    def describe(self) -> dict:
        d = super().describe()
        d["clock_source"] = self._clock_source
        if self._reasons_clock:
            d["clock_note"] = self._reasons_clock
        return d
