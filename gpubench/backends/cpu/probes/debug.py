"""Hidden probes for the fault-isolation tests: never in a default run, only when named.

Each writes one good row first (so a test can check that rows taken before a crash are kept),
then on its second measurement: ``debug_crash`` raises SIGSEGV inside the C++ extension,
``debug_abort`` calls abort(), ``debug_hang`` sleeps past any time budget, ``debug_error`` raises
a Python exception.
"""
from __future__ import annotations

import time

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig


class DebugProbe(Probe):
    timer = "steady_clock"
    time_budget_s = 600.0

    def __init__(self, name: str):
        self.name = name
        self.description = f"debug: {name.removeprefix('debug_')} on purpose"

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        return [MeasurementSpec(key=f"{self.name}_ok", params={"fail": False}),
                MeasurementSpec(key=f"{self.name}_fail", params={"fail": True})]

    def measure(self, spec: MeasurementSpec) -> dict:
        from gpubench import _cpu

        if spec.params["fail"]:
            if self.name == "debug_crash":
                _cpu.debug_segfault()
            elif self.name == "debug_abort":
                _cpu.debug_abort()
            elif self.name == "debug_hang":
                time.sleep(3600)
            else:
                raise RuntimeError("debug_error: a probe raised on purpose")
        times = _cpu.omp_fork_join(10, 3)
        return {"times_s": list(times), "valid": True, "count": 10}
