"""The CUDA backend: the compiled probes of ``gpubench._cuda`` plus library GEMM (cuBLAS through torch, else CuPy).

Importing this module needs no GPU and no driver (``gpubench._cuda`` links cudart statically and
is imported lazily); constructing ``CudaBackend`` is the first call, and raises
``common.errors.NoDeviceError`` with the driver's reason when no device can be used.

Device properties (SM count, L2 size, clocks, memory) are read from the device at run time; the
SKU table (``gpubench.skus``) is used only for spec peaks (``spec_tflops``, ``spec_gbps``).

Modules: ``extension`` (loading ``gpubench._cuda``, error mapping), ``probes`` (stream, l2, launch,
peak), ``gemm`` (library GEMM through torch), ``gemm_cupy`` (the same through
CuPy when torch has no CUDA), ``backend`` (``CudaBackend``), ``report`` (the
device-check table). The names below are re-exported so callers import from this package.

Probes, in the order a run takes them (docs/cuda.md):

    stream  copy/scale/add/triad, fp64 as double2, 1/8 L2 .. >= 4x L2    cuda_events, gated
    peak    mma.sync bf16 fp16 tf32 fp8 (native only), fp32 FMA; wgmma    cuda_events
    launch  host_enqueue | device_interval | launch_sync | graph_node     host_clock / cuda_events
    gemm    torch/cupy.matmul (cuBLAS) over Llama-3.1-8B shapes, bf16/fp16/tf32, checked vs float64
    l2      cold (flushed) and warm read sweeps, 64 KiB .. 8x L2          cuda_events, gated
"""
from __future__ import annotations

from gpubench.backends.cuda.backend import CudaBackend
from gpubench.backends.cuda.extension import NUM_WARMUP, Extension, load_extension
from gpubench.backends.cuda.probes import L2Probe, LaunchProbe, PeakProbe, StreamProbe, fp8_mma_native
from gpubench.backends.cuda.probes.gemm import (
    DROOP_M,
    GEMM_DTYPES,
    GEMM_EPS,
    GEMM_M,
    GEMM_SHAPES,
    GRAPH_CALLS,
    GRAPH_TIMING_BELOW_S,
    QUICK_GEMM_M,
    GemmProbe,
    check_gemm,
    gemm_library,
    gemm_tolerance,
    torch_gemm,
)
from gpubench.backends.cuda.probes.gemm_cupy import cupy_gemm
from gpubench.backends.cuda.report import EXPECTED, check_table, expected_note, format_table

__all__ = ["CudaBackend", "NUM_WARMUP", "Extension", "load_extension", "DROOP_M", "GEMM_DTYPES", "GEMM_EPS", "GEMM_M",
           "GEMM_SHAPES", "GRAPH_CALLS", "GRAPH_TIMING_BELOW_S", "QUICK_GEMM_M", "GemmProbe", "check_gemm",
           "gemm_library", "gemm_tolerance", "torch_gemm", "cupy_gemm", "L2Probe", "LaunchProbe", "PeakProbe", "StreamProbe",
           "fp8_mma_native", "EXPECTED", "check_table", "expected_note", "format_table"]
