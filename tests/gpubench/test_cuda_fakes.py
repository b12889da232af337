"""Stand-ins (no tests here) for a GPU that this machine does not have: ``gpubench._cuda`` and ``pynvml``.

The extension stand-in returns outputs in the exact shape the compiled functions return (see
csrc/cuda/bindings.cpp), with times derived from fixed H100-like rates, so that rows, derived rates
and manifests of a CUDA run can be checked end to end without a device. Mocks only for the device.
"""
from __future__ import annotations

import types


class FakeCudaExt:
    """Mimics gpubench._cuda for one H100-SXM-like device."""

    class NoDeviceError(RuntimeError):
        pass

    class CudaError(RuntimeError):
        pass

    class DeviceMemoryError(RuntimeError):
        pass

    L2_BYTES = 50 * 1024 * 1024
    DRAM_BYTES_PER_S = 3.0e12
    L2_BYTES_PER_S = 7.0e12

    def __init__(self, *, name="NVIDIA H100 80GB HBM3", cc=(9, 0), free_bytes=79 * 2**30, corrupt=False):
        self.name, self.cc, self.free_bytes, self.corrupt = name, cc, free_bytes, corrupt
        self.calls: list[tuple] = []

    def device_count(self):
        return 1

    def device_identity(self, device=0):
        return {"name": self.name, "pci_bus_id": "00000000:19:00.0", "driver_cuda_version": "13.0",
                "cuda_runtime": "13.0"}

    def device_properties(self, device=0):
        return {"sm_count": 132.0, "l2_bytes": float(self.L2_BYTES), "cc_major": float(self.cc[0]),
                "cc_minor": float(self.cc[1]), "clock_khz": 1980000.0, "mem_clock_khz": 2619000.0,
                "bus_width_bits": 5120.0, "max_threads_per_sm": 2048.0, "shared_mem_per_sm_bytes": 233472.0,
                "total_mem_bytes": 85e9, "free_mem_bytes": float(self.free_bytes)}

    @staticmethod
    def _times(seconds, num_reps):
        # First repetition slower (as on real hardware), then a small deterministic spread.
        return [seconds * (1.3 if i == 0 else 1.0 + 0.01 * (i % 3)) for i in range(num_reps)]

    def stream(self, device, n_elements, num_reps=10, num_warmup=2):
        self.calls.append(("stream", n_elements))
        need = 3 * n_elements * 8
        if need > 0.95 * self.free_bytes:
            raise self.DeviceMemoryError(f"stream needs {need} bytes of device memory but only {self.free_bytes} are free")
        rate = self.L2_BYTES_PER_S if n_elements * 8 * 3 < self.L2_BYTES else self.DRAM_BYTES_PER_S
        out = {}
        for kernel, arrays in (("copy", 2), ("scale", 2), ("add", 3), ("triad", 3)):
            nbytes = arrays * n_elements * 8
            out[kernel] = {"times_s": self._times(nbytes / rate, num_reps), "valid": not self.corrupt,
                           "check": "golden replay, rel tol 1e-10: a: 0 of N off" if not self.corrupt
                           else "golden replay, rel tol 1e-10: a: 17 of N off golden 1.0",
                           "n_elements": float(n_elements), "array_bytes": float(n_elements * 8),
                           "bytes": float(nbytes), "grid": 1056.0, "block": 256.0}
        return out

    def l2(self, device, working_set_bytes, mode, passes=1, num_reps=10, num_warmup=2):
        self.calls.append(("l2", working_set_bytes, mode, passes))
        passes = 1 if mode == "cold" else passes
        rate = self.L2_BYTES_PER_S if (mode == "warm" and working_set_bytes < 0.7 * self.L2_BYTES) else self.DRAM_BYTES_PER_S
        nbytes = passes * working_set_bytes
        return {"times_s": self._times(2e-6 + nbytes / rate, num_reps), "valid": True, "check": "sum exact",
                "working_set_bytes": float(working_set_bytes), "passes": float(passes), "bytes": float(nbytes),
                "flush_bytes": float(2 * self.L2_BYTES + 2**20) if mode == "cold" else 0.0,
                "l2_bytes": float(self.L2_BYTES), "grid": 1056.0, "block": 256.0}

    def launch(self, device, kind, count, num_reps=10, num_warmup=2):
        self.calls.append(("launch", kind, count))
        per = {"host_enqueue": 2.1e-6, "device_interval": 1.3e-6, "launch_sync": 9.0e-6, "graph_node": 0.6e-6}[kind]
        return {"times_s": self._times(per * count, num_reps), "valid": True, "check": "all launches returned cudaSuccess",
                "count": float(count), "gated": 0.0 if kind == "launch_sync" else 1.0,
                "timer_host": 1.0 if kind in ("host_enqueue", "launch_sync") else 0.0}

    def peak(self, device, dtype, num_reps=10, num_warmup=2, target_s=0.02):
        self.calls.append(("peak", dtype))
        if dtype == "fp8" and self.cc < (8, 9):
            return {"times_s": [], "valid": False, "check": "skipped: fp8 mma needs compute capability 8.9+",
                    "supported": 0.0}
        tflops = {"bf16": 660.0, "fp16": 660.0, "tf32": 330.0, "fp8": 1300.0, "fp32": 60.0}[dtype]
        flops = tflops * 1e12 * target_s
        return {"times_s": self._times(target_s, num_reps), "valid": True, "check": "exact accumulators",
                "flops": flops, "supported": 1.0, "iters": 100000.0, "grid": 264.0, "block": 256.0, "chains": 8.0}

    def peak_wgmma(self, device, num_reps=10, num_warmup=2, target_s=0.02, dtype="bf16"):
        self.calls.append(("peak_wgmma", dtype))
        if self.cc != (9, 0):
            return {"times_s": [], "valid": False, "supported": 0.0,
                    "check": "skipped: wgmma needs compute capability 9.0"}
        flops = {"bf16": 900e12, "fp8": 1700e12}[dtype] * target_s
        return {"times_s": self._times(target_s, num_reps), "valid": True, "check": "exact accumulators",
                "flops": flops, "supported": 1.0, "iters": 50000.0, "grid": 396.0, "block": 128.0}

    def peak_supported(self, device, dtype):
        return (dtype != "fp8" or self.cc >= (8, 9)), ""


class _FieldValue:
    def __init__(self, mw):
        self.nvmlReturn = 0
        self.valueType = 1
        self.value = types.SimpleNamespace(uiVal=mw)


def fake_pynvml(*, clocks_mhz=(1980, 1755, 1410), power_mw=(650000, 690000, 700000), instant_power=True,
                throttle=(0x0, 0x4, 0x4 | 0x20), old_throttle_api=False, fail_init=None):
    """A module object with the pynvml calls NvmlTelemetry uses; readings cycle through the tuples."""
    m = types.ModuleType("pynvml")
    state = {"i": 0, "init": 0, "shutdown": 0}

    class NVMLError(Exception):
        pass

    def tick(seq):
        return seq[state["i"] % len(seq)]

    def init():
        if fail_init:
            raise NVMLError(fail_init)
        state["init"] += 1

    def clock(h, kind):
        if kind == m.NVML_CLOCK_SM:
            state["i"] += 1  # one tick per sample (the SM clock is read first)
            return tick(clocks_mhz)
        return 2619

    def fields(h, ids):
        if not instant_power:
            raise NVMLError("Not Supported")
        return [_FieldValue(tick(power_mw))]

    m.NVMLError = NVMLError
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU, m.NVML_FI_DEV_POWER_INSTANT = 1, 2, 0, 186
    m.nvmlInit = init
    m.nvmlShutdown = lambda: state.__setitem__("shutdown", state["shutdown"] + 1)
    m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    m.nvmlDeviceGetHandleByPciBusId_v2 = lambda bus: ("handle", bus)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlSystemGetDriverVersion = lambda: "580.65.06"
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980
    m.nvmlDeviceGetClockInfo = clock
    m.nvmlDeviceGetFieldValues = fields
    m.nvmlDeviceGetPowerUsage = lambda h: tick(power_mw)
    m.nvmlDeviceGetTemperature = lambda h, kind: 61 + state["i"] % 3
    m.nvmlDeviceGetTotalEnergyConsumption = lambda h: 1_000_000 + 15_000 * state["i"]
    if old_throttle_api:
        m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: tick(throttle)
    else:
        m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: tick(throttle)
    m.state = state
    return m


def fake_cupy(*, version="13.6.0", available=True, call_s=5e-6, tflops=400.0, wrong_product=False):
    """A module object with only the CuPy calls ``gemm_cupy`` makes, on numpy arrays.

    Each matmul computes the product in float64 rounded to the output dtype (what cuBLAS with fp32
    accumulation gives, well inside the tolerance) and advances a virtual device clock by
    ``call_s + 2 M N K / tflops``; events read that clock. ``wrong_product`` adds 1 to every entry
    of C, which the float64 check must catch. ``m.log`` records matmuls, spins and graph launches.
    """
    import numpy as np

    m = types.ModuleType("cupy")
    m.__version__ = version
    m.log = []
    clock = {"s": 0.0}
    capture: dict = {"graph": None}

    def run_matmul(a, b, out):
        out[...] = (a.astype(np.float64) @ b.astype(np.float64) + (1.0 if wrong_product else 0.0)).astype(out.dtype)
        clock["s"] += call_s + 2.0 * a.shape[0] * b.shape[1] * a.shape[1] / (tflops * 1e12)

    def matmul(a, b, out):
        if capture["graph"] is not None:  # captured calls run when the graph is launched
            capture["graph"].calls.append((a, b, out))
            return
        m.log.append("matmul")
        run_matmul(a, b, out)

    class Graph:
        def __init__(self):
            self.calls = []

        def launch(self, stream):
            m.log.append(f"graph launch {len(self.calls)}")
            for call in self.calls:
                run_matmul(*call)

    class Stream:
        def __init__(self, non_blocking=False):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            capture["graph"] = Graph()

        def end_capture(self):
            graph, capture["graph"] = capture["graph"], None
            return graph

        def synchronize(self):
            pass

    class Event:
        def record(self, stream=None):
            self.t = clock["s"]

        def synchronize(self):
            pass

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class RandomState:
        def __init__(self, seed):
            self.rng = np.random.RandomState(seed)

        def random_sample(self, size, dtype):
            return self.rng.random_sample(size).astype(dtype)

    def raw_kernel(source, name):
        def launch(grid, block, args, stream=None):
            m.log.append(f"spin {int(args[0])}")
        return launch

    m.cuda = types.SimpleNamespace(
        is_available=lambda: available, Device=Device, Stream=Stream, Event=Event,
        get_elapsed_time=lambda start, end: (end.t - start.t) * 1e3,
        runtime=types.SimpleNamespace(memGetInfo=lambda: (79 * 2**30, 80 * 2**30)))
    m.random = types.SimpleNamespace(RandomState=RandomState)
    m.RawKernel = raw_kernel
    m.matmul = matmul
    for name in ("float16", "float32", "float64", "int64", "dtype", "empty", "unique", "linspace", "abs"):
        setattr(m, name, getattr(np, name))
    return m


def fake_torch(*, cuda_available: bool, version="2.13.0+cpu"):
    """A module object with the torch attributes ``gemm_library`` reads (no tensors)."""
    m = types.ModuleType("torch")
    m.__version__ = version
    m.cuda = types.SimpleNamespace(is_available=lambda: cuda_available)
    m.version = types.SimpleNamespace(cuda="12.8" if cuda_available else None)
    return m
