"""NVML telemetry: throttle decoding, aggregation of recorded samples, droop, the real no-NVML path,
and a fake pynvml module for the happy path."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from gpubench.telemetry import Sampler, aggregate
from gpubench.telemetry_nvml import THROTTLE_REASONS, NvmlTelemetry, clock_droop, decode_throttle, low_clock_flags

_spec = importlib.util.spec_from_file_location("test_cuda_fakes", pathlib.Path(__file__).with_name("test_cuda_fakes.py"))
fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fakes)


# ------------------------------------------------------------------ throttle bits

def test_decode_throttle_names_each_documented_bit():
    # Bits from /work/shared/reference/hardware.md: 0x1 idle, 0x2 app clocks, 0x4 sw power cap,
    # 0x8 hw slowdown, 0x20 sw thermal, 0x40 hw thermal, 0x80 power brake.
    assert decode_throttle(0x1) == ["gpu_idle"]
    assert decode_throttle(0x2) == ["applications_clocks_setting"]
    assert decode_throttle(0x4) == ["sw_power_cap"]
    assert decode_throttle(0x8) == ["hw_slowdown"]
    assert decode_throttle(0x20) == ["sw_thermal_slowdown"]
    assert decode_throttle(0x40) == ["hw_thermal_slowdown"]
    assert decode_throttle(0x80) == ["hw_power_brake_slowdown"]


def test_decode_throttle_combinations_unknown_bits_and_none():
    assert decode_throttle(0x4 | 0x20 | 0x1) == ["gpu_idle", "sw_power_cap", "sw_thermal_slowdown"]
    assert decode_throttle(0) == []
    assert decode_throttle(None) == []
    assert decode_throttle(0x1000 | 0x8) == ["hw_slowdown", "bit_0x1000"]
    with pytest.raises(ValueError):
        decode_throttle(-1)


def test_throttle_table_matches_pynvml_constants():
    pynvml = pytest.importorskip("pynvml")
    names = {"GpuIdle": "gpu_idle", "ApplicationsClocksSetting": "applications_clocks_setting",
             "SwPowerCap": "sw_power_cap", "HwSlowdown": "hw_slowdown", "SyncBoost": "sync_boost",
             "SwThermalSlowdown": "sw_thermal_slowdown", "HwThermalSlowdown": "hw_thermal_slowdown",
             "HwPowerBrakeSlowdown": "hw_power_brake_slowdown", "DisplayClockSetting": "display_clock_setting"}
    for suffix, ours in names.items():
        bit = getattr(pynvml, f"nvmlClocksEventReason{suffix}")
        assert THROTTLE_REASONS[bit] == ours


# ------------------------------------------------------------------ aggregation of recorded samples

# A recorded 50 Hz sequence: clock ramps down under a power cap, one sample under 75 % of 1980 MHz.
RECORDED = [
    (0.00, {"clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "power_w": 320.0, "temp_c": 48.0, "throttle_bits": 0x0, "energy_j": 100.0}),
    (0.02, {"clock_mhz": 1830.0, "mem_clock_mhz": 2619.0, "power_w": 690.0, "temp_c": 55.0, "throttle_bits": 0x4, "energy_j": 113.8}),
    (0.04, {"clock_mhz": 1755.0, "mem_clock_mhz": 2619.0, "power_w": 700.0, "temp_c": 61.0, "throttle_bits": 0x4, "energy_j": 127.8}),
    (0.06, {"clock_mhz": 1410.0, "mem_clock_mhz": 2619.0, "power_w": 700.0, "temp_c": 66.0, "throttle_bits": 0x24, "energy_j": 141.8}),
]


def test_aggregate_recorded_nvml_samples():
    agg = aggregate(RECORDED, 1980.0)
    assert agg["clock_mhz_mean"] == pytest.approx((1980 + 1830 + 1755 + 1410) / 4)
    assert agg["clock_mhz_min"] == 1410.0 and agg["clock_mhz_max"] == 1980.0
    assert agg["low_clock_frac"] == pytest.approx(0.25)  # 1410 < 0.75 * 1980 = 1485
    assert agg["power_w_mean"] == pytest.approx((320 + 690 + 700 + 700) / 4)
    assert agg["temp_c_max"] == 66.0
    assert agg["throttle_bits"] == 0x24
    assert decode_throttle(agg["throttle_bits"]) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert agg["energy_j"] == pytest.approx(41.8)
    assert agg["telemetry_null_reason"] is None


def test_low_clock_flags_per_sample():
    assert low_clock_flags([1980, 1485, 1484.9, None], 1980) == [False, False, True, None]
    assert low_clock_flags([1000], None) == [None]


# ------------------------------------------------------------------ droop

def _gemm_row(m, clock, dtype="bf16", ref=1980.0, valid=True):
    return {"m": m, "dtype": dtype, "clock_mhz_mean": clock, "clock_max_ref_mhz": ref, "valid": valid}


def test_clock_droop_from_the_five_large_gemm_rows():
    rows = [_gemm_row(16384, c) for c in (1500.0, 1450.0, 1460.0, 1480.0, 1420.0)]
    rows += [_gemm_row(512, 1980.0), _gemm_row(16384, 1980.0, dtype="fp16"), _gemm_row(16384, 100.0, valid=False)]
    d = clock_droop(rows)
    assert d.num_rows == 5
    assert d.mean_clock_mhz == pytest.approx(1462.0)
    assert d.droop == pytest.approx(1 - 1462.0 / 1980.0)
    assert d.reason is None


def test_clock_droop_accepts_a_dataframe_and_explains_missing_data():
    import pandas as pd

    df = pd.DataFrame([_gemm_row(16384, 1700.0), _gemm_row(16384, 1800.0)])
    assert clock_droop(df).droop == pytest.approx(1 - 1750.0 / 1980.0)
    none = clock_droop([_gemm_row(512, 1900.0)])
    assert none.droop is None and "M=16384" in none.reason
    no_clock = [dict(_gemm_row(16384, None), telemetry_null_reason={"clock_mhz": "NVML unavailable: nvmlInit failed"})]
    d = clock_droop(no_clock)
    assert d.droop is None and "NVML unavailable" in d.reason


# ------------------------------------------------------------------ the real no-NVML path

def test_no_nvml_on_this_machine_gives_nulls_with_reason_and_the_sampler_runs():
    """This machine has no NVIDIA driver: nvmlInit really fails; nothing may raise."""
    src = NvmlTelemetry(0)
    if src.available:
        pytest.skip("this machine has a working NVML")
    reasons = src.null_reasons()
    assert set(reasons) >= {"clock_mhz", "mem_clock_mhz", "power_w", "temp_c", "throttle_bits", "energy_j"}
    assert all(("NVML" in r or "nvidia-ml-py" in r) for r in reasons.values())
    assert src.max_clock_mhz is None
    with Sampler(src, hz=200) as s:
        sum(range(10000))
    agg = s.aggregate()
    assert agg["clock_mhz_mean"] is None and agg["power_w_mean"] is None and agg["throttle_bits"] is None
    assert agg["telemetry_samples"] >= 2
    assert "NVML" in agg["telemetry_null_reason"]["clock_mhz"] or "nvidia-ml-py" in agg["telemetry_null_reason"]["clock_mhz"]
    d = src.describe()
    assert d["available"] is False and d["source"] == "NvmlTelemetry"
    src.close()


def test_nvml_init_failure_from_a_module_is_a_reason_not_an_error():
    src = NvmlTelemetry(0, nvml=fakes.fake_pynvml(fail_init="Driver Not Loaded"))
    assert not src.available
    assert "Driver Not Loaded" in src.null_reasons()["power_w"]
    assert all(v is None for v in src.sample().values())


# ------------------------------------------------------------------ happy path (fake pynvml)

def test_fake_nvml_samples_instant_power_and_event_reasons():
    nv = fakes.fake_pynvml()
    src = NvmlTelemetry(0, pci_bus_id="00000000:19:00.0", nvml=nv)
    assert src.available and src.max_clock_mhz == 1980.0
    assert "POWER_INSTANT" in src.power_source
    assert src.throttle_source == "nvmlDeviceGetCurrentClocksEventReasons"
    samples = [(i * 0.02, src.sample()) for i in range(6)]
    clocks = [s["clock_mhz"] for _, s in samples]
    assert clocks[:3] == [1755.0, 1410.0, 1980.0]  # the fake advances one reading per sample
    assert all(s["power_w"] in (650.0, 690.0, 700.0) for _, s in samples)
    agg = aggregate(samples, src.max_clock_mhz, null_reasons=src.null_reasons())
    assert agg["low_clock_frac"] == pytest.approx(2 / 6)  # 1410 twice
    assert agg["throttle_bits"] == 0x24
    assert agg["mem_clock_mhz_mean"] == 2619.0
    assert agg["energy_j"] == pytest.approx(15.0 * 5)
    assert agg["telemetry_null_reason"] is None
    src.close()
    assert nv.state["shutdown"] == 1


def test_fake_nvml_falls_back_to_average_power_and_old_throttle_api_and_says_so():
    src = NvmlTelemetry(0, nvml=fakes.fake_pynvml(instant_power=False, old_throttle_api=True))
    assert src.power_source.startswith("nvmlDeviceGetPowerUsage") and "1 s average" in src.power_source
    assert src.throttle_source == "nvmlDeviceGetCurrentClocksThrottleReasons"
    s = src.sample()
    assert s["power_w"] in (650.0, 690.0, 700.0) and s["throttle_bits"] in (0x0, 0x4, 0x24)
    assert src.describe()["power_source"] == src.power_source


def test_a_field_that_starts_failing_goes_null_with_its_reason():
    nv = fakes.fake_pynvml()
    src = NvmlTelemetry(0, nvml=nv)

    def broken(h, kind):
        raise nv.NVMLError("GPU is lost")

    nv.nvmlDeviceGetTemperature = broken
    s = src.sample()
    assert s["temp_c"] is None and s["clock_mhz"] is not None
    assert "GPU is lost" in src.null_reasons()["temp_c"]
    with Sampler(src, hz=100) as sampler:
        pass
    agg = sampler.aggregate()
    assert agg["temp_c_max"] is None and "GPU is lost" in agg["telemetry_null_reason"]["temp_c"]
    assert agg["clock_mhz_mean"] is not None
