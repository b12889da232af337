"""Runs probes into a run directory, each probe in its own worker process.

    parent (gpubench run)                          worker (python -m gpubench.probe_worker worker ...)
    ─────────────────────                          ───────────────────────────────────────────
    create or reopen the run dir (manifest)
    for each probe:
      supported? else manifest: skipped(reason)
      manifest: running; spawn worker ───────────► plan(cfg); drop keys already on disk (resume)
      progress bar  ◄──── JSON events on stdout ── for each spec: Sampler ▸ measure ▸ stats ▸
      deadline: kill past the time budget                          telemetry ▸ append row (fsync)
      exit status ─► manifest: done | failed(reason: signal, exception, budget, invalid rows)

A crash (SIGSEGV, abort), an exception or a time-budget overrun in one probe only fails that probe:
its rows taken so far stay on disk and the next probe runs. The worker dies with the parent
(PR_SET_PDEATHSIG), so a killed run leaves no orphan writing rows; ``--resume RUN_DIR`` skips keys
already measured. Only the parent writes the manifest; workers only append rows.

This module is the parent; the worker (its entry point and the rows it builds) is
``gpubench.probe_worker``.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from common.errors import ConfigError, ResultsFormatError, suggest
from gpubench.backends.base import Backend
from gpubench.probe_worker import find_probe
from gpubench.results import RunWriter, read_manifest, read_rows

DONE_STATUSES = ("done", "skipped")


@dataclass(frozen=True)
class RunRequest:
    """What ``gpubench run`` was asked to do (see its --help)."""

    device: str = "auto"
    sku: str | None = None
    probes: tuple | None = None  # None: every probe of the backend
    quick: bool = False
    out: str = "gpubench-results"  # a user's runs, kept out of a checkout's committed results/
    resume: str | None = None
    force: bool = False
    options: dict = field(default_factory=dict)  # "<probe>.<name>" -> value (--set)
    num_reps: int = 10
    probe_budget_s: float | None = None  # overrides every probe's own time budget
    argv: tuple | None = None


@dataclass
class ProbeOutcome:
    name: str
    status: str
    reason: str | None = None
    num_rows: int = 0
    num_invalid: int = 0
    wall_s: float = 0.0


@dataclass
class RunOutcome:
    run_dir: Path
    device_line: str
    probes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.status in DONE_STATUSES for p in self.probes)


# ---------------------------------------------------------------- parent -----------------------

def _parse_probe_list(backend: Backend, names, quick: bool = False) -> list[str]:
    available = backend.probes()
    if not names:  # every probe; a quick run without the ones that say what it then lacks
        return [n for n, p in available.items() if not (quick and p.quick_leaves_out)]
    hidden = backend.hidden_probes()
    out = []
    for n in names:
        if n not in available and n not in hidden:
            raise ConfigError(f"unknown probe '{n}'{suggest(n, list(available))}; probes: {', '.join(available)}")
        if n not in out:
            out.append(n)
    return out


def open_run(req: RunRequest) -> tuple[RunWriter, Backend, str]:
    """Create the run directory (or reopen it for --resume); SKU and probe checks happen here."""
    from gpubench import skus
    from gpubench.backends import get_backend
    from gpubench.hostinfo import hostname

    if req.resume:
        if req.probes or req.quick or req.options or req.sku:
            raise ConfigError("--resume takes the SKU, probes, --quick and --set options from the run's "
                              "manifest; do not pass them again")
        manifest = read_manifest(req.resume)
        if "config" not in manifest:
            raise ConfigError(f"{req.resume}: manifest has no 'config' (not written by gpubench run)")
        writer = RunWriter(req.resume)
        for rows in sorted(Path(req.resume).glob("*.jsonl")):  # a corrupt rows file: one line, before any output
            writer._drop_torn_tail(rows)  # a row torn by a kill is re-measured, as measured_keys would
            read_rows(rows)
        backend, line = get_backend(manifest["config"]["device_spec"])
        return writer, backend, f"resuming {req.resume}; {line}"
    backend, line = get_backend(req.device)
    sku = skus.get(req.sku or backend.default_sku())
    skus.check_matches(sku, backend.device_name(), backend.name, force=req.force,
                       gpu_unusable=getattr(backend, "gpu_unusable", None))
    names = _parse_probe_list(backend, req.probes, req.quick)
    left_out = {n: p.quick_leaves_out for n, p in backend.probes().items()
                if req.quick and not req.probes and n not in names and p.quick_leaves_out}
    if left_out:
        line += "".join(f"\n--quick leaves out {n} ({why}); name it in --probes to include it"
                        for n, why in left_out.items())
    source = backend.telemetry_source()
    try:
        telemetry = source.describe()
    finally:
        source.close()
    telemetry["loadavg_at_start"] = list(os.getloadavg())
    config = {"device_spec": backend.spec, "quick": req.quick, "num_reps": req.num_reps,
              "options": dict(req.options), "probe_budget_s": req.probe_budget_s, "telemetry_hz": 50.0,
              "forced_sku": bool(req.force and req.sku), "quick_left_out": left_out}
    writer = RunWriter.create(req.out, sku=sku.id, host=hostname(), device=backend.device_info(), probes=names,
                              argv=list(req.argv) if req.argv is not None else None,
                              extra={"config": config, "telemetry": telemetry})
    return writer, backend, line


def count_rows(writer: RunWriter, probe: str) -> tuple[int, int, str | None]:
    """(rows, invalid rows, first invalid 'key: reason') of a probe's file."""
    path = writer.path(probe)
    if not path.exists():
        return 0, 0, None
    rows = read_rows(path)
    bad = [r for r in rows if not r.get("valid")]
    first = f"{bad[0]['key']}: {bad[0].get('invalid_reason', 'invalid')}" if bad else None
    return len(rows), len(bad), first


class _Worker:
    """One worker subprocess with its stdout events in a queue and the tail of its stderr."""

    def __init__(self, run_dir: Path, probe: str):
        cmd = [sys.executable, "-m", "gpubench.probe_worker", "worker", "--run-dir", str(run_dir),
               "--probe", probe, "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.events: queue.Queue = queue.Queue()
        self.stderr_tail: deque = deque(maxlen=40)
        self._threads = [threading.Thread(target=self._pump_out, daemon=True),
                         threading.Thread(target=self._pump_err, daemon=True)]
        for t in self._threads:
            t.start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None  # opened with stdout=PIPE
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                self.stderr_tail.append(line.rstrip())

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None  # opened with stderr=PIPE
        for line in self.proc.stderr:
            self.stderr_tail.append(line.rstrip())

    def join_pipes(self) -> None:
        for t in self._threads:
            t.join(timeout=5)

    def last_error_line(self) -> str | None:
        lines = [ln for ln in self.stderr_tail if ln.strip()]
        return lines[-1].strip() if lines else None


def _failure_reason(rc: int, worker: _Worker) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"worker process died of {name} (crash inside the probe)"
    last = worker.last_error_line()
    return f"worker exited with status {rc}" + (f": {last}" if last else "")


def run_probe(writer: RunWriter, backend: Backend, name: str, budget_s: float,
              on_event: Callable[[str, dict], None] | None = None) -> ProbeOutcome:
    """Run one probe in a worker; record done/failed in the manifest; never raises for probe faults."""
    probe = find_probe(backend, name)
    ok, why = probe.supported(backend)
    if not ok:
        writer.set_probe_status(name, "skipped", reason=why)
        return ProbeOutcome(name, "skipped", why)
    writer.set_probe_status(name, "running")
    t0 = time.monotonic()
    worker = _Worker(writer.run_dir, name)
    notes: list = []
    reason = None
    try:
        while True:
            try:
                ev = worker.events.get(timeout=0.1)
                if ev.get("event") == "plan":
                    notes = ev.get("notes") or []
                if on_event:
                    on_event(name, ev)
                continue
            except queue.Empty:
                pass
            if worker.proc.poll() is not None and worker.events.empty():
                break
            if time.monotonic() - t0 > budget_s:
                worker.proc.kill()
                worker.proc.wait()
                reason = f"exceeded its time budget of {budget_s:g} s (worker killed)"
                break
    except KeyboardInterrupt:
        worker.proc.kill()
        worker.proc.wait()
        writer.set_probe_status(name, "failed", reason="interrupted (resume with --resume RUN_DIR)",
                                wall_s=round(time.monotonic() - t0, 3))
        raise
    rc = worker.proc.wait()
    worker.join_pipes()
    wall_s = round(time.monotonic() - t0, 3)
    if reason is None and rc != 0:
        reason = _failure_reason(rc, worker)
    num_rows, num_invalid, first_bad = count_rows(writer, name)
    if reason is None and num_invalid:
        reason = f"{num_invalid} of {num_rows} rows failed validation (first: {first_bad})"
    status = "failed" if reason else "done"
    info: dict[str, Any] = {"wall_s": wall_s, "num_rows": num_rows, "num_invalid": num_invalid,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}
    if notes:
        info["notes"] = notes
    writer.set_probe_status(name, status, reason=reason, **info)
    return ProbeOutcome(name, status, reason, num_rows, num_invalid, wall_s)


def _check_resumable(run_dir) -> None:
    """ResultsFormatError for a --resume path that is not a run directory or holds a corrupt rows
    file (a torn last line, from a kill, is fine: the resume re-measures it)."""
    read_manifest(run_dir)
    if any(Path(run_dir).glob("*.jsonl.gz")):
        raise ResultsFormatError(f"{run_dir}: its rows files are compressed (a committed run); gunzip them to "
                                 "resume it")
    for rows in sorted(Path(run_dir).glob("*.jsonl")):
        read_rows(rows, torn_tail_ok=True)


def execute(req: RunRequest, on_event: Callable[[str, dict], None] | None = None,
            on_start: Callable[[RunWriter, str, list], None] | None = None) -> RunOutcome:
    """Open the run and run every probe not yet done. Returns what happened to each probe.

    The run directory is locked for the whole run (common.outdir.locked): a second
    ``run --resume`` on it gets one line instead of measuring every probe a second time.
    """
    import contextlib

    from common.outdir import locked

    with contextlib.ExitStack() as stack:
        if req.resume:  # before the manifest is read: two resumes must not both see the same todo
            _check_resumable(req.resume)  # refused input writes nothing, not even the lock
            stack.enter_context(locked(req.resume, "run directory"))
        writer, backend, line = open_run(req)
        if not req.resume:
            stack.enter_context(locked(writer.run_dir, "run directory"))
        return _execute(writer, backend, line, req, on_event, on_start)


def _execute(writer, backend, line, req, on_event, on_start) -> RunOutcome:
    manifest = writer.manifest
    names = list(manifest["probes"])
    todo = [n for n in names if manifest["probes"][n].get("status") not in DONE_STATUSES]
    if on_start:
        on_start(writer, line, todo)
    outcome = RunOutcome(writer.run_dir, line)
    budget_override = req.probe_budget_s or manifest["config"].get("probe_budget_s")
    with _sigterm_as_interrupt():
        _run_all(writer, backend, names, todo, manifest, budget_override, outcome, on_event)
    return outcome


class _sigterm_as_interrupt:
    """SIGTERM (kill, a batch scheduler's stop) ends the run like Ctrl-C: worker killed, manifest updated."""

    def __enter__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _run_all(writer, backend, names, todo, manifest, budget_override, outcome, on_event) -> None:
    for n in names:
        entry = manifest["probes"][n]
        if n not in todo:
            outcome.probes.append(ProbeOutcome(n, entry["status"], entry.get("reason"), entry.get("num_rows", 0),
                                               entry.get("num_invalid", 0), entry.get("wall_s", 0.0)))
            continue
        budget = budget_override or find_probe(backend, n).time_budget_s
        if on_event:
            on_event(n, {"event": "probe_start"})
        result = run_probe(writer, backend, n, float(budget), on_event)
        outcome.probes.append(result)
        if on_event:
            on_event(n, {"event": "probe_end", "status": result.status, "reason": result.reason,
                         "num_rows": result.num_rows, "wall_s": result.wall_s})
