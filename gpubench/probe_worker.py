"""The probe worker: ``python -m gpubench.probe_worker worker --run-dir DIR --probe NAME`` measures one
probe into a run directory, and ``build_rows`` turns what a probe's ``measure`` returned into rows.

The worker side of ``gpubench.runner`` (whose docstring draws both sides), kept apart because it
runs in its own process with its own entry point: it plans the probe, skips keys already on disk,
measures each spec under a telemetry sampler, appends the rows (fsync) and reports JSON events on
stdout. It only appends rows; the parent alone writes the manifest.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from common import stats
from common.errors import ConfigError, suggest
from gpubench.backends.base import Backend, MeasurementSpec, Probe, ProbeConfig
from gpubench.results import RunWriter, read_manifest


def build_rows(probe: Probe, backend_name: str, spec: MeasurementSpec, fields, telemetry: dict) -> list[dict]:
    """Full rows from what ``measure`` returned: common fields, stats, derived rates, telemetry."""
    items = fields if isinstance(fields, list) else [dict(fields, key=fields.get("key", spec.key))]
    rows = []
    for f in items:
        row = {"key": f["key"], "probe": probe.name, "backend": backend_name, "timer": probe.timer}
        row.update(f)
        times = row.get("times_s") or []
        if not times:
            row["valid"] = False
            row.setdefault("invalid_reason", "the probe returned no repetitions")
        else:
            summary = stats.summarize(times)
            # stats' "n" becomes "n_reps" in rows: "n" is a GEMM dimension (m, n, k).
            row.update({("n_reps" if k == "n" else k): v for k, v in summary.items()})
            if summary["t_min_s"] <= 0:
                row["valid"] = False
                row.setdefault("invalid_reason", "a repetition took no time (timer or kernel broken)")
            else:
                row.update(probe.derive(row, summary))
        row["valid"] = bool(row.get("valid", False))
        row.update(telemetry)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- worker -----------------------

def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def probe_config(manifest: dict, backend: Backend | None = None) -> ProbeConfig:
    c = manifest.get("config", {})
    return ProbeConfig(quick=bool(c.get("quick")), num_reps=int(c.get("num_reps", 10)),
                       device=manifest.get("device", {}), options=dict(c.get("options", {})))


def find_probe(backend: Backend, name: str) -> Probe:
    table = {**backend.probes(), **backend.hidden_probes()}
    if name not in table:
        raise ConfigError(f"unknown probe '{name}' for the {backend.name} backend"
                          f"{suggest(name, list(backend.probes()))}; probes: {', '.join(backend.probes())}")
    return table[name]


def worker_main(run_dir: str, probe_name: str, parent_pid: int) -> int:
    """Measure one probe into run_dir; events on stdout; exceptions propagate (exit 1)."""
    from common.procutil import die_with_parent
    from gpubench.backends import get_backend
    from gpubench.telemetry import Sampler

    die_with_parent(parent_pid)
    manifest = read_manifest(run_dir)
    backend, _ = get_backend(manifest["config"]["device_spec"])
    probe = find_probe(backend, probe_name)
    cfg = probe_config(manifest, backend)
    writer = RunWriter(run_dir)
    done_keys = writer.measured_keys(probe.name)
    specs = probe.plan(cfg)
    todo = [s for s in specs if not set(s.keys) <= done_keys]
    _emit({"event": "plan", "total": len(specs), "done": len(specs) - len(todo), "notes": probe.notes(cfg)})
    source = backend.telemetry_source()
    hz = float(manifest["config"].get("telemetry_hz", 50.0))
    try:
        for spec in todo:
            with Sampler(source, hz=hz) as sampler:
                fields = probe.measure(spec)
            rows = build_rows(probe, backend.name, spec, fields, sampler.aggregate())
            for row in rows:
                if row["key"] not in done_keys:
                    writer.append(probe.name, row)
            _emit({"event": "row", "key": spec.key, "label": spec.label,
                   "valid": all(r["valid"] for r in rows)})
    finally:
        source.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpubench.probe_worker", description="gpubench probe worker (internal)")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="measure one probe into a run directory")
    w.add_argument("--run-dir", required=True)
    w.add_argument("--probe", required=True)
    w.add_argument("--parent-pid", type=int, default=os.getppid())
    args = p.parse_args(argv)
    return worker_main(args.run_dir, args.probe, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
