"""One CUDA device as a gpubench backend: identity, properties, telemetry, its probes in run order."""
from __future__ import annotations

import re

from common import errors
from gpubench import skus
from gpubench.backends.base import Backend, Probe
from gpubench.backends.cuda.extension import Extension, load_extension
from gpubench.backends.cuda.probes import L2Probe, LaunchProbe, PeakProbe, StreamProbe
from gpubench.backends.cuda.probes.gemm import GemmProbe
from gpubench.backends.cuda.probes.kernels import KernelsProbe

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
    index: int  # always a device number here (the base class allows None for the CPU)

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
        # long L2 sweep, so a run cut short by a time limit keeps the headline figures; the kernel
        # floors and graph-timed attention (torch) before L2 too.
        return {p.name: p for p in (StreamProbe(self), PeakProbe(self), LaunchProbe(self), GemmProbe(self),
                                    KernelsProbe(self), L2Probe(self))}

    def default_sku(self) -> str:
        """The detected SKU; an unknown GPU gets ``cuda-<name>`` (no spec peaks, and --sku must be given)."""
        if self.sku is not None:
            return self.sku.id
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", self.identity["name"].lower()).strip("-")
