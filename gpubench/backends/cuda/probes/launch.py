"""CUDA launch: per-launch cost of kernels, streams and CUDA graphs."""
from __future__ import annotations

from typing import Any

from gpubench.backends.base import MeasurementSpec, ProbeConfig
from gpubench.backends.cuda.extension import NUM_WARMUP
from gpubench.backends.cuda.probes.common import CudaProbe, probe_row
from gpubench.backends.probe_common import opt


class LaunchProbe(CudaProbe):
    """The four launch costs, reported apart (each row: ``count`` empty kernels per repetition).

    ``host_enqueue`` (host clock; queued behind a spin gate), ``device_interval`` (CUDA events
    around back-to-back kernels behind the gate: enqueue excluded), ``launch_sync`` (host clock
    around launch + synchronize), ``graph_node`` (events around one replay of a graph of ``count``
    kernels). Per-launch figures divide by ``count``.
    """

    name = "launch"
    description = "kernel launch: host enqueue, device interval, launch+sync, CUDA-graph node"
    timer = "cuda_events"
    time_budget_s = 120.0
    COUNTS = {"host_enqueue": (1, 16, 256), "device_interval": (1, 16, 256), "launch_sync": (1, 16, 256),
              "graph_node": (1, 16, 256, 4096)}
    QUICK_COUNTS = {"host_enqueue": (1, 256), "device_interval": (1, 256), "launch_sync": (1, 64),
                    "graph_node": (256, 4096)}
    TIMERS = {"host_enqueue": "host_clock", "device_interval": "cuda_events", "launch_sync": "host_clock",
              "graph_node": "cuda_events"}

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        reps = max(30, opt(cfg, "launch", "num_reps", cfg.num_reps))
        table = self.QUICK_COUNTS if cfg.quick else self.COUNTS
        return [MeasurementSpec(key=f"launch_{kind}_{count}", params={"kind": kind, "count": count, "num_reps": reps},
                                label=f"{kind} x{count}")
                for kind, counts in table.items() for count in counts]

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        r = self.ext.launch(self.backend.index, p["kind"], p["count"], p["num_reps"], NUM_WARMUP)
        return probe_row(spec.key, r, self.TIMERS[p["kind"]], kind=p["kind"], count=p["count"],
                    gated=bool(r.get("gated", 0)))

    def derive(self, row: dict, summary: dict) -> dict[str, Any]:
        c = row["count"]
        return {"per_launch_s_median": summary["t_median_s"] / c, "per_launch_s_min": summary["t_min_s"] / c,
                "per_launch_us_median": summary["t_median_s"] / c * 1e6}
