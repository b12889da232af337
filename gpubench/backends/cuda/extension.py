"""Loading ``gpubench._cuda`` and calling it with its errors mapped onto gpubench's."""
from __future__ import annotations

from common import errors

NUM_WARMUP = 2  # untimed repetitions before the recorded ones (the stats also drop the first recorded)


def load_extension():
    """``gpubench._cuda``, or NoDeviceError saying why it cannot be imported.

    Sets ``CUDA_MODULE_LOADING=EAGER`` (unless the user set it) before the runtime starts: with
    lazy loading (the default since CUDA 12.2) a kernel's first launch waits for the device to go
    idle, which deadlocks behind the probes' spin gate. The kernels preload themselves too
    (``preload_kernels`` in csrc/cuda); this covers a runtime the process had not started yet.
    """
    import os

    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    try:
        from gpubench import _cuda
    except ImportError as exc:
        raise errors.NoDeviceError(
            f"gpubench._cuda is not built ({exc}); rebuild with nvcc on PATH (GPUBENCH_CUDA=1 pip install -e .)"
        ) from None
    check_formatting(_cuda)
    return _cuda


# What csrc/cuda's format_selftest must return: the formatter every message and check line uses, on
# fixed values. On the first H200 machine the extension's iostreams printed integers as nothing and
# two probes crashed formatting a double; a build or process where formatting is broken stops here,
# before any probe, in one line.
FORMAT_SELFTEST_EXPECTED = ("int -42, long long -9000000000, unsigned long long 18446744073709551615, size_t 4096, "
                            "double 0.125, string ok")


def check_formatting(module) -> None:
    """RuntimeError naming the difference when the extension formats fixed values wrongly."""
    selftest = getattr(module, "format_selftest", None)
    if selftest is None:  # an extension built before the self-test existed
        return
    got = selftest()
    if got != FORMAT_SELFTEST_EXPECTED:
        raise RuntimeError(f"gpubench._cuda formats numbers wrongly in this process (got {got!r}, expected "
                           f"{FORMAT_SELFTEST_EXPECTED!r}): its messages and check lines cannot be trusted; "
                           "rebuild it (scripts/build_cuda_ext.sh) and report the toolchain (c++ --version, ldd)")


class Extension:
    """Calls into ``gpubench._cuda`` (or a stand-in with the same functions) with its errors mapped.

    ``NoDeviceError`` -> ``common.errors.NoDeviceError``; ``DeviceMemoryError`` ->
    ``common.errors.DeviceMemoryError``; ``CudaError`` (a failing CUDA call, named with file:line)
    stays a RuntimeError: it is a fault of the device or of gpubench, not of the user.
    """

    def __init__(self, module, index: int):
        self.module = module
        self.index = index

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)

        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - mapped below by the extension's own classes
                mapped = self._map(exc)
                if mapped is None:
                    raise
                raise mapped from None

        return call

    def _map(self, exc: Exception) -> Exception | None:
        no_dev = getattr(self.module, "NoDeviceError", None)
        no_mem = getattr(self.module, "DeviceMemoryError", None)
        if no_dev is not None and isinstance(exc, no_dev):
            return errors.NoDeviceError(f"cuda:{self.index}: {exc}")
        if no_mem is not None and isinstance(exc, no_mem):
            return errors.DeviceMemoryError(f"cuda:{self.index}: {exc}")
        return None
