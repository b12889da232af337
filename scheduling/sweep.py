"""Sweeps: policies × SKUs × JPS × seeds through :func:`scheduling.replay.run_replay`.

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
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import pandas as pd

from gpubench.errors import ConfigError

from scheduling.sweep_defaults import (  # noqa: E402 - light constants, shared with the CLI's --help
    DEFAULT_JPS, DEFAULT_MODEL, DEFAULT_NUM_JOBS, DEFAULT_POLICIES, DEFAULT_SEEDS, DEFAULT_SKUS,
)

CSV_NAME, SPEC_NAME, COMMAND_NAME = "sweep.csv", "spec.json", "COMMAND"
ID_COLUMNS = ("key", "policy", "sku", "jps", "seed")
TAIL_COLUMNS = ("wall_s", "cpu_s", "error")


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
    can compare pool sizes or TTL rules side by side.
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
        from gpubench import skus as sku_table
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
            unknown = sorted(set(variant) - set(param_names(name)))
            if unknown:
                raise ConfigError(f"policy {label!r}: {name} has no parameter(s) {', '.join(unknown)} "
                                  f"(known: {', '.join(param_names(name)) or 'none'})")
        for s in self.skus:
            sku_table.get(s)
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
        # (a typo must not become 120 "finished" error rows).
        from predictor import load_model_config
        from scheduling.policies import make_policy

        load_model_config(self.model)
        if self.trace is not None:
            from scheduling.traces import load_trace

            load_trace(self.trace)
        for label in self.policies:
            name, variant = split_policy_label(label)
            make_policy(name, {**self.policy_params.get(name, {}), **self.policy_params.get(label, {}), **variant})
        if self.replay_params:
            replay_config(self, SweepCell(self.policies[0], self.skus[0], float(self.jps[0]), int(self.seeds[0])))


# --------------------------------------------------------------------------------------------
# One cell
# --------------------------------------------------------------------------------------------

def cell_jobs(spec: SweepSpec, jps: float, seed: int):
    """The cell's workload: identical for every policy and SKU at this (JPS, seed)."""
    from scheduling.traces import load_trace, synthetic_jobs, with_poisson_arrivals

    if spec.trace is not None:
        jobs = load_trace(spec.trace, seed=seed)[: spec.num_jobs]
    else:
        jobs = synthetic_jobs(spec.num_jobs, seed)
    return with_poisson_arrivals(jobs, jps, seed)


def replay_config(spec: SweepSpec, cell: SweepCell):
    """The ReplayConfig of a cell (only fields ReplayConfig has; unknown replay_params are an error)."""
    from scheduling.replay import ReplayConfig

    names = {f.name for f in fields(ReplayConfig)}
    name, variant = split_policy_label(cell.policy)
    kw: dict[str, Any] = {"sku": cell.sku, "model": spec.model, "policy": name, "seed": cell.seed}
    params = {**spec.policy_params.get(name, {}), **spec.policy_params.get(cell.policy, {}), **variant}
    if params:
        kw["policy_params"] = params
    for k, v in spec.replay_params.items():
        if k not in names:
            raise ConfigError(f"replay parameter {k!r} unknown (ReplayConfig has: {', '.join(sorted(names))})")
        kw[k] = v
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
    return {k: v for k, v in flat.items() if isinstance(v, (int, float, bool)) or v is None}


def run_cell(spec: SweepSpec, cell: SweepCell) -> dict[str, Any]:
    """Run one replay; returns its CSV row. A user error (e.g. the model does not fit the SKU)
    becomes a row with ``error`` set, so the rest of the sweep still runs."""
    from gpubench.errors import GpubenchError
    from scheduling.replay import run_replay

    t0, c0 = time.perf_counter(), time.process_time()
    row: dict[str, Any] = {"key": cell.key, "policy": cell.policy, "sku": cell.sku, "jps": cell.jps, "seed": cell.seed}
    try:
        result = run_replay(cell_jobs(spec, cell.jps, cell.seed), replay_config(spec, cell))
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
# The table (append, resume)
# --------------------------------------------------------------------------------------------

def _done_keys(csv_path: Path) -> tuple[set[str], set[str]]:
    """``(finished keys, keys whose row records an error)``. An error row is not done: a resumed
    sweep runs the cell again (after a fix, or a transient failure) and replaces its row.
    Duplicate keys mean two writers shared the table: refused."""
    if not csv_path.is_file() or csv_path.stat().st_size == 0:
        return set(), set()
    try:
        frame = pd.read_csv(csv_path, usecols=lambda c: c in ("key", "error"), dtype=str, keep_default_na=False)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError) as err:
        raise ConfigError(f"{csv_path}: cannot resume from this table ({err})") from None
    if "key" not in frame.columns:
        raise ConfigError(f"{csv_path}: cannot resume from this table (no 'key' column)")
    dup = frame["key"][frame["key"].duplicated()]
    if len(dup):
        raise ConfigError(f"{csv_path}: cell {dup.iloc[0]!r} appears more than once (two sweeps wrote this "
                          "table?); remove the duplicate rows or start a new --out")
    errors = frame["key"][frame["error"] != ""] if "error" in frame.columns else frame["key"].iloc[0:0]
    return set(frame["key"]) - set(errors), set(errors)


class _Table:
    """Appends rows to sweep.csv, flushing each; widens the header when a new metric appears."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = []
        if path.is_file() and path.stat().st_size:
            with open(path, newline="") as f:
                self.columns = next(csv.reader(f))

    def append(self, row: dict[str, Any]) -> None:
        new = [c for c in row if c not in self.columns]
        if new or not self.columns:
            self._rewrite_with(new)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns, extrasaction="ignore").writerow(row)
            f.flush()
            os.fsync(f.fileno())

    def drop_keys(self, keys: set[str]) -> None:
        """Rewrite the table without the rows of ``keys`` (atomically)."""
        with open(self.path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("key") not in keys]
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, self.columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)

    def _rewrite_with(self, new: list[str]) -> None:
        ids = [c for c in ID_COLUMNS if c not in self.columns]
        tail = [c for c in self.columns if c in TAIL_COLUMNS]
        body = [c for c in self.columns if c not in TAIL_COLUMNS]
        body += [c for c in ids + sorted(c for c in new if c not in ID_COLUMNS + TAIL_COLUMNS) if c not in body]
        tail += [c for c in TAIL_COLUMNS if c not in tail]
        columns = body + tail
        rows: list[dict[str, str]] = []
        if self.columns:  # copied verbatim (csv, not pandas: an empty error must stay empty, not "nan")
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        tmp.replace(self.path)
        self.columns = columns


def _check_spec(out_dir: Path, spec: SweepSpec) -> None:
    path = out_dir / SPEC_NAME
    fixed = json.loads(json.dumps(spec.fixed()))
    if path.is_file():
        old = json.loads(path.read_text())
        if old != fixed:
            diff = sorted(k for k in set(old) | set(fixed) if old.get(k) != fixed.get(k))
            raise ConfigError(f"{out_dir} holds a sweep with different {', '.join(diff)} "
                              f"({', '.join(f'{k}={old.get(k)!r}' for k in diff)}); use another --out")
    else:
        from gpubench.outdir import write_text_atomic

        write_text_atomic(path, json.dumps(fixed, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Executors
# --------------------------------------------------------------------------------------------

def _run_pool(spec: SweepSpec, todo: Sequence[SweepCell], workers: int) -> Iterator[dict[str, Any]]:
    if workers <= 1:
        for cell in todo:
            yield run_cell(spec, cell)
        return
    import multiprocessing as mp

    from gpubench.procutil import die_with_parent

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
        remote = ray.remote(run_cell)
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
    from gpubench.outdir import locked, write_command

    spec.validate()
    from scheduling.replay import _check_engine_fields

    for cell in spec.cells()[:1]:  # a bad engine setting (--set block_size=0): refused before OUT is touched
        _check_engine_fields(replay_config(spec, cell))
    out = Path(out_dir)
    with locked(out, "sweep directory"):
        csv_path = out / CSV_NAME
        if fresh:
            csv_path.unlink(missing_ok=True)
            (out / SPEC_NAME).unlink(missing_ok=True)
        _check_spec(out, spec)
        if command:
            write_command(out, command)
        done, failed = _done_keys(csv_path)
        todo = [c for c in spec.cells() if c.key not in done]
        table = _Table(csv_path)
        retry = failed & {c.key for c in todo}
        if retry:
            table.drop_keys(retry)  # their new rows replace them
        if workers is None:
            workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        rows = _run_ray(spec, todo, ray_address) if ray_address else _run_pool(spec, todo, min(workers, max(1, len(todo))))
        _append_rows(rows, table, on_row, total=len(todo), already_done=len(done), progress=progress)
        frame = load_table(out)
        if plots and len(frame):
            write_plots(frame, out)
        return frame


def _append_rows(rows, table: "_Table", on_row, *, total: int, already_done: int, progress: bool) -> None:
    """Append each finished cell's row as it arrives, with a progress bar when asked."""
    bar = task = None
    if progress and total:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        bar = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TimeRemainingColumn(), TextColumn("{task.description}"))
        bar.start()
        task = bar.add_task(f"{already_done} already done", total=total)
    try:
        for row in rows:
            table.append(row)
            if on_row:
                on_row(row)
            if bar is not None:
                bar.update(task, advance=1, description=row["key"] + (" (error)" if row.get("error") else ""))
    finally:
        if bar is not None:
            bar.stop()


def load_table(out_dir: str | Path) -> pd.DataFrame:
    """The sweep table sorted by grid position (policy, sku, jps, seed)."""
    path = Path(out_dir) / CSV_NAME
    if not path.is_file():
        return pd.DataFrame(columns=list(ID_COLUMNS))
    frame = pd.read_csv(path)
    if "error" in frame.columns:  # an empty error is read as NaN: make it "" again
        err = frame["error"].astype(object)
        frame["error"] = [("" if (isinstance(e, float) and math.isnan(e)) else str(e)) for e in err]
    return frame.sort_values(["sku", "policy", "jps", "seed"], kind="stable").reset_index(drop=True)


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


# --------------------------------------------------------------------------------------------
# Where load becomes overload (how the default JPS levels were chosen)
# --------------------------------------------------------------------------------------------

def saturation_estimate(sku: str, model: str = DEFAULT_MODEL, *, num_jobs: int = 400, seed: int = 0,
                        gpu_memory_utilization: float = 0.9, reserve_bytes: float = 2 * (1 << 30)) -> dict[str, float]:
    """Back-of-envelope arrival rates (jobs/s) at which a SKU saturates on the synthetic agents.

    * ``kv_jps``: Little's law on KV memory. A job holds its context (prompt + output so far)
      while it runs and — if nothing evicts it — through every tool gap; its KV demand is the
      integral of context over its unloaded lifetime (decode at batch 32 and prefill at 2048-token
      chunks, both from ``predictor.StepModel`` at a 3K-token context, the calibrated agent's
      typical one). ``kv_jps`` = KV pool tokens / E[demand]: above it the caches of live jobs no
      longer fit, and FCFS starts recomputing.
    * ``decode_jps``: decode throughput at batch 32 / output tokens per job.
    * ``job_s``: unloaded mean job duration (tool gaps + generation).

    The KV pool is the replay's own (``scheduling.replay.kv_pool_blocks``).
    """
    import numpy as np

    from predictor import StepModel, load_model_config
    from scheduling.replay import kv_pool_blocks
    from scheduling.request import BLOCK_SIZE
    from scheduling.traces import synthetic_jobs

    cfg = load_model_config(model)
    step = StepModel.for_names(sku=sku, model=model)
    t_decode_s = float(step.predict([(1, 3000)] * 32).total_s)
    t_prefill_per_token_s = float(step.predict([(2048, 3000)]).total_s) / 2048
    num_blocks, _, _ = kv_pool_blocks(sku, model, gpu_memory_utilization=gpu_memory_utilization,
                                      activation_reserve_gib=reserve_bytes / (1 << 30), block_size=BLOCK_SIZE)
    kv_tokens = num_blocks * BLOCK_SIZE
    demand, duration, outputs = [], [], []
    for job in synthetic_jobs(num_jobs, seed):
        integral = t_total = 0.0
        for k, turn in enumerate(job.turns):
            prompt = job.prompt_tokens(k)
            new = turn.input_tokens + (job.system_tokens if k == 0 else 0)
            gen_s = turn.output_tokens * t_decode_s + new * t_prefill_per_token_s
            integral += (prompt + turn.output_tokens / 2) * gen_s + (prompt + turn.output_tokens) * turn.tool_s
            t_total += gen_s + turn.tool_s
        demand.append(integral)
        duration.append(t_total)
        outputs.append(sum(t.output_tokens for t in job.turns))
    return {"sku": sku, "kv_pool_tokens": float(kv_tokens), "decode_step_s": t_decode_s, "job_s": float(np.mean(duration)),
            "kv_jps": float(kv_tokens / np.mean(demand)), "decode_jps": float(32 / t_decode_s / np.mean(outputs))}


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------

# Metric names as the replay summary may spell them; the first present is plotted.
METRIC_CANDIDATES = {
    "jct_mean": ("jct_mean_s", "jct_s_mean", "mean_jct_s"),
    "jct_p90": ("jct_p90_s", "jct_s_p90"),
    "ttft_p90": ("ttft_p90_s", "ttft_s_p90"),
    "gpu_hit": ("gpu_prefix_hit_rate", "prefix_hit_rate", "gpu_hit_rate"),
    "pool_hit": ("pool_hit_rate", "offload_hit_rate", "pool_prefix_hit_rate"),
    "preemptions": ("preemptions", "num_preemptions"),
    "recomputed": ("recomputed_tokens", "num_recomputed_tokens"),
    "jct_p50": ("jct_p50_s",), "jct_p99": ("jct_p99_s",),
    "ttft_p50": ("ttft_p50_s",), "ttft_p99": ("ttft_p99_s",),
    "tpot_p50": ("tpot_p50_s",), "tpot_p90": ("tpot_p90_s",), "tpot_p99": ("tpot_p99_s",),
    "slo_share": ("slo_turn_share",), "goodput": ("goodput_tok_per_s",),
}
# The tables of tables.md: (metric, title, format). Serving metrics as users ask for them: JCT,
# TTFT and TPOT percentiles, and goodput under the replay's SLO (TTFT <= 2 s, TPOT <= 0.1 s).
TABLES = (
    ("jct_mean", "JCT mean (s)", "{:.0f}"), ("jct_p50", "JCT p50 (s)", "{:.0f}"), ("jct_p90", "JCT p90 (s)", "{:.0f}"),
    ("jct_p99", "JCT p99 (s)", "{:.0f}"),
    ("ttft_p50", "turn TTFT p50 (s)", "{:.3g}"), ("ttft_p90", "turn TTFT p90 (s)", "{:.3g}"),
    ("ttft_p99", "turn TTFT p99 (s)", "{:.3g}"),
    ("tpot_p50", "TPOT p50 (ms)", "ms"), ("tpot_p90", "TPOT p90 (ms)", "ms"), ("tpot_p99", "TPOT p99 (ms)", "ms"),
    ("slo_share", "turns meeting the SLO (TTFT <= 2 s, TPOT <= 0.1 s)", "{:.1%}"),
    ("goodput", "goodput (output tokens/s of turns meeting the SLO)", "{:.0f}"),
    ("gpu_hit", "GPU prefix-hit rate", "{:.1%}"), ("pool_hit", "pool hit rate (share of GPU misses)", "{:.1%}"),
    ("preemptions", "preemptions", "{:.0f}"),
)
POLICY_COLORS = {"fcfs": "#d43c3c", "continuum": "#3b6fd8", "cpu-offload": "#2fa37a", "lmcache": "#d97a2b",
                 "continuum-offload": "#8a4fc7"}


_VARIANT_COLORS = ("#6b6b6b", "#b8860b", "#17becf", "#e377c2", "#7f7f7f", "#bcbd22")


def policy_color(label: str) -> str:
    """The policy's colour; a variant (``NAME@...``) gets a colour of its own from a fixed list."""
    if label in POLICY_COLORS:
        return POLICY_COLORS[label]
    import zlib

    return _VARIANT_COLORS[zlib.crc32(label.encode()) % len(_VARIANT_COLORS)]


def metric_column(frame: pd.DataFrame, what: str) -> str | None:
    """The table's column for a metric (see METRIC_CANDIDATES), or None."""
    return next((c for c in METRIC_CANDIDATES[what] if c in frame.columns), None)


def _panel_grid(num: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, num)
    nrows = math.ceil(num / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(8.0, 4.4 * ncols), 3.3 * nrows + 0.9), squeeze=False,
                             sharex=True)
    for ax in axes.flat[num:]:
        ax.set_visible(False)
    return plt, fig, list(axes.flat)


def _plot_metric(frame: pd.DataFrame, out_png: Path, series: list[tuple[str, str, str]], ylabel: str,
                 title: str, logy: bool = False) -> Path | None:
    """One panel per SKU; x = JPS; one line per policy per (column, linestyle, label) in series;
    the line is the mean over seeds, the band min..max over seeds."""
    ok = frame[frame["error"] == ""] if "error" in frame.columns else frame
    series = [s for s in series if s[0] in ok.columns]
    if ok.empty or not series:
        return None
    skus = list(dict.fromkeys(ok["sku"]))
    plt, fig, axes = _panel_grid(len(skus))
    for ax, sku in zip(axes, skus):
        sub = ok[ok["sku"] == sku]
        for policy in dict.fromkeys(frame["policy"]):
            rows = sub[sub["policy"] == policy]
            if rows.empty:
                continue
            for col, style, label in series:
                g = rows.groupby("jps")[col].agg(["mean", "min", "max"]).reset_index()
                color = policy_color(policy)
                ax.plot(g["jps"], g["mean"], style, color=color, marker="o", ms=3,
                        label=f"{policy}{label}" if sku == skus[0] else None)
                if (g["max"] > g["min"]).any():
                    ax.fill_between(g["jps"], g["min"], g["max"], color=color, alpha=0.15, lw=0)
        ax.set_title(sku)
        ax.set_xscale("log")
        levels = sorted(ok["jps"].unique())
        ax.set_xticks(levels, [f"{j:g}" for j in levels])
        ax.minorticks_off()
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.set_xlabel("arrival rate (jobs/s)")
        ax.set_ylabel(ylabel)
    handles, labels = axes[0].get_legend_handles_labels()
    num_rows = math.ceil(len(labels) / 4)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.045 * num_rows + 0.02, 1, 0.97))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _format_cell(value: float, fmt: str) -> str:
    if value != value:
        return "–"
    return f"{value * 1e3:.1f}" if fmt == "ms" else fmt.format(value)


def _pivot_lines(pivot: pd.DataFrame, title: str, fmt: str) -> str:
    head = "| SKU | policy | " + " | ".join(f"{j:g} jobs/s" for j in pivot.columns) + " |"
    lines = [title, "", head, "|" + "---|" * (len(pivot.columns) + 2)]
    for (sku, policy), row in pivot.iterrows():
        lines.append(f"| {sku} | {policy} | " + " | ".join(_format_cell(v, fmt) for v in row) + " |")
    return "\n".join(lines)


def markdown_tables(frame: pd.DataFrame) -> str:
    """SKU × policy by JPS tables (seed means) of every metric in :data:`TABLES`, and mean JCT as
    a ratio to FCFS at the same cell (FCFS / policy: above 1 is faster)."""
    ok = frame[frame["error"] == ""] if "error" in frame.columns else frame
    parts = []
    jobs_col = "num_jobs" if "num_jobs" in ok.columns else None
    if jobs_col and not ok.empty:
        counts = sorted(ok[jobs_col].dropna().astype(int).unique())
        parts.append(f"Every cell replays {', '.join(map(str, counts))} jobs; at a high arrival rate they all arrive "
                     "within a short span (`arrival_span_s`) and a cell measures how long the engine takes to "
                     "drain them.")
    for what, title, fmt in TABLES:
        col = metric_column(ok, what)
        if col is None or ok.empty:
            continue
        pivot = ok.groupby(["sku", "policy", "jps"])[col].mean().unstack("jps")
        parts.append(_pivot_lines(pivot, f"**{title}** (`{col}`)", fmt))
        if what == "jct_mean" and "fcfs" in set(ok["policy"]):
            fcfs = pivot.xs("fcfs", level="policy")
            ratio = pd.DataFrame({key: fcfs.loc[key[0]] / row for key, row in pivot.iterrows()}).T
            ratio.index = pd.MultiIndex.from_tuples(ratio.index, names=["sku", "policy"])
            parts.append(_pivot_lines(ratio, "**JCT mean, FCFS ÷ policy** (above 1: the policy is faster)",
                                      "{:.2f}x"))
    n_cells = len(frame)
    return f"{n_cells} runs ({(frame['error'] != '').sum() if 'error' in frame.columns else 0} failed).\n\n" + "\n\n".join(parts) + "\n"


def write_plots(frame: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """jct_vs_jps.png, ttft_vs_jps.png, tpot_vs_jps.png, goodput_vs_jps.png, hit_rates.png,
    preemptions.png (those whose metrics exist), and tables.md."""
    out = Path(out_dir)
    made = []
    col = metric_column
    specs = [
        ("jct_vs_jps.png", [(col(frame, "jct_mean"), "-", " mean"), (col(frame, "jct_p90"), ":", " p90")],
         "job completion time (s)", "JCT vs load, per policy (line: mean over seeds; dotted: p90)", True),
        ("ttft_vs_jps.png", [(col(frame, "ttft_p50"), "-", " p50"), (col(frame, "ttft_p90"), ":", " p90")],
         "TTFT (s)", "Turn TTFT vs load (solid: p50; dotted: p90)", True),
        ("tpot_vs_jps.png", [(col(frame, "tpot_p50"), "-", " p50"), (col(frame, "tpot_p90"), ":", " p90")],
         "TPOT (s)", "Time per output token vs load (solid: p50; dotted: p90)", True),
        ("goodput_vs_jps.png", [(col(frame, "goodput"), "-", "")], "output tokens/s meeting the SLO",
         "Goodput under the SLO (TTFT <= 2 s, TPOT <= 0.1 s) vs load", False),
        ("hit_rates.png", [(col(frame, "gpu_hit"), "-", " GPU"), (col(frame, "pool_hit"), "--", " pool")],
         "hit rate (share of prompt tokens)", "Prefix hit rates: GPU cache (solid), offload pool (dashed)", False),
        ("preemptions.png", [(col(frame, "preemptions"), "-", "")], "preemptions", "Preemptions vs load", False),
    ]
    for name, series, ylabel, title, logy in specs:
        series = [s for s in series if s[0] is not None]
        if series:
            path = _plot_metric(frame, out / name, series, ylabel, title, logy)
            if path:
                made.append(path)
    (out / "tables.md").write_text(markdown_tables(frame))
    made.append(out / "tables.md")
    return made


__all__ = ["SweepSpec", "SweepCell", "run_sweep", "run_cell", "cell_jobs", "replay_config", "load_table", "split_policy_label",
           "summary_metrics", "parse_assignments", "DEFAULT_POLICIES", "DEFAULT_SKUS", "DEFAULT_JPS", "DEFAULT_SEEDS"]
