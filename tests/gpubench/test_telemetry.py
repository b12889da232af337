"""Telemetry: aggregation of recorded samples, the sampler thread, and the CPU source on real files."""
from __future__ import annotations

import time

import pytest

from gpubench.telemetry import CpuTelemetry, Sampler, TelemetrySource, aggregate

# A recorded sequence (t, sample): a clock sag to 1.2 GHz, throttle bits 0x4 then 0x20, an energy counter.
RECORDED = [
    (0.00, {"clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "power_w": 650.0, "temp_c": 61, "throttle_bits": 0, "energy_j": 1000.0}),
    (0.02, {"clock_mhz": 1755.0, "mem_clock_mhz": 2619.0, "power_w": 700.0, "temp_c": 63, "throttle_bits": 0x4, "energy_j": 1014.0}),
    (0.04, {"clock_mhz": 1200.0, "mem_clock_mhz": 2619.0, "power_w": 690.0, "temp_c": 66, "throttle_bits": 0x20, "energy_j": 1028.0}),
    (0.06, {"clock_mhz": 1425.0, "mem_clock_mhz": 2619.0, "power_w": None, "temp_c": 65, "throttle_bits": 0, "energy_j": 1042.5}),
]


def test_aggregate_recorded_samples():
    a = aggregate(RECORDED, max_ref_mhz=1980.0)
    assert a["clock_mhz_mean"] == pytest.approx((1980 + 1755 + 1200 + 1425) / 4)
    assert (a["clock_mhz_min"], a["clock_mhz_max"]) == (1200.0, 1980.0)
    assert a["low_clock_frac"] == pytest.approx(0.5)  # 1200 and 1425 are < 0.75 * 1980 = 1485
    assert a["power_w_mean"] == pytest.approx((650 + 700 + 690) / 3)
    assert a["energy_j"] == pytest.approx(42.5)
    assert a["temp_c_max"] == 66
    assert a["throttle_bits"] == 0x24
    assert a["telemetry_samples"] == 4
    assert a["telemetry_null_reason"] is None


def test_aggregate_nulls_carry_reasons():
    samples = [{"clock_mhz": 2400.0, "energy_j": None}, {"clock_mhz": 2300.0, "energy_j": None}]
    a = aggregate(samples, max_ref_mhz=None, null_reasons={"energy_j": "no RAPL"})
    assert a["low_clock_frac"] is None and a["energy_j"] is None
    assert a["telemetry_null_reason"]["energy_j"] == "no RAPL"
    assert "power_w" in a["telemetry_null_reason"]
    wrapped = aggregate([{"energy_j": 10.0}, {"energy_j": 2.0}], 1.0)
    assert wrapped["energy_j"] is None and "backwards" in wrapped["telemetry_null_reason"]["energy_j"]
    empty = aggregate([], 1000.0)
    assert empty["telemetry_samples"] == 0 and empty["telemetry_null_reason"]["clock_mhz"] == "no samples"


class CountingSource(TelemetrySource):
    """A real source whose clock steps down each sample (no mocks: it is a small implementation)."""

    def __init__(self, fail_after: int | None = None):
        self.calls = 0
        self.fail_after = fail_after

    def sample(self):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise OSError("sensor went away")
        return {"clock_mhz": 2000.0 - self.calls, "mem_clock_mhz": None, "power_w": None, "temp_c": None,
                "throttle_bits": None, "energy_j": float(self.calls)}

    def null_reasons(self):
        return {"power_w": "not measured in this test"}

    @property
    def max_clock_mhz(self):
        return 2000.0


def test_sampler_thread_collects_at_rate():
    src = CountingSource()
    with Sampler(src, hz=100) as s:
        time.sleep(0.25)
    assert 10 <= len(s.samples) <= 40  # ~25 plus entry/exit, with slack for a loaded machine
    ts = [t for t, _ in s.samples]
    assert ts == sorted(ts)
    a = s.aggregate()
    assert a["telemetry_samples"] == len(s.samples)
    assert a["energy_j"] == pytest.approx(len(s.samples) - 1)
    assert a["telemetry_null_reason"]["power_w"] == "not measured in this test"


def test_sampler_survives_a_failing_sensor():
    with Sampler(CountingSource(fail_after=2), hz=200) as s:
        time.sleep(0.05)
    assert len(s.samples) == 2 and "sensor went away" in s.error
    assert "sensor went away" in s.aggregate()["telemetry_null_reason"]["sampler"]


def _fake_tree(tmp_path, with_cpufreq: bool, rapl: bool):
    sysfs, procfs = tmp_path / "sys", tmp_path / "proc"
    procfs.mkdir(parents=True)
    (procfs / "cpuinfo").write_text("processor\t: 0\ncpu MHz\t\t: 2100.000\n\nprocessor\t: 1\ncpu MHz\t\t: 2300.000\n")
    for c, khz in ((0, 3000000), (1, 2000000)):
        d = sysfs / f"devices/system/cpu/cpu{c}/cpufreq"
        if with_cpufreq:
            d.mkdir(parents=True)
            (d / "scaling_cur_freq").write_text(str(khz))
            (d / "cpuinfo_max_freq").write_text("3500000")
    if rapl:
        z = sysfs / "class/powercap/intel-rapl:0"
        z.mkdir(parents=True)
        (z / "energy_uj").write_text("5000000")
    return str(sysfs), str(procfs)


def test_cpu_source_cpufreq_and_rapl(tmp_path):
    sysfs, procfs = _fake_tree(tmp_path, with_cpufreq=True, rapl=True)
    src = CpuTelemetry([0, 1], sysfs_root=sysfs, procfs_root=procfs)
    s = src.sample()
    assert s["clock_mhz"] == pytest.approx(2500.0) and s["energy_j"] == pytest.approx(5.0)
    assert src.max_clock_mhz == 3500.0 and "energy_j" not in src.null_reasons()
    assert src.describe()["clock_source"] == "sysfs cpufreq scaling_cur_freq"


def test_cpu_source_without_cpufreq_or_rapl(tmp_path):
    sysfs, procfs = _fake_tree(tmp_path, with_cpufreq=False, rapl=False)
    src = CpuTelemetry([0, 1], sysfs_root=sysfs, procfs_root=procfs)
    s = src.sample()
    assert s["clock_mhz"] == pytest.approx(2200.0) and s["energy_j"] is None
    assert "no RAPL" in src.null_reasons()["energy_j"]
    assert "no cpufreq" in src.describe()["clock_note"]


def test_cpu_source_on_this_machine():
    src = CpuTelemetry()
    s = src.sample()
    assert set(s) >= {"clock_mhz", "energy_j", "power_w", "temp_c", "throttle_bits", "mem_clock_mhz"}
    for field, value in s.items():
        assert value is not None or field in src.null_reasons(), field


def test_proc_cpu_util_from_recorded_samples():
    samples = [(10.0, {"clock_mhz": 2000.0, "proc_cpu_s": 5.0}), (10.5, {"clock_mhz": 2000.0, "proc_cpu_s": 5.6}),
               (11.0, {"clock_mhz": 2000.0, "proc_cpu_s": 6.5})]
    assert aggregate(samples, 2000.0)["proc_cpu_util"] == pytest.approx(1.5)
    assert aggregate(RECORDED, 1980.0)["proc_cpu_util"] is None


def test_proc_cpu_util_sees_a_busy_thread():
    src = CpuTelemetry()
    with Sampler(src, hz=50) as s:
        t_end = time.monotonic() + 0.3
        x = 0
        while time.monotonic() < t_end:
            x += 1
    util = s.aggregate()["proc_cpu_util"]
    assert util is not None and 0.05 < util < 2.5
