"""Sweeps: policies × SKUs × JPS × seeds through :func:`scheduling.experiments.replay.run_replay`.

One **cell** is one replay: a policy, a SKU, an arrival rate (jobs per second) and a seed. The
cell's jobs are the same for every policy and SKU of a (JPS, seed) pair — the trace (synthetic,
or a file) with Poisson arrivals drawn from the seed — so policies are compared on identical
workloads. A cell is a pure function of the :class:`SweepSpec` and the :class:`SweepCell`
(no global RNG), so the local process pool, Ray and a serial run give identical rows.

Output directory::

    DIR/sweep.csv      one row per cell: key, policy, sku, jps, seed, the summary metrics, wall_s,
                       error (empty when the replay ran); appended and flushed as cells finish
    DIR/spec.json      the fixed part of the spec (model, jobs, trace, engine/policy settings);
                       a resumed sweep must match it
    DIR/COMMAND        the command line that made (or last extended) the table
    DIR/*.png          plots: JCT vs JPS per policy (one panel per SKU), hit rates, preemptions
    DIR/tables.md      the same as Markdown tables (SKU × policy by JPS), for pasting

Resuming: cells whose key is already in ``sweep.csv`` are skipped; a sweep interrupted half-way
picks up where it stopped, and a larger grid over the same spec only runs the new cells.

This module holds the grid and the runner; ``sweep_table`` the CSV on disk (append, resume),
``sweep_report`` the tables and plots, ``saturation`` the estimate that chose the JPS levels.
"""
from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import pandas as pd

from common.errors import ConfigError
from scheduling.cluster.options import cluster_variant
from scheduling.experiments.sweep_defaults import (  # light constants, shared with the CLI's --help
    DEFAULT_JPS,
    DEFAULT_MODEL,
    DEFAULT_NUM_JOBS,
    DEFAULT_POLICIES,
    DEFAULT_SEEDS,
    DEFAULT_SKUS,
)
from scheduling.experiments.sweep_table import CSV_NAME, SPEC_NAME, SweepTable, check_spec, done_keys, load_table


@dataclass(frozen=True)
class SweepCell:
    """One replay of the grid."""

    policy: str
    sku: str
    jps: float
    seed: int

    @property
    def key(self) -> str:
        return f"{self.policy}|{self.sku}|{self.jps:g}|{self.seed}"


def split_policy_label(label: str) -> tuple[str, dict[str, Any]]:
    """``cpu-offload@cpu_gib=128+store=lazy`` -> ``("cpu-offload", {"cpu_gib": 128, "store": "lazy"})``.

    A label names a policy and, after ``@``, parameters of this variant only (values JSON when they
    parse, else strings); the label is the policy's name in the table and the plots, so one sweep
    can compare pool sizes or TTL rules side by side. The cluster's settings (``scheduling.cluster.options.CLUSTER_KEYS``,
    ``router.KEY`` for a router parameter) ride in a label too: ``fcfs@replicas=4+router=prefix``
    against ``fcfs@replicas=4+router=session`` compares routers (:func:`cluster_variant` takes them out).
    """
    name, _, rest = label.partition("@")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split("+")):  # '+', not ',': --policies lists split on commas
        if "=" not in item:
            raise ConfigError(f"policy {label!r}: expected NAME@KEY=VALUE[+KEY=VALUE], got {item!r}")
        key, raw = item.split("=", 1)
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return name, params


@dataclass(frozen=True)
class SweepSpec:
    """A sweep: the grid, and what every cell shares.

    Args:
        policies, skus, jps, seeds: the grid (cells = their product).
        model: model name or config path for the step cost and the KV size.
        num_jobs: jobs per cell (synthetic, or the first ``num_jobs`` of ``trace``).
        trace: a trace file (our JSONL or SWE-smith); None = the seeded synthetic generator.
        policy_params: ``{policy: {param: value}}`` passed to that policy.
        replay_params: extra ``ReplayConfig`` fields (engine sizes, step cost, ...) for every cell.
    """

    policies: tuple[str, ...] = DEFAULT_POLICIES
    skus: tuple[str, ...] = DEFAULT_SKUS
    jps: tuple[float, ...] = DEFAULT_JPS
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    model: str = DEFAULT_MODEL
    num_jobs: int = DEFAULT_NUM_JOBS
    trace: str | None = None
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    replay_params: dict[str, Any] = field(default_factory=dict)

    def cells(self) -> list[SweepCell]:
        """Grid order: seed, SKU, JPS, policy (an interrupted sweep has whole SKU panels done)."""
        return [SweepCell(p, s, float(j), int(seed)) for seed in self.seeds for s in self.skus
                for j in self.jps for p in self.policies]

    def fixed(self) -> dict[str, Any]:
        """What must not change when a sweep directory is resumed or extended."""
        return {"model": self.model, "num_jobs": self.num_jobs, "trace": self.trace,
                "policy_params": self.policy_params, "replay_params": self.replay_params}

    def validate(self) -> None:
        """Check names and values before any cell runs (one clear error, not 120 failed cells)."""
        from scheduling.policies import policy_kind

        for name, values in (("policies", self.policies), ("skus", self.skus), ("jps", self.jps), ("seeds", self.seeds)):
            if not values:
                raise ConfigError(f"--{name} is empty")
            if len(set(values)) != len(values):
                raise ConfigError(f"--{name} repeats a value: {list(values)}")
        from scheduling.policies import param_names

        for label in self.policies:
            name, variant = split_policy_label(label)
            policy_kind(name)
            unknown = sorted(set(cluster_variant(variant)[0]) - set(param_names(name)))
            if unknown:
                raise ConfigError(f"policy {label!r}: {name} has no parameter(s) {', '.join(unknown)} "
                                  f"(known: {', '.join(param_names(name)) or 'none'})")
        for j in self.jps:
            if not (math.isfinite(j) and j > 0):
                raise ConfigError(f"--jps values must be finite and > 0, got {j}")
        if self.num_jobs < 1:
            raise ConfigError(f"--jobs must be >= 1, got {self.num_jobs}")
        unknown = sorted(set(self.policy_params) - set(self.policies)
                         - {split_policy_label(p)[0] for p in self.policies})
        if unknown:
            raise ConfigError(f"parameters given for policies not in the sweep: {', '.join(unknown)}")
        if self.trace is not None and not Path(self.trace).is_file():
            raise ConfigError(f"--trace {self.trace}: file not found")
        # Everything a cell would otherwise fail on identically, checked once before any cell runs
        # (a typo must not become 120 "finished" error rows): each policy label's and each SKU's
        # config, which checks itself (engine settings, policy parameters) and resolves SKU and model.
        if self.trace is not None:
            from scheduling.workload.trace_files import load_trace

            load_trace(self.trace)
        jps, seed = float(self.jps[0]), int(self.seeds[0])
        for label in self.policies:
            replay_config(self, SweepCell(label, self.skus[0], jps, seed))
        for sku in self.skus[1:]:
            replay_config(self, SweepCell(self.policies[0], sku, jps, seed))


# --------------------------------------------------------------------------------------------
# One cell
# --------------------------------------------------------------------------------------------

def cell_jobs(spec: SweepSpec, jps: float, seed: int):
    """The cell's workload: identical for every policy and SKU at this (JPS, seed)."""
    from scheduling.workload.trace_files import load_trace
    from scheduling.workload.trace_synth import synthetic_jobs
    from scheduling.workload.traces import with_poisson_arrivals

    if spec.trace is not None:
        jobs = load_trace(spec.trace, seed=seed)[: spec.num_jobs]
    else:
        jobs = synthetic_jobs(spec.num_jobs, seed)
    return with_poisson_arrivals(jobs, jps, seed)


def replay_config(spec: SweepSpec, cell: SweepCell):
    """The ReplayConfig of a cell (only fields ReplayConfig has; unknown replay_params are an error)."""
    from scheduling.experiments.replay import ReplayConfig

    names = {f.name for f in fields(ReplayConfig)}
    name, variant = split_policy_label(cell.policy)
    variant, cluster = cluster_variant(variant)
    kw: dict[str, Any] = {"sku": cell.sku, "model": spec.model, "policy": name, "seed": cell.seed}
    params = {**spec.policy_params.get(name, {}), **spec.policy_params.get(cell.policy, {}), **variant}
    if params:
        kw["policy_params"] = params
    for k, v in spec.replay_params.items():
        if k not in names:
            raise ConfigError(f"replay parameter {k!r} unknown (ReplayConfig has: {', '.join(sorted(names))})")
        kw[k] = v
    kw.update(cluster)  # the label's own cluster settings win over the spec's --set ones
    if "jps" in names:
        kw["jps"] = cell.jps
    if "record_steps" in names:
        # A sweep keeps summaries only; the per-step log is what `gpubench replay` is for.
        kw.setdefault("record_steps", False)
    return ReplayConfig(**{k: v for k, v in kw.items() if k in names})


def _flatten(prefix: str, obj: dict[str, Any], out: dict[str, Any]) -> None:
    for k, v in obj.items():
        if isinstance(v, dict):
            _flatten(f"{prefix}{k}_", v, out)
        else:
            out[f"{prefix}{k}"] = v


def summary_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The numeric metrics of a replay summary, flattened (``{"jct": {"mean_s": 1}}`` -> ``jct_mean_s``)."""
    metrics = summary.get("metrics", summary)
    # settings, not outcomes: they are in spec.json
    metrics = {k: v for k, v in metrics.items() if k not in ("config", "policy_params")} if isinstance(metrics, dict) else {}
    flat: dict[str, Any] = {}
    _flatten("", metrics if isinstance(metrics, dict) else {}, flat)
    # the SLO's targets are settings (slo_ttft_s, slo_tpot_s already say them); its attainments are outcomes
    return {k: v for k, v in flat.items() if (isinstance(v, (int, float, bool)) or v is None)
            and not k.startswith(("slo_attainment_slo_", "cluster_router_params_"))}


def run_cell(spec: SweepSpec, cell: SweepCell) -> dict[str, Any]:
    """Run one replay; returns its CSV row. A user error (e.g. the model does not fit the SKU)
    becomes a row with ``error`` set, so the rest of the sweep still runs."""
    from common.errors import GpubenchError
    from scheduling.experiments.replay import run_replay

    t0, c0 = time.perf_counter(), time.process_time()
    row: dict[str, Any] = {"key": cell.key, "policy": cell.policy, "sku": cell.sku, "jps": cell.jps, "seed": cell.seed}
    try:
        result: Any = run_replay(cell_jobs(spec, cell.jps, cell.seed), replay_config(spec, cell))  # the next line also takes a dict
        summary = result.summary if hasattr(result, "summary") else result["summary"]
        row.update(summary_metrics(summary))
        row["error"] = ""
    except GpubenchError as err:
        row["error"] = str(err).replace("\n", " ")
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    # CPU seconds of this cell: on a shared machine wall_s grows with the load, cpu_s does not.
    row["cpu_s"] = round(time.process_time() - c0, 3)
    return row

# --------------------------------------------------------------------------------------------
# Executors
# --------------------------------------------------------------------------------------------

def _run_pool(spec: SweepSpec, todo: Sequence[SweepCell], workers: int) -> Iterator[dict[str, Any]]:
    if workers <= 1:
        for cell in todo:
            yield run_cell(spec, cell)
        return
    import multiprocessing as mp

    from common.procutil import die_with_parent

    # spawn: workers start clean (no inherited threads, e.g. rich's refresh thread, no forked locks);
    # they die with this process, so a killed sweep leaves no worker running.
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        pending = {pool.submit(run_cell, spec, cell) for cell in todo}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()
        finally:
            for fut in pending:
                fut.cancel()


def _run_ray(spec: SweepSpec, todo: Sequence[SweepCell], address: str) -> Iterator[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs the optional extra: pip install 'gpubench[ray]' (or pip install ray)") from None
    started = False
    if not ray.is_initialized():
        # "local" starts a Ray instance in this process; anything else is a cluster address.
        ray.init(address=None if address == "local" else address, include_dashboard=False,
                 log_to_driver=False, ignore_reinit_error=True)
        started = True
    try:
        # A cell whose worker dies (killed, out of memory, its node lost) is run again elsewhere; a
        # cell returns once, so its row is written once.
        remote = ray.remote(max_retries=3)(run_cell)
        spec_ref = ray.put(spec)
        pending = [remote.remote(spec_ref, cell) for cell in todo]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield ray.get(ref)
    finally:
        if started:
            ray.shutdown()


def run_sweep(spec: SweepSpec, out_dir: str | Path, *, workers: int | None = None, ray_address: str | None = None,
              command: str | None = None, progress: bool = True, plots: bool = True, fresh: bool = False,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> pd.DataFrame:
    """Run the cells of ``spec`` not yet in ``out_dir/sweep.csv``; returns the whole table.

    The directory is locked for the sweep (a second sweep on it would interleave its rows).

    Args:
        workers: local processes (default: the CPUs this process may use); 1 runs in-process.
        ray_address: run on Ray instead ("local" starts one here; else a cluster address).
        command: written to ``out_dir/COMMAND`` (the CLI passes its own command line).
        fresh: discard the table (and its spec) first and run every cell: regenerate, not resume.
    """
    from common.outdir import locked, write_command

    spec.validate()  # makes the first cell's ReplayConfig, which checks itself: refused before OUT is touched
    out = Path(out_dir)
    with locked(out, "sweep directory"):
        csv_path = out / CSV_NAME
        if fresh:
            csv_path.unlink(missing_ok=True)
            (out / SPEC_NAME).unlink(missing_ok=True)
        check_spec(out, spec)
        if command:
            write_command(out, command)
        done, failed = done_keys(csv_path)
        todo = [c for c in spec.cells() if c.key not in done]
        table = SweepTable(csv_path)
        retry = failed & {c.key for c in todo}
        if retry:
            table.drop_keys(retry)  # their new rows replace them
        if workers is None:
            workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        rows = _run_ray(spec, todo, ray_address) if ray_address else _run_pool(spec, todo, min(workers, max(1, len(todo))))
        _append_rows(rows, table, on_row, total=len(todo), already_done=len(done), progress=progress)
        frame = load_table(out)
        if plots and len(frame):
            from scheduling.experiments.sweep_report import write_plots

            write_plots(frame, out)
        return frame


def _append_rows(rows, table: SweepTable, on_row, *, total: int, already_done: int, progress: bool) -> None:
    """Append each finished cell's row as it arrives, with a progress bar when asked."""
    bar = task = None
    if progress and total:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        # on stderr: stdout carries the results (the table, or --json's records)
        bar = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TimeRemainingColumn(), TextColumn("{task.description}"), console=Console(stderr=True))
        bar.start()
        task = bar.add_task(f"{already_done} already done", total=total)
    try:
        for row in rows:
            table.append(row)
            if on_row:
                on_row(row)
            if bar is not None and task is not None:  # set together
                bar.update(task, advance=1, description=row["key"] + (" (error)" if row.get("error") else ""))
    finally:
        if bar is not None:
            bar.stop()


def parse_assignments(items: Iterable[str], policies: Sequence[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``--set`` items: ``POLICY.KEY=VALUE`` (a policy parameter) or ``KEY=VALUE`` (a ReplayConfig
    field). Values are JSON when they parse (numbers, true/false, null), else strings."""
    policy_params: dict[str, dict[str, Any]] = {}
    replay_params: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE or POLICY.KEY=VALUE")
        lhs, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if "." in lhs and lhs.split(".", 1)[0] in policies:
            pol, key = lhs.split(".", 1)
            policy_params.setdefault(pol, {})[key] = value
        else:
            replay_params[lhs] = value
    return policy_params, replay_params




__all__ = ["SweepSpec", "SweepCell", "run_sweep", "run_cell", "cell_jobs", "replay_config", "load_table", "split_policy_label",
           "summary_metrics", "parse_assignments", "DEFAULT_POLICIES", "DEFAULT_SKUS", "DEFAULT_JPS", "DEFAULT_SEEDS"]
