"""What the host CPU is, read from sysfs and procfs (never from a table).

Everything returned carries where it came from, so the `cpu` SKU entry and the manifest can say it.
"""
from __future__ import annotations

import os
import platform
import re
import socket
from dataclasses import asdict, dataclass, field
from functools import lru_cache


@dataclass(frozen=True)
class CacheLevel:
    level: int
    kind: str  # Data, Instruction, Unified
    size_bytes: int
    shared_by_cpus: int


@dataclass(frozen=True)
class HostCPU:
    model_name: str
    num_cpus: int  # logical CPUs this process may run on
    num_physical_cores: int
    vector_bits: int  # widest SIMD with FMA the ISA flags advertise
    fma_units_per_core: int
    clock_mhz: float
    clock_source: str
    caches: tuple = field(default_factory=tuple)
    flags: tuple = field(default_factory=tuple)
    assumptions: tuple = field(default_factory=tuple)

    @property
    def llc_bytes(self) -> int:
        """Total last-level cache size (sum of distinct instances of the highest level)."""
        if not self.caches:
            return 32 * 1024 * 1024
        top = max(c.level for c in self.caches)
        inst = [c for c in self.caches if c.level == top and c.kind != "Instruction"]
        per = inst[0].size_bytes
        n_inst = max(1, -(-self.num_cpus // max(1, inst[0].shared_by_cpus)))
        return per * n_inst

    def cache_bytes(self, level: int) -> int | None:
        for c in self.caches:
            if c.level == level and c.kind != "Instruction":
                return c.size_bytes
        return None

    def fp_lanes(self, dtype_bytes: int) -> int:
        return self.vector_bits // (8 * dtype_bytes)

    def peak_flops(self, dtype_bytes: int) -> float:
        """cores x lanes x FMA units x 2 FLOP/FMA x clock."""
        return self.num_cpus * self.fp_lanes(dtype_bytes) * self.fma_units_per_core * 2 * self.clock_mhz * 1e6

    @classmethod
    def from_dict(cls, d: dict) -> "HostCPU":
        """The inverse of :meth:`to_dict`: the CPU a run manifest's ``device.properties`` (or a
        calibration's recorded host) describes. Keys this class does not hold are ignored; a missing
        one raises KeyError."""
        return cls(model_name=d["model_name"], num_cpus=int(d["num_cpus"]),
                   num_physical_cores=int(d["num_physical_cores"]), vector_bits=int(d["vector_bits"]),
                   fma_units_per_core=int(d["fma_units_per_core"]), clock_mhz=float(d["clock_mhz"]),
                   clock_source=d["clock_source"], caches=tuple(CacheLevel(**c) for c in d["caches"]),
                   flags=tuple(d["flags"]), assumptions=tuple(d.get("assumptions") or ()))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["llc_bytes"] = self.llc_bytes
        d["caches"] = [asdict(c) for c in self.caches]
        d["flags"] = list(self.flags)
        d["assumptions"] = list(self.assumptions)
        return d


def read_text(path: str) -> str | None:
    """A small sysfs/procfs file stripped, or None when it cannot be read (absent on this kernel or VM)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _parse_size(text: str) -> int:
    m = re.match(r"(\d+)\s*([KMG]?)", text)
    if not m:
        return 0
    return int(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)]


def _caches(cpu: int = 0) -> tuple:
    base = f"/sys/devices/system/cpu/cpu{cpu}/cache"
    out = []
    if not os.path.isdir(base):
        return ()
    for name in sorted(os.listdir(base)):
        if not name.startswith("index"):
            continue
        d = os.path.join(base, name)
        size = read_text(os.path.join(d, "size"))
        level = read_text(os.path.join(d, "level"))
        kind = read_text(os.path.join(d, "type")) or "Unified"
        shared = read_text(os.path.join(d, "shared_cpu_list")) or "0"
        if not size or not level:
            continue
        out.append(CacheLevel(int(level), kind, _parse_size(size), _count_cpu_list(shared)))
    return tuple(out)


def _count_cpu_list(text: str) -> int:
    n = 0
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            n += int(b) - int(a) + 1
        elif part.strip():
            n += 1
    return max(n, 1)


def _cpuinfo() -> dict:
    text = read_text("/proc/cpuinfo") or ""
    info: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            info.setdefault(k.strip(), v.strip())
    return info


def _clock(info: dict) -> tuple[float, str]:
    mx = read_text("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if mx:
        return int(mx) / 1000.0, "sysfs cpufreq/cpuinfo_max_freq"
    m = re.search(r"@\s*([\d.]+)\s*GHz", info.get("model name", ""))
    if m:
        return float(m.group(1)) * 1000.0, "/proc/cpuinfo model name"
    if "cpu MHz" in info:
        # Whole MHz: a hypervisor's figure is its TSC calibration of this boot (2596.134 on one boot
        # of the AMD VM, 2596.15 on another), and a spec peak that moved with it moved every roofline
        # figure computed from it between two boots of the same machine.
        return float(round(float(info["cpu MHz"]))), ("/proc/cpuinfo 'cpu MHz', whole MHz (no cpufreq in sysfs: "
                                                      "nominal clock as the hypervisor reports it)")
    return 2000.0, "unknown (assumed 2000 MHz)"


def fma_units_per_core(vendor_id: str, cpu_family: str, vector_bits: int) -> tuple[int, str]:
    """FMA instructions of ``vector_bits`` width one core retires per cycle, and why (the OS does not
    say; it follows from the microarchitecture).

    Two on current x86 server cores at their widest vector: Zen 2/3 (two 256-bit pipes, no AVX-512),
    Zen 5 server parts (two 512-bit pipes), Xeon Gold/Platinum since Skylake-SP (two 512-bit units).
    One on Zen 4 (AMD family 25 with AVX-512): its two 256-bit FMA pipes take a 512-bit FMA together,
    so it peaks at 16 fp64 FLOP/cycle/core, as Zen 3 does; the AMD EPYC VM here measured 118.2
    GFLOP/s on 2 cores at 3,694 MHz, 16.0 FLOP/cycle/core. Xeon Silver/Bronze parts with one 512-bit
    unit exist and cannot be told apart from /proc/cpuinfo: assumed two.
    """
    family = int(cpu_family) if str(cpu_family).isdigit() else None
    if vendor_id == "AuthenticAMD" and family == 25 and vector_bits == 512:
        return 1, "AMD family 25 with AVX-512 is Zen 4: two 256-bit FMA pipes take one 512-bit FMA per cycle"
    return 2, "not readable from the OS; true for Zen 2/3/5 and Xeon Gold/Platinum"


@lru_cache(maxsize=1)
def host_cpu() -> HostCPU:
    info = _cpuinfo()
    flags = tuple(info.get("flags", "").split())
    assumptions = []
    if "avx512f" in flags:
        vec = 512
    elif "avx2" in flags and "fma" in flags:
        vec = 256
    elif "asimd" in info.get("Features", "") or platform.machine() in ("aarch64", "arm64"):
        vec = 128
    else:
        vec = 128
    fma_units, why = fma_units_per_core(info.get("vendor_id", ""), info.get("cpu family", ""), vec)
    assumptions.append(f"fma_units_per_core={fma_units} at {vec} bits ({why})")
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = info.get("cpu cores")
    phys = int(cores) if cores and cores.isdigit() else ncpu
    clock, src = _clock(info)
    return HostCPU(
        model_name=info.get("model name", platform.processor() or platform.machine()),
        num_cpus=ncpu,
        num_physical_cores=phys,
        vector_bits=vec,
        fma_units_per_core=fma_units,
        clock_mhz=clock,
        clock_source=src,
        caches=_caches(),
        flags=tuple(f for f in flags if f in ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "sse4_2")),
        assumptions=tuple(assumptions),
    )


def hostname() -> str:
    return socket.gethostname()
