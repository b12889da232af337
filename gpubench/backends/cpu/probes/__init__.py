"""CPU probes (stream, l2, launch, peak, gemm, torch_ops, vllm_ops) and hidden debug probes.

Each module holds one probe family: its work formula (bytes or FLOPs per repetition), its plan
(the sweep) and its measurement, which calls the compiled ``gpubench._cpu`` kernels (numpy's BLAS
for gemm, torch for torch_ops, vLLM's oneDNN linear in the vLLM environment for vllm_ops). The CUDA probes live with the CUDA backend.
"""
from __future__ import annotations


def cpu_probes() -> dict:
    """Probe name -> CPU probe, in the order a full run takes them."""
    from gpubench.backends.cpu.probes.gemm import GemmProbe
    from gpubench.backends.cpu.probes.l2 import CacheSweepProbe
    from gpubench.backends.cpu.probes.launch import LaunchProbe
    from gpubench.backends.cpu.probes.peak import PeakProbe
    from gpubench.backends.cpu.probes.stream import StreamProbe
    from gpubench.backends.cpu.probes.torch_ops import TorchOpsProbe
    from gpubench.backends.cpu.probes.vllm_ops import VllmOpsProbe

    probes = [StreamProbe(), CacheSweepProbe(), LaunchProbe(), PeakProbe(), GemmProbe(), TorchOpsProbe(), VllmOpsProbe()]
    return {p.name: p for p in probes}


def debug_probes() -> dict:
    """Hidden probes that crash, abort or hang on purpose (fault-isolation tests); run only by name."""
    from gpubench.backends.cpu.probes.debug import DebugProbe

    probes = [DebugProbe("debug_crash"), DebugProbe("debug_abort"), DebugProbe("debug_hang"), DebugProbe("debug_error")]
    return {p.name: p for p in probes}
