"""What the CUDA probes share: the row fields of an extension result, the size sweep, spec peaks,
the probe base class that holds the backend."""
from __future__ import annotations

from typing import TYPE_CHECKING

from common import errors
from gpubench import skus
from gpubench.backends.base import Probe, ProbeConfig
from gpubench.backends.cuda.extension import Extension

if TYPE_CHECKING:
    from gpubench.backends.cuda.backend import CudaBackend

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def fp8_mma_native(cc: int) -> bool:
    """fp8 ``mma.sync`` is a tensor-core QMMA on compute capability 8.9 (Ada) and 12.x (consumer
    Blackwell) only; on 9.0 and 10.x ptxas emulates it with fp16 HMMA + FADD (scripts/check_sass.py
    counts it), so a row there would credit the tensor cores with work they did not do. The same
    rule is ``fp8_mma_native`` in csrc/cuda/peak.cu."""
    return cc == 89 or cc // 10 == 12


def probe_row(key: str, res: dict, timer: str, **fields) -> dict:
    """Row fields common to the CUDA probes from an extension result dict."""
    row = {"key": key, "timer": timer, "times_s": [float(t) for t in res["times_s"]],
           "valid": bool(res["valid"]), "check": res["check"]}
    row.update(fields)
    if not row["valid"]:
        row["invalid_reason"] = res["check"]
    return row


def _geometric(lo: int, hi: int, factor: float, align: int) -> list[int]:
    """lo, lo*factor, ... (aligned, increasing), with hi itself as the last size.

    Not ``gpubench.backends.probe_common.geometric``: there a step that rounds up past ``hi`` ends the
    sweep above it, here ``hi`` (the free-device-memory bound) is never exceeded; the two give
    different sizes for some bounds, so sharing one would change one backend's plan."""
    if lo <= 0 or hi < lo or factor <= 1:
        raise errors.ConfigError(f"bad size sweep: lo={lo} hi={hi} factor={factor}")
    out: list[int] = []
    v = float(lo)
    while v < hi * (1 - 1e-9):
        a = max(align, int(round(v / align)) * align)
        if not out or a > out[-1]:
            out.append(a)
        v *= factor
    top = max(align, hi // align * align)
    if not out or top > out[-1]:
        out.append(top)
    return out


def device_props(cfg: ProbeConfig) -> dict:
    return cfg.device.get("properties", {})


def spec_tflops(sku: skus.SKU | None, dtype: str) -> float | None:
    if sku is None:
        return None
    try:
        return sku.peak_flops(dtype) / 1e12
    except errors.ConfigError:
        return None


class CudaProbe(Probe):
    def __init__(self, backend: "CudaBackend"):
        self.backend = backend

    @property
    def ext(self) -> Extension:
        return self.backend.ext


def spec_formula(sku: skus.SKU | None, dtype: str) -> str | None:
    """The SKU identity behind spec_tflops, spelled out (SMs x units x FMA/clk x 2 x clock)."""
    if sku is None or spec_tflops(sku, dtype) is None:
        return None
    if dtype == "fp32":
        return f"{sku.sm_count} SM x {sku.fp32_fma_per_sm_per_clk} FMA/clk x 2 x {sku.max_boost_mhz:.0f} MHz"
    return (f"{sku.sm_count} SM x {sku.tensor_cores_per_sm} TC x {sku.fma_per_tc_per_clk[dtype]} FMA/clk x 2 x "
            f"{sku.spec_clock_mhz:.0f} MHz")
