"""The thread-CPU repetition loop of the CPU op probes: a zero reading of the clock is retaken.

The stalled clock that reads zero across a short call was seen on a CI VM and cannot be produced
on demand here, so the retake logic is driven by a scripted clock; the real clock and the real
torch_ops probe run right after.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from gpubench.backends.base import MeasurementSpec, ProbeConfig
from gpubench.backends.cpu.probes import torch_ops_measure
from gpubench.backends.cpu.probes.torch_ops import TorchOpsProbe
from gpubench.probe_worker import build_rows
from vllmref import thread_clock


class _ScriptedClock:
    """``thread_time`` readings that advance by the given steps, one step per call pair."""

    def __init__(self, deltas):
        self.deltas = iter(deltas)
        self.now = 100.0
        self.reads = itertools.count()

    def __call__(self) -> float:
        if next(self.reads) % 2 == 1:  # the closing read of a timed call
            self.now += next(self.deltas)
        return self.now


def test_a_zero_reading_is_retaken_with_its_cold_context(monkeypatch):
    monkeypatch.setattr(thread_clock.time, "thread_time", _ScriptedClock([2e-6, 0.0, 0.0, 3e-6, 4e-6]))
    before_calls, calls = [], []
    times, zero_reads = thread_clock.repeat(lambda: calls.append(1), min_reps=3, max_reps=3, min_timed_s=0.0,
                                            before=lambda: before_calls.append(1))
    assert times == pytest.approx([2e-6, 3e-6, 4e-6]) and zero_reads == 2
    assert len(before_calls) == len(calls) == 5  # each retake ran its untimed context again


def test_a_clock_that_keeps_reading_zero_still_fails_the_row(monkeypatch):
    monkeypatch.setattr(thread_clock.time, "thread_time", _ScriptedClock(itertools.repeat(0.0)))
    seconds, zero_reads = thread_clock.time_once(lambda: None)
    assert seconds == 0.0 and zero_reads == thread_clock.ZERO_READ_RETAKES
    probe = TorchOpsProbe()
    spec = MeasurementSpec(key="k", label="k", params={})
    (row,) = build_rows(probe, "cpu", spec, {"times_s": [seconds] * 3, "zero_reads": zero_reads}, {})
    assert not row["valid"] and "took no time" in row["invalid_reason"]


def test_the_real_clock_times_a_real_op_without_zeros():
    x = torch.randn(2, 8192)
    times, zero_reads = thread_clock.repeat(lambda: torch.nn.functional.rms_norm(x, (8192,)), min_reps=50,
                                            max_reps=50, min_timed_s=0.0)
    assert len(times) == 50 and min(times) > 0 and zero_reads >= 0


def test_torch_ops_rows_carry_the_retake_count():
    probe = TorchOpsProbe()
    cfg = ProbeConfig(quick=True, num_reps=3, device={},
                      options={"torch_ops.size_scale": 0.03, "torch_ops.max_rows": 16})
    spec = next(s for s in probe.plan(cfg) if s.params.get("family") == "segment")
    fields = probe.measure(spec)
    (row,) = build_rows(probe, "cpu", spec, fields, {})
    assert row["valid"], row.get("invalid_reason")
    assert isinstance(row["zero_reads"], int) and row["zero_reads"] >= 0
    assert torch_ops_measure.thread_clock is thread_clock  # the probe times with the shared loop


def test_more_than_one_thread_times_by_the_wall_clock(monkeypatch):
    """At N > 1 threads an op's time is the wall time the calling thread waits, not its own CPU time."""
    monkeypatch.setattr(thread_clock.time, "thread_time", _ScriptedClock([1e-6, 1e-6, 1e-6]))
    monkeypatch.setattr(thread_clock.time, "perf_counter", _ScriptedClock([5e-6, 5e-6, 5e-6]))
    try:
        assert thread_clock.use_threads(2) == "wall"
        times, _ = thread_clock.repeat(lambda: None, min_reps=3, max_reps=3, min_timed_s=0.0)
        assert times == pytest.approx([5e-6] * 3)
        assert thread_clock.use_threads(1) == "thread_cpu"
        times, _ = thread_clock.repeat(lambda: None, min_reps=3, max_reps=3, min_timed_s=0.0)
        assert times == pytest.approx([1e-6] * 3)
    finally:
        thread_clock.use_threads(1)


def test_torch_ops_rows_say_which_clock_timed_them():
    probe = TorchOpsProbe()
    for threads, timer in ((1, "thread_cpu"), (2, "wall")):
        cfg = ProbeConfig(quick=True, num_reps=3, device={},
                          options={"torch_ops.size_scale": 0.03, "torch_ops.max_rows": 16, "torch_ops.num_threads": threads})
        spec = next(s for s in probe.plan(cfg) if s.params.get("family") == "linear")
        try:
            (row,) = build_rows(probe, "cpu", spec, probe.measure(spec), {})
        finally:
            thread_clock.use_threads(1)
            torch.set_num_threads(1)
        assert row["valid"] and row["timer"] == timer and row["num_threads"] == threads
