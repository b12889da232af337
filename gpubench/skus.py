"""The SKU table (gpubench/data/skus.toml): spec figures with a source for each.

Spec peak identity: ``sm_count * tensor_cores_per_sm * fma_per_tc_per_clk[dtype] * 2 * spec_clock``.
The ``cpu`` entry is not in the file: it is built from the detected host.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]  # the same API under the backport's name

from common.errors import ConfigError, SKUMismatchError, UnknownSKUError, suggest

if TYPE_CHECKING:
    from gpubench.hostinfo import HostCPU

TENSOR_DTYPES = ("bf16", "fp16", "tf32", "fp8", "int8")


@dataclass(frozen=True)
class SKU:
    id: str
    name: str
    arch: str
    backend: str  # "cuda" or "cpu"
    sm_count: int  # CPU: logical cores
    tensor_cores_per_sm: int
    fma_per_tc_per_clk: dict
    fp32_fma_per_sm_per_clk: int  # CPU: fp32 FMA lanes x FMA units per core
    spec_clock_mhz: float
    max_boost_mhz: float
    memory_gb: float
    memory_bw_gbs: float | None
    l2_mb: float
    tdp_w: float | None
    host_link_gbs: float | None
    compute_capability: str | None = None
    nvlink_gbs: float | None = None  # per GPU, per direction
    nic_gbs: float | None = None     # network per GPU, per direction (one NIC per GPU)
    aliases: tuple = ()
    patterns: tuple = ()
    s_floor_ms: float | None = None
    clock_droop: float | None = None
    memory_total_mib: float | None = None  # what the driver reports (binary MiB); None: memory_gb
    source: dict = field(default_factory=dict)

    def peak_flops(self, dtype: str) -> float:
        """Dense spec peak in FLOP/s for dtype (tensor cores on GPUs; vector FMA on CPUs)."""
        if dtype == "fp32" and self.backend == "cuda":
            return self.sm_count * self.fp32_fma_per_sm_per_clk * 2 * self.max_boost_mhz * 1e6
        fma = self.fma_per_tc_per_clk.get(dtype)
        if not fma:
            raise ConfigError(f"{self.id} has no {dtype} peak (has: {', '.join(sorted(self.fma_per_tc_per_clk))})")
        return self.sm_count * self.tensor_cores_per_sm * fma * 2 * self.spec_clock_mhz * 1e6

    @property
    def memory_bytes(self) -> float:
        """Datasheet capacity in bytes (decimal GB)."""
        return self.memory_gb * 1e9

    @property
    def device_memory_bytes(self) -> float:
        """Total memory as the driver reports it (``cudaMemGetInfo``): what an engine sizes its KV
        cache from. Datasheet "80 GB" is 80 GiB of HBM less what the driver reserves (81,559 MiB on an
        H100), not 80e9 bytes."""
        if self.memory_total_mib is not None:
            return self.memory_total_mib * (1 << 20)
        return self.memory_bytes

    @property
    def l2_bytes(self) -> float:
        return self.l2_mb * 1e6


@lru_cache(maxsize=1)
def _table() -> dict:
    text = resources.files("gpubench").joinpath("data/skus.toml").read_text()
    return tomllib.loads(text)


def _from_entry(sku_id: str, e: dict) -> SKU:
    return SKU(
        id=sku_id,
        name=e["name"],
        arch=e["arch"],
        backend="cuda",
        sm_count=e["sm_count"],
        tensor_cores_per_sm=e["tensor_cores_per_sm"],
        fma_per_tc_per_clk=dict(e["fma_per_tc_per_clk"]),
        fp32_fma_per_sm_per_clk=e["fp32_fma_per_sm_per_clk"],
        spec_clock_mhz=e["spec_clock_mhz"],
        max_boost_mhz=e["max_boost_mhz"],
        memory_gb=e["memory_gb"],
        memory_bw_gbs=e["memory_bw_gbs"],
        l2_mb=e["l2_mb"],
        tdp_w=e.get("tdp_w"),
        host_link_gbs=e.get("host_link_gbs"),
        compute_capability=e.get("compute_capability"),
        nvlink_gbs=e.get("nvlink_gbs"),
        nic_gbs=e.get("nic_gbs"),
        aliases=tuple(e.get("aliases", ())),
        patterns=tuple(e.get("patterns", ())),
        s_floor_ms=e.get("s_floor_ms"),
        clock_droop=e.get("clock_droop"),
        memory_total_mib=e.get("memory_total_mib"),
        source=dict(e.get("source", {})),
    )


def gpu_skus() -> dict[str, SKU]:
    return {k: _from_entry(k, v) for k, v in _table().items()}


def cpu_sku(host: "HostCPU | None" = None, memory_bytes: float | None = None) -> SKU:
    """The `cpu` entry, built from the detected host: cores x vector lanes x FMA units x 2 x clock.

    ``host`` (and its ``memory_bytes``): a CPU a run recorded instead of this one, so that rows and
    probes measured on one machine are priced for that machine wherever they are read."""
    from gpubench.hostinfo import host_cpu

    h = host if host is not None else host_cpu()
    lanes32, lanes64 = h.fp_lanes(4), h.fp_lanes(8)
    # A CPU has no tensor cores: model it as one "tensor core" per core whose FMA/clk is lanes x units,
    # so the same identity gives the vector-FMA peak.
    fma = {"fp32": lanes32 * h.fma_units_per_core, "fp64": lanes64 * h.fma_units_per_core}
    l3 = h.llc_bytes
    return SKU(
        id="cpu",
        name=f"{h.model_name} ({h.num_cpus} CPUs)",
        arch="cpu",
        backend="cpu",
        sm_count=h.num_cpus,
        tensor_cores_per_sm=1,
        fma_per_tc_per_clk=fma,
        fp32_fma_per_sm_per_clk=lanes32 * h.fma_units_per_core,
        spec_clock_mhz=h.clock_mhz,
        max_boost_mhz=h.clock_mhz,
        memory_gb=memory_bytes / 1e9 if memory_bytes is not None else _mem_total_gb(),
        memory_bw_gbs=None,  # no spec for a host: the stream probe measures it
        l2_mb=l3 / 1e6,
        tdp_w=None,
        host_link_gbs=None,
        aliases=("host",),
        source={
            "sm_count": "os.sched_getaffinity (logical CPUs)",
            "fma_per_tc_per_clk": f"{h.vector_bits}-bit vectors from /proc/cpuinfo flags x {h.fma_units_per_core} FMA units (assumed)",
            "spec_clock_mhz": h.clock_source,
            "l2_mb": "last-level cache from /sys/devices/system/cpu/cpu0/cache",
            "memory_gb": "/proc/meminfo MemTotal",
            "memory_bw_gbs": "none: measured by the stream probe",
            **({"host": "the CPU a run recorded (its manifest's device properties), not this host"}
               if host is not None else {}),
        },
    )


def _mem_total_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 0.0


def all_ids() -> list[str]:
    return [*gpu_skus().keys(), "cpu"]


def get(sku_id: str) -> SKU:
    """Look up by id or alias (case-insensitive); UnknownSKUError with close matches otherwise."""
    key = sku_id.strip().lower()
    if key in ("cpu", "host"):
        return cpu_sku()
    table = gpu_skus()
    if key in table:
        return table[key]
    for sku in table.values():
        if key in (a.lower() for a in sku.aliases):
            return sku
    names = all_ids() + [a for s in table.values() for a in s.aliases]
    raise UnknownSKUError(f"unknown SKU '{sku_id}'{suggest(key, names)}; `gpubench skus` lists them")


# A device name carrying one of these names another part than a pattern without it: an H200 NVL
# (600 W, PCIe) is not the SXM H200, an A100 PCIe not the SXM A100.
VARIANT_MARKERS = ("NVL", "PCIe")


def detect(device_name: str) -> SKU | None:
    """The table entry whose name pattern matches a device name read from the driver, if any.

    A pattern matches as a whole word ('H200' is not found in 'GH200', a Grace Hopper superchip, nor
    'B200' in 'GB200'); a name with a variant marker (``VARIANT_MARKERS``) matches only patterns that
    carry it; the longest pattern wins, so 'H100 PCIe' is not taken for an SXM part. None: a part the
    table does not have (the run then asks for --sku, or records the device under its own name).
    """
    markers = [m for m in VARIANT_MARKERS if re.search(rf"\b{m}", device_name, re.IGNORECASE)]
    best, best_len = None, 0
    for sku in gpu_skus().values():
        for pat in sku.patterns:
            if not re.search(rf"(?<![A-Za-z0-9]){re.escape(pat)}(?![A-Za-z0-9])", device_name, re.IGNORECASE):
                continue
            if any(m.lower() not in pat.lower() for m in markers) or len(pat) <= best_len:
                continue
            best, best_len = sku, len(pat)
    return best


def check_matches(sku: SKU, device_name: str, backend: str, force: bool = False,
                  gpu_unusable: str | None = None) -> None:
    """Raise SKUMismatchError when --sku contradicts the detected device.

    A SKU of another backend (a GPU SKU on a machine measured on its CPU, or ``cpu`` on a GPU) is
    refused whatever ``force`` says: the probes would measure this device and file its figures
    under the other one's id, which `fit` then refuses. ``force`` only accepts a GPU SKU that the
    GPU's name contradicts (a variant the table takes for another SKU).
    """
    if sku.backend != backend:
        if backend == "cpu" and gpu_unusable and "_cuda is not built" in gpu_unusable:
            # a GPU may well be there: what is missing is the extension that measures it
            raise SKUMismatchError(f"--sku {sku.id}: the GPU cannot be measured: {gpu_unusable}")
        if backend == "cpu":
            why = f"; no usable GPU: {gpu_unusable}" if gpu_unusable else ""
            raise SKUMismatchError(
                f"--sku {sku.id}: this machine has no {sku.name} (the device is the CPU, '{device_name}'{why}); to "
                f"price a step on one, use `gpubench predict --sku {sku.id}`; to characterize this host, "
                "`gpubench run --device cpu`")
        raise SKUMismatchError(
            f"--sku {sku.id} is this host's CPU, but the device is the GPU '{device_name}': pass --device cpu to "
            "characterize the CPU, or leave --sku out to characterize the GPU")
    if force:
        return
    if backend == "cuda":
        found = detect(device_name)
        if found is not None and found.id != sku.id:
            raise SKUMismatchError(
                f"--sku {sku.id} contradicts the detected device '{device_name}' (looks like {found.id}); use --force to override")
