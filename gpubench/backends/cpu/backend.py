"""The CPU backend: the host CPU characterized by compiled C++ probes (gpubench._cpu) and BLAS."""
from __future__ import annotations

from gpubench.backends.base import Backend, Probe


class CpuBackend(Backend):
    """The host CPU. Device properties come from gpubench.hostinfo (sysfs/procfs), read at run time."""

    name = "cpu"
    index = None
    gpu_unusable: str | None = None  # set when --device auto fell back here: why the GPU was not used

    def device_name(self) -> str:
        from gpubench.hostinfo import host_cpu

        h = host_cpu()
        return f"{h.model_name} ({h.num_cpus} CPUs)"

    def device_info(self) -> dict:
        from gpubench import _cpu
        from gpubench.backends.cpu.probes.gemm import blas_library
        from gpubench.backends.probe_common import mem_available_bytes
        from gpubench.hostinfo import host_cpu
        from gpubench.skus import _mem_total_gb

        h = host_cpu()
        props = h.to_dict()
        props.update({
            "omp_threads": _cpu.max_threads(),
            "compiled_isa": _cpu.isa,
            "compiled_vector_bytes": _cpu.vector_bytes,
            "mem_total_bytes": int(_mem_total_gb() * 1e9),
            "mem_available_bytes": mem_available_bytes(),
            "blas": blas_library(),
        })
        return {"backend": "cpu", "name": self.device_name(), "index": None, "driver": None,
                "cuda_runtime": None, "properties": props}

    def telemetry_source(self):
        from gpubench.telemetry import CpuTelemetry

        return CpuTelemetry()

    def probes(self) -> dict[str, Probe]:
        from gpubench.backends.cpu.probes import cpu_probes

        return cpu_probes()

    def default_sku(self) -> str:
        return "cpu"

    def hidden_probes(self) -> dict[str, Probe]:
        from gpubench.backends.cpu.probes import debug_probes

        return debug_probes()
