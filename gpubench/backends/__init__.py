"""Backends: ``get_backend("cpu" | "cuda:N" | "auto")``.

The CUDA backend lives in ``gpubench.backends.cuda`` and is imported lazily. Its contract with this
module: it defines ``CudaBackend(index: int)`` (a ``Backend``), whose constructor raises
``common.errors.NoDeviceError`` with a clear message when there is no usable device.
"""
from __future__ import annotations

import re

from common.errors import ConfigError, NoDeviceError
from gpubench.backends.base import Backend, MeasurementSpec, Probe, ProbeConfig

__all__ = ["Backend", "MeasurementSpec", "Probe", "ProbeConfig", "get_backend", "resolve_device"]


def resolve_device(device: str) -> tuple[str, int | None]:
    """Parse ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` into (kind, index); ConfigError otherwise."""
    d = device.strip().lower()
    if d in ("cpu", "auto"):
        return d, None
    m = re.fullmatch(r"cuda(?::(\d+))?", d)
    if m:
        return "cuda", int(m.group(1) or 0)
    raise ConfigError(f"unknown --device '{device}' (expected auto, cpu or cuda:N)")


def _cuda_backend(index: int) -> Backend:
    try:
        from gpubench.backends.cuda import CudaBackend
    except ImportError as exc:
        raise NoDeviceError(f"the CUDA backend is not available ({exc})") from None
    return CudaBackend(index)


def get_backend(device: str = "auto") -> tuple[Backend, str]:
    """The backend for ``--device`` and one line saying which device was picked and why.

    ``auto`` tries CUDA device 0 and falls back to the CPU on ``NoDeviceError``; an explicit
    ``cuda:N`` that is not usable raises ``NoDeviceError`` (one line at the CLI).
    """
    kind, index = resolve_device(device)
    if kind == "cpu":
        from gpubench.backends.cpu import CpuBackend

        cpu = CpuBackend()
        return cpu, f"device: cpu ({cpu.device_name()})"
    if kind == "cuda":
        b = _cuda_backend(index or 0)
        return b, f"device: cuda:{index} ({b.device_name()})"
    try:
        b = _cuda_backend(0)
        return b, f"device auto: picked cuda:0 ({b.device_name()})"
    except NoDeviceError as exc:
        from gpubench.backends.cpu import CpuBackend

        b = CpuBackend()
        b.gpu_unusable = str(exc)  # why not the GPU: a GPU SKU asked for then says so (skus.check_matches)
        return b, f"device auto: no usable GPU ({exc}); picked cpu ({b.device_name()})"
