"""
gpubench CUDA backend: compiled probes timed with CUDA events
"""
from __future__ import annotations

import typing

__all__: list[str] = ['CudaError', 'DeviceMemoryError', 'NoDeviceError', 'device_count', 'device_identity', 'device_properties', 'format_selftest', 'l2', 'launch', 'peak', 'peak_supported', 'peak_wgmma', 'selfcheck_fill', 'stream']
class NoDeviceError(RuntimeError):
    pass
class CudaError(RuntimeError):
    pass
class DeviceMemoryError(RuntimeError):
    pass
def device_count() -> int:
    """
    Number of CUDA devices; raises NoDeviceError when none can be used.
    """
def device_identity(device: typing.SupportsInt | typing.SupportsIndex = 0) -> dict[str, str]:
    """
    Strings read at run time: name, pci_bus_id, driver_cuda_version, cuda_runtime.
    """
def device_properties(device: typing.SupportsInt | typing.SupportsIndex = 0) -> dict[str, float]:
    """
    Properties read from the device at run time (SM count, L2 bytes, clocks, memory).
    """
def l2(device: typing.SupportsInt | typing.SupportsIndex, working_set_bytes: typing.SupportsInt | typing.SupportsIndex, mode: str, passes: typing.SupportsInt | typing.SupportsIndex = 1, num_reps: typing.SupportsInt | typing.SupportsIndex = 10, num_warmup: typing.SupportsInt | typing.SupportsIndex = 2) -> dict:
    """
    Read bandwidth over a working set with L1-bypassing loads. mode='cold': L2 flushed by writing >= 2x L2
    before each single timed pass; mode='warm': `passes` passes per repetition after an untimed warm pass.
    Returns {times_s, valid, check, bytes (read per repetition), passes, working_set_bytes, l2_bytes, ...}.
    """
def launch(device: typing.SupportsInt | typing.SupportsIndex, kind: str, count: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10, num_warmup: typing.SupportsInt | typing.SupportsIndex = 2) -> dict:
    """
    Kernel launch cost, kind in host_enqueue (host clock, gated), device_interval (events, gated),
    launch_sync (host clock, launch + synchronize), graph_node (events around a graph of `count` kernels).
    times_s cover `count` launches per repetition. Gated kinds allow count <= 512.
    """
def peak(device: typing.SupportsInt | typing.SupportsIndex, dtype: str, num_reps: typing.SupportsInt | typing.SupportsIndex = 10, num_warmup: typing.SupportsInt | typing.SupportsIndex = 2, target_s: typing.SupportsFloat | typing.SupportsIndex = 0.02) -> dict:
    """
    Compute ceiling with operands in registers: mma.sync loops for bf16/fp16 (m16n8k16), tf32 (m16n8k8),
    fp8 e4m3 (m16n8k32, sm_89+), or fp32 FMA on CUDA cores. Returns {times_s, valid, check, flops (per
    repetition), supported, iters, ...}; supported=0 (and no times) where the device lacks the dtype.
    """
def peak_supported(device: typing.SupportsInt | typing.SupportsIndex, dtype: str) -> tuple[bool, str]:
    """
    (supported, reason) of a peak dtype on this device, from its compute capability.
    """
def peak_wgmma(device: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10, num_warmup: typing.SupportsInt | typing.SupportsIndex = 2, target_s: typing.SupportsFloat | typing.SupportsIndex = 0.02, dtype: str = 'bf16') -> dict:
    """
    Hopper tensor-core ceiling: wgmma.mma_async m64n128k16 bf16 or m64n128k32 fp8 e4m3 (dtype 'bf16' or
    'fp8'; fp32 accumulate), A in registers, B in
    shared memory, accumulators checked exactly. Needs compute capability 9.0 and a build with sm_90a code
    (GPUBENCH_CUDA_ARCHS="90a"); otherwise supported=0 and the reason in check.
    """
def format_selftest() -> str:
    """
    The formatter every message uses, on fixed values (compare with FORMAT_SELFTEST_EXPECTED).
    """
def selfcheck_fill(device: typing.SupportsInt | typing.SupportsIndex = 0, n: typing.SupportsInt | typing.SupportsIndex = 1048576) -> bool:
    """
    Fill a device buffer with a pattern by a trivial kernel and verify it on the host; returns True.
    """
def stream(device: typing.SupportsInt | typing.SupportsIndex, n_elements: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10, num_warmup: typing.SupportsInt | typing.SupportsIndex = 2) -> dict:
    """
    STREAM copy/scale/add/triad on three fp64 arrays of n_elements (even), double2 accesses, grid-stride,
    CUDA events behind a spin gate. Returns {kernel: {times_s, valid, check, bytes, n_elements, ...}};
    the arrays are checked on the device against a golden replay. bytes follow STREAM (2,2,3,3 arrays).
    """
__version__: str = '0.1.0'
