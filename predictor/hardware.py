"""What the predictor knows about a device: spec ceilings, the cache size, and the backend.

``HardwareSpec.from_sku`` reads the SKU table (spec peaks through the FMA-count identity, memory
bandwidth, L2, memory, host link, published host floor and clock droop). ``from_run`` builds the
spec of the device a gpubench run measured: SM/core count and L2/LLC size from the run's manifest
(read from the device at run time) and, for the CPU backend, the bandwidth ``B`` from the
measured STREAM triad -- a host has no spec bandwidth, so there ``B`` is measured and the
memory law's eta_max then sits near 1 at large transfers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.errors import ConfigError
from gpubench import skus as _skus

# A CPU with no stream run has no bandwidth figure at all. This placeholder (one DDR4-2666
# channel) keeps `gpubench predict --sku cpu` usable; every output labels it "assumed".
ASSUMED_CPU_BW_BYTES_PER_S = 20e9

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "fp64": 8}


@dataclass(frozen=True)
class HardwareSpec:
    """Spec ceilings of one device. Units are in the field names.

    ``mem_bw_tier`` says where ``mem_bytes_per_s`` came from: "spec" (datasheet), "measured"
    (STREAM triad of a run), or "assumed" (CPU without a run).
    """

    sku_id: str
    name: str
    arch: str
    backend: str  # "cuda" or "cpu"
    num_sms: int  # CPU: logical cores
    peak_flops_per_s: dict  # dtype -> dense spec peak (FLOP/s); "vector" -> non-tensor fp32 peak
    mem_bytes_per_s: float
    l2_bytes: float  # CPU: last-level cache
    memory_bytes: float  # GPU: the total the driver reports (binary MiB); CPU: the host's memory
    host_link_bytes_per_s: float | None = None
    spec_clock_mhz: float = 0.0
    s_floor_ms: float | None = None  # published host-residual floor (engine-step semantics)
    clock_droop: float | None = None  # published droop under a large GEMM
    mem_bw_tier: str = "spec"
    source: dict = field(default_factory=dict, compare=False)

    def peak(self, dtype: str) -> float:
        """Dense spec peak in FLOP/s for ``dtype``; ConfigError naming the dtypes it has."""
        try:
            return self.peak_flops_per_s[dtype]
        except KeyError:
            have = ", ".join(k for k in sorted(self.peak_flops_per_s) if k != "vector")
            raise ConfigError(f"{self.sku_id} has no {dtype} peak (has: {have})") from None

    @property
    def default_dtype(self) -> str:
        """bf16 on GPUs; fp32 on a CPU (what the CPU step profiler runs)."""
        return "fp32" if self.backend == "cpu" else "bf16"

    def replace(self, **changes) -> "HardwareSpec":
        return dataclasses.replace(self, **changes)

    def with_cores(self, num_cores: int) -> "HardwareSpec":
        """The same CPU limited to ``num_cores`` threads (a step profiled with torch.set_num_threads(n)).

        Peaks scale with the core count (the FMA identity is per core); the bandwidth is left as is,
        since a few cores can already draw most of a socket's bandwidth -- calibrate it with a
        stream run at that thread count when it matters.
        """
        if self.backend != "cpu":
            raise ConfigError(f"with_cores is for the CPU backend ({self.sku_id} is {self.backend})")
        if not 1 <= num_cores:
            raise ConfigError(f"num_cores must be >= 1 (got {num_cores})")
        scale = num_cores / self.num_sms
        return self.replace(num_sms=int(num_cores),
                            peak_flops_per_s={k: v * scale for k, v in self.peak_flops_per_s.items()})

    @classmethod
    def from_sku(cls, sku: "str | _skus.SKU") -> "HardwareSpec":
        """From the SKU table (``cpu``/``host``: the detected host, with an assumed bandwidth)."""
        if isinstance(sku, str):
            sku = _skus.get(sku)
        peaks = {}
        for dtype in sku.fma_per_tc_per_clk:
            peaks[dtype] = sku.peak_flops(dtype)
        if sku.backend == "cuda":
            peaks["fp32"] = sku.peak_flops("fp32")  # CUDA-core fp32 at max boost
        peaks["vector"] = peaks["fp32"]  # elementwise ops run on vector units, never tensor cores
        if sku.memory_bw_gbs:
            bw, tier = sku.memory_bw_gbs * 1e9, "spec"
        else:
            bw, tier = ASSUMED_CPU_BW_BYTES_PER_S, "assumed"
        return cls(
            sku_id=sku.id,
            name=sku.name,
            arch=sku.arch,
            backend=sku.backend,
            num_sms=int(sku.sm_count),
            peak_flops_per_s=peaks,
            mem_bytes_per_s=bw,
            l2_bytes=sku.l2_bytes,
            memory_bytes=sku.device_memory_bytes,
            host_link_bytes_per_s=sku.host_link_gbs * 1e9 if sku.host_link_gbs else None,
            spec_clock_mhz=sku.spec_clock_mhz,
            s_floor_ms=sku.s_floor_ms,
            clock_droop=sku.clock_droop,
            mem_bw_tier=tier,
            source=dict(sku.source),
        )
