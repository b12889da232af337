"""The CUDA probes, one module per probe (GEMM with its torch and CuPy paths); their shared
row and sweep helpers in ``common``."""
from gpubench.backends.cuda.probes.common import CudaProbe, fp8_mma_native, probe_row, spec_tflops
from gpubench.backends.cuda.probes.gemm import GemmProbe
from gpubench.backends.cuda.probes.l2 import L2Probe
from gpubench.backends.cuda.probes.launch import LaunchProbe
from gpubench.backends.cuda.probes.peak import PeakProbe
from gpubench.backends.cuda.probes.stream import StreamProbe

__all__ = ["CudaProbe", "GemmProbe", "L2Probe", "LaunchProbe", "PeakProbe", "StreamProbe", "fp8_mma_native", "probe_row",
           "spec_tflops"]
