"""Launch costs on the CPU: what it costs to start a unit of work, per launch.

Kinds (``kind`` field):
- ``omp_fork_join``: an empty OpenMP parallel region (fork the team, join at the barrier), timed
  in C++ with steady_clock over ``count`` regions; the CPU's analogue of a kernel launch.
- ``py_ext_call``: calling a bound no-op C++ function from Python, timed with
  ``time.perf_counter`` (host clock, CLOCK_MONOTONIC) around a loop of ``count`` calls; the loop's
  own cost is included (it is part of what a Python framework pays per op).
- ``torch_dispatch``: ``torch.add(x, y, out=z)`` on 1-element CPU tensors, the framework dispatch
  cost per op; skipped with a reason when torch is not importable.
Per-launch figures are time / count (median and min over repetitions).
"""
from __future__ import annotations

import time

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.backends.probe_common import opt, torch_unavailable_reason

COUNTS = (1, 10, 100, 1000, 10000)
QUICK_COUNTS = (1, 100, 10000)


class LaunchProbe(Probe):
    name = "launch"
    description = "OpenMP fork/join, Python->extension call, torch CPU dispatch (per launch)"
    timer = "steady_clock"
    time_budget_s = 300.0

    def notes(self, cfg: ProbeConfig) -> list[str]:
        reason = torch_unavailable_reason()
        return [f"torch_dispatch skipped: {reason}"] if reason else []

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        counts = QUICK_COUNTS if cfg.quick else COUNTS
        max_count = opt(cfg, "launch", "max_count", max(counts))
        reps = opt(cfg, "launch", "num_reps", cfg.num_reps)
        kinds = ["omp_fork_join", "py_ext_call"]
        if torch_unavailable_reason() is None:
            kinds.append("torch_dispatch")
        return [MeasurementSpec(key=f"launch_{kind}_{count}", params={"kind": kind, "count": count, "num_reps": reps},
                                label=f"{kind} x{count}")
                for kind in kinds for count in counts if count <= max_count]

    def measure(self, spec: MeasurementSpec) -> dict:
        kind, count, reps = spec.params["kind"], spec.params["count"], spec.params["num_reps"]
        if kind == "omp_fork_join":
            from gpubench import _cpu

            times, timer = list(_cpu.omp_fork_join(count, reps)), "steady_clock"
        elif kind == "py_ext_call":
            from gpubench import _cpu

            times, timer = _time_calls(_cpu.noop, (), count, reps), "host_clock"
        else:
            import torch

            x, y, z = torch.ones(1), torch.ones(1), torch.empty(1)
            times, timer = _time_calls(torch.add, (x, y), count, reps, out=z), "host_clock"
            if float(z[0]) != 2.0:
                return {"kind": kind, "count": count, "times_s": times, "timer": timer, "valid": False,
                        "invalid_reason": f"torch.add gave {float(z[0])}, expected 2.0"}
        return {"kind": kind, "count": count, "times_s": times, "timer": timer, "valid": all(t > 0 for t in times)}

    def derive(self, row: dict, summary: dict) -> dict:
        return {"per_launch_s_median": summary["t_median_s"] / row["count"],
                "per_launch_s_min": summary["t_min_s"] / row["count"]}


def _time_calls(fn, args, count: int, reps: int, **kw) -> list[float]:
    """Per-rep seconds of `count` calls of fn(*args, **kw), one untimed warm-up call first."""
    fn(*args, **kw)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(count):
            fn(*args, **kw)
        times.append(time.perf_counter() - t0)
    return times
