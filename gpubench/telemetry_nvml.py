"""NVML telemetry for CUDA devices, through ``nvidia-ml-py`` (import name ``pynvml``).

``NvmlTelemetry`` is a ``gpubench.telemetry.TelemetrySource``: the shared ``Sampler`` reads it at
50 Hz around every measurement and ``gpubench.telemetry.aggregate`` turns the samples into row
fields. Per sample it reads the SM clock, memory clock, instant power, temperature, the clock-event
(throttle) reason bits and the energy counter. It only reads: it never changes clocks, power limits
or modes.

Power: the instant-power field value (``NVML_FI_DEV_POWER_INSTANT``) where the driver has it; else
``nvmlDeviceGetPowerUsage``, which on Ampere and newer is a ~1 s average. ``describe()`` says which.

NVML missing (no ``pynvml``, no ``libnvidia-ml.so``, no driver) or failing: every field is None and
``null_reasons()`` carries the reason; the run continues. A field whose call fails later is None
from then on, with that call's error as its reason.

Also here: ``decode_throttle`` (bits -> names) and ``clock_droop`` (docs/bench.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from gpubench.telemetry import LOW_CLOCK_FRACTION, SAMPLE_FIELDS, TelemetrySource

# Clock-event (throttle) reason bits (nvmlClocksEventReason*; the same bits as the older
# nvmlClocksThrottleReason*), in bit order.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

# Droop is measured during the large GEMM (docs/bench.md).
DROOP_GEMM_M = 16384
DROOP_DTYPE = "bf16"


IDLE_BIT = 0x1  # nvmlClocksEventReasonGpuIdle


def decode_throttle(bits: int | None) -> list[str]:
    """Names of the set clock-event reason bits, lowest bit first; unknown bits as ``bit_0x...``.

    ``None`` (not readable) decodes to ``[]``; ``0`` (no reason: running at the requested clock) too.
    """
    if bits is None:
        return []
    bits = int(bits)
    if bits < 0:
        raise ValueError(f"throttle bits must be >= 0 (got {bits})")
    names = []
    bit = 1
    while bit <= bits:
        if bits & bit:
            names.append(THROTTLE_REASONS.get(bit, f"bit_{bit:#x}"))
        bit <<= 1
    return names


def low_clock_flags(clocks_mhz: Iterable[float | None], max_clock_mhz: float | None) -> list[bool | None]:
    """Per sample: True where the SM clock is under 75 % of the max clock (None where unknown)."""
    out: list[bool | None] = []
    for c in clocks_mhz:
        if c is None or not max_clock_mhz:
            out.append(None)
        else:
            out.append(c < LOW_CLOCK_FRACTION * max_clock_mhz)
    return out


@dataclass(frozen=True)
class Droop:
    """Clock droop under the large GEMM: ``1 - mean SM clock / max SM clock``.

    Attributes:
        droop: the fraction (0.262 = 26.2 %), None when it cannot be computed (see ``reason``).
        mean_clock_mhz: mean of the rows' mean SM clocks.
        max_clock_mhz: the reference (NVML max SM clock recorded in the rows).
        num_rows: how many GEMM rows (each a mean over its samples) went into it.
        reason: why ``droop`` is None.
    """

    droop: float | None
    mean_clock_mhz: float | None
    max_clock_mhz: float | None
    num_rows: int
    reason: str | None = None


def clock_droop(rows, *, m: int = DROOP_GEMM_M, dtype: str | None = DROOP_DTYPE) -> Droop:
    """Droop from ``gemm`` rows (dicts or a DataFrame): the valid rows with ``m`` (and ``dtype``).

    The droop rows of a CUDA run are the bf16 GEMMs at M = 16384 (five shapes, so n = 5 means).
    Rows without a clock reading are left out; the reason says when none is left.
    """
    if hasattr(rows, "to_dict"):
        rows = rows.to_dict("records")
    picked = [r for r in rows if _num(r.get("m")) == m and (dtype is None or r.get("dtype") == dtype)
              and r.get("valid", True) is not False]
    if not picked:
        return Droop(None, None, None, 0, f"no valid gemm rows at M={m}" + (f" in {dtype}" if dtype else ""))
    clocks = [c for c in (_num(r.get("clock_mhz_mean")) for r in picked) if c is not None]
    refs = [x for x in (_num(r.get("clock_max_ref_mhz")) for r in picked) if x]
    if not clocks:
        why = next((r.get("telemetry_null_reason") for r in picked if r.get("telemetry_null_reason")), None)
        return Droop(None, None, max(refs) if refs else None, 0,
                     f"no SM clock in the {len(picked)} gemm rows at M={m}" + (f" ({_clock_reason(why)})" if why else ""))
    if not refs:
        return Droop(None, sum(clocks) / len(clocks), None, len(clocks), "no max SM clock recorded")
    mean = sum(clocks) / len(clocks)
    ref = max(refs)
    return Droop(1.0 - mean / ref, mean, ref, len(clocks))


def _clock_reason(why) -> str:
    if isinstance(why, dict):
        return str(why.get("clock_mhz") or next(iter(why.values()), ""))
    return str(why)


def _num(v) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


class NvmlTelemetry(TelemetrySource):
    """NVML readings of one GPU. Never raises: what fails is None with a reason.

    Args:
        index: NVML device index (used when ``pci_bus_id`` is not given).
        pci_bus_id: the CUDA device's PCI bus id; preferred, because CUDA and NVML may order devices
            differently (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``).
        nvml: the ``pynvml`` module (tests pass a fake); imported when None.
    """

    # Set by _pick_power / _pick_throttle once NVML is up (None: no reading of that kind).
    _power: Callable[[], float] | None
    _throttle: Callable[[Any], int] | None

    def __init__(self, index: int = 0, *, pci_bus_id: str | None = None, nvml: Any = None):
        self._reasons: dict[str, str] = {}
        self._nvml: Any = None  # the pynvml module (or a test's fake); None once NVML failed
        self._handle: Any = None
        self._max_mhz: float | None = None
        self.power_source: str | None = None
        self.throttle_source: str | None = None
        self.device_name: str | None = None
        self.driver_version: str | None = None
        self.mig_mode: int | None = None       # 1: MIG enabled (nvmlDeviceGetMigMode, current)
        self.compute_mode: int | None = None   # 0 default, 2 prohibited, 3 exclusive process
        try:
            if nvml is None:
                import pynvml  # noqa: PLC0415 - optional dependency

                nvml = pynvml
            nvml.nvmlInit()
        except ImportError:
            self._fail("nvidia-ml-py is not installed (pip install nvidia-ml-py)")
            return
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self._fail(f"NVML unavailable: nvmlInit failed ({_err(exc)})")
            return
        self._nvml = nvml
        try:
            if pci_bus_id:
                get = getattr(nvml, "nvmlDeviceGetHandleByPciBusId_v2", None) or nvml.nvmlDeviceGetHandleByPciBusId
                self._handle = get(pci_bus_id)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # noqa: BLE001
            where = f"PCI bus id {pci_bus_id}" if pci_bus_id else f"index {index}"
            self._fail(f"NVML has no device at {where} ({_err(exc)})")
            return
        self.device_name = self._try(lambda: _text(nvml.nvmlDeviceGetName(self._handle)), None)
        self.driver_version = self._try(lambda: _text(nvml.nvmlSystemGetDriverVersion()), None)
        self._max_mhz = self._try(lambda: float(nvml.nvmlDeviceGetMaxClockInfo(self._handle, nvml.NVML_CLOCK_SM)),
                                  "max_clock_mhz")
        self._pick_power()
        self._pick_throttle()
        # A MIG slice or a non-default compute mode changes what a probe measures (a slice's SMs,
        # exclusive-process contention): record both with the run.
        self.mig_mode = self._try(lambda: int(nvml.nvmlDeviceGetMigMode(self._handle)[0]), None)
        self.compute_mode = self._try(lambda: int(nvml.nvmlDeviceGetComputeMode(self._handle)), None)

    # ------------------------------------------------------------ setup helpers
    def _fail(self, reason: str) -> None:
        self._nvml = None
        self._handle = None
        for f in SAMPLE_FIELDS:
            self._reasons[f] = reason
        self._reasons["max_clock_mhz"] = reason

    def _try(self, fn, field: str | None):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            if field:
                self._reasons[field] = _err(exc)
            return None

    def _instant_power_w(self) -> float:
        nv = self._nvml
        (v,) = nv.nvmlDeviceGetFieldValues(self._handle, [nv.NVML_FI_DEV_POWER_INSTANT])
        if getattr(v, "nvmlReturn", 0) != 0:
            raise RuntimeError(f"field value NVML_FI_DEV_POWER_INSTANT returned {v.nvmlReturn}")
        return _field_value(v) / 1000.0  # mW

    def _average_power_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # mW

    def _pick_power(self) -> None:
        """Instant power field where the driver has it, else the ~1 s average (and say so)."""
        try:
            self._instant_power_w()
            self._power = self._instant_power_w
            self.power_source = "nvmlDeviceGetFieldValues(NVML_FI_DEV_POWER_INSTANT) (instant)"
            return
        except Exception as exc:  # noqa: BLE001
            instant_error = _err(exc)
        try:
            self._average_power_w()
            self._power = self._average_power_w
            self.power_source = (f"nvmlDeviceGetPowerUsage (~1 s average on Ampere and newer; the instant field "
                                 f"failed: {instant_error})")
        except Exception as exc:  # noqa: BLE001
            self._power = None
            self._reasons["power_w"] = f"no power reading: instant field failed ({instant_error}), " \
                                       f"nvmlDeviceGetPowerUsage failed ({_err(exc)})"

    def _pick_throttle(self) -> None:
        nv = self._nvml
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                fn(self._handle)
            except Exception as exc:  # noqa: BLE001
                self._reasons["throttle_bits"] = f"{name} failed ({_err(exc)})"
                continue
            self._throttle = fn
            self.throttle_source = name
            self._reasons.pop("throttle_bits", None)
            return
        self._throttle = None
        self._reasons.setdefault("throttle_bits", "this pynvml has no clock-event reason call")

    # ------------------------------------------------------------ TelemetrySource
    def sample(self) -> dict:
        s = dict.fromkeys(SAMPLE_FIELDS)
        if self._handle is None:
            return s
        nv, h = self._nvml, self._handle
        s["clock_mhz"] = self._read("clock_mhz", lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)))
        s["mem_clock_mhz"] = self._read("mem_clock_mhz", lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)))
        if self._power is not None:
            s["power_w"] = self._read("power_w", self._power)
        s["temp_c"] = self._read("temp_c", lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
        if self._throttle is not None:
            # The idle bit (0x1) says the GPU had no work at the instant of the sample: not a reason
            # the clocks were low under load, so it is dropped from the bits; it marks the sample
            # instead (``gpu_idle``), and the aggregate keeps clocks and power of busy samples only.
            raw = self._read("throttle_bits", lambda: int(self._throttle(h)))
            if raw is not None:
                s["throttle_bits"] = raw & ~IDLE_BIT
                s["gpu_idle"] = bool(raw & IDLE_BIT)
        s["energy_j"] = self._read("energy_j", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0)  # mJ
        return s

    def _read(self, field: str, fn):
        """One reading; a call that failed once stays off (its reason kept), so a sample stays cheap."""
        if field in self._reasons:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            self._reasons[field] = _err(exc)
            return None

    def null_reasons(self) -> dict[str, str]:
        return {k: v for k, v in self._reasons.items() if k in SAMPLE_FIELDS}

    @property
    def max_clock_mhz(self) -> float | None:
        return self._max_mhz

    @property
    def available(self) -> bool:
        """NVML initialised and the device found."""
        return self._handle is not None

    def describe(self) -> dict:
        d = super().describe()
        d.update({"available": self.available, "power_source": self.power_source,
                  "throttle_source": self.throttle_source, "nvml_device_name": self.device_name,
                  "driver_version": self.driver_version, "low_clock_threshold": LOW_CLOCK_FRACTION,
                  "mig_mode": self.mig_mode, "compute_mode": self.compute_mode,
                  "throttle_idle_bit_dropped": True,
                  "throttle_reason_bits": {hex(b): n for b, n in THROTTLE_REASONS.items()}})
        if "max_clock_mhz" in self._reasons:
            d["max_clock_note"] = self._reasons["max_clock_mhz"]
        return d

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down is best effort
                pass
            self._nvml = None
            self._handle = None


# nvmlValueType_t -> the union member holding the value.
_VALUE_ATTR = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}


def _field_value(v) -> float:
    """The numeric value of an nvmlFieldValue_t (instant power is an unsigned int in mW)."""
    return float(getattr(v.value, _VALUE_ATTR.get(getattr(v, "valueType", 1), "uiVal")))


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _err(exc: BaseException) -> str:
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
