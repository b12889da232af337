"""Read a replay output directory into the JSON the viewer page draws.

A replay directory (what ``gpubench replay --out DIR`` writes) holds ``summary.json``, ``steps.csv``
(the step log), ``turns.csv`` and ``jobs.csv``; the columns are listed in ``docs/viewer.md``.

The page gets columns, not rows (``{"steps": {"t_s": [...], ...}}``): smaller JSON, and the
charts read one array per series. A long step log is binned to at most ``max_step_points`` rows
(tokens and preemptions summed, block counts as the bin's maximum, time the bin's start), while
break-reason counts and totals are taken from the full log first, so nothing the page reports as
a total depends on the binning.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from common.errors import ResultsFormatError
from scheduling.engine.outputs import JOB_COLUMNS, STEP_COLUMNS, TURN_CONTRACT_COLUMNS as TURN_COLUMNS

# Columns a plot may do without (older or partial logs): filled with 0.
OPTIONAL_STEP_COLUMNS = ("kv_pinned_blocks", "kv_cached_blocks", "pool_used_blocks", "pool_total_blocks",
                         "num_pool_load_tokens", "num_prefill_seqs", "num_decode_seqs")
# Summed within a bin; every other numeric column takes the bin's maximum.
_SUMMED = ("dur_s", "num_prefill_tokens", "num_decode_tokens", "num_preemptions", "num_prefix_hit_tokens",
           "num_pool_load_tokens")
DEFAULT_MAX_STEP_POINTS = 6000
DEFAULT_MAX_JOBS = 80


def _read_csv(path: Path, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> pd.DataFrame:
    if not path.is_file():
        raise ResultsFormatError(f"{path}: missing (is this a `gpubench replay --out` directory?)")
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise ResultsFormatError(f"{path}: cannot parse CSV ({str(err).splitlines()[0]})") from None
    missing = [c for c in required if c not in frame.columns and c not in optional]
    if missing:
        raise ResultsFormatError(f"{path}: missing column(s) {', '.join(missing)}")
    for c in optional:
        if c not in frame.columns:
            frame[c] = 0
    return frame


def _jsonable(values: np.ndarray | pd.Series) -> list:
    """A column as a JSON list: NaN -> null, numpy scalars -> Python, floats rounded to 6 digits."""
    arr = np.asarray(values)
    if arr.dtype.kind == "f":
        return [None if not math.isfinite(v) else round(float(v), 6) for v in arr]
    if arr.dtype.kind in "iub":
        return [int(v) for v in arr]
    return [None if (isinstance(v, float) and math.isnan(v)) else str(v) for v in arr]


def bin_steps(steps: pd.DataFrame, max_points: int) -> pd.DataFrame:
    """At most ``max_points`` rows: consecutive steps grouped; sums for token/preemption counts,
    maxima for block and queue counts, the first step's time, the most frequent break reason, and
    ``steps_in_bin``."""
    if len(steps) <= max_points:
        return steps
    group = np.arange(len(steps)) * max_points // len(steps)
    g = steps.groupby(group, sort=True)
    numeric = [c for c in steps.columns if c != "break_reason" and pd.api.types.is_numeric_dtype(steps[c])]
    agg = {c: ("sum" if c in _SUMMED else "max") for c in numeric}
    agg["t_s"] = "min"
    agg["step"] = "min"
    out = g.agg(agg)
    out["break_reason"] = g["break_reason"].agg(lambda s: s.value_counts().index[0])
    # How many steps each bin holds: the page divides the summed token counts by it to draw tokens
    # *per step* (a bin's sum would read as one step of 40,000 tokens against an 8,192 budget).
    out["steps_in_bin"] = g.size()
    return out.reset_index(drop=True)


def _turn_tpot_s(turns: pd.DataFrame) -> pd.Series:
    gaps = (turns["output_tokens"] - 1).astype(float)
    return (turns["finish_s"] - turns["first_token_s"]).astype(float) / gaps.where(gaps > 0)  # NaN -> null


def load_run(run_dir: str | Path, *, max_step_points: int = DEFAULT_MAX_STEP_POINTS,
             max_jobs: int = DEFAULT_MAX_JOBS) -> dict[str, Any]:
    """Everything the page draws, as a JSON-able dict.

    Raises:
        ResultsFormatError: missing directory or file, unparsable JSON/CSV, missing columns.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ResultsFormatError(f"{run_dir}: not a directory (expected a `gpubench replay --out` directory)")
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise ResultsFormatError(f"{summary_path}: missing (is this a `gpubench replay --out` directory?)")
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ResultsFormatError(f"{summary_path}: invalid JSON ({err.msg}, line {err.lineno})") from None
    steps = _read_csv(run_dir / "steps.csv", STEP_COLUMNS, OPTIONAL_STEP_COLUMNS)
    turns = _read_csv(run_dir / "turns.csv", TURN_COLUMNS, ("pool_hit_tokens", "num_preemptions", "computed_tokens"))
    jobs = _read_csv(run_dir / "jobs.csv", JOB_COLUMNS)
    steps["break_reason"] = steps["break_reason"].fillna("none").astype(str)
    totals = {
        "num_steps": int(len(steps)),
        "num_prefill_tokens": int(steps["num_prefill_tokens"].sum()),
        "num_decode_tokens": int(steps["num_decode_tokens"].sum()),
        "num_preemptions": int(steps["num_preemptions"].sum()),
        "num_prefix_hit_tokens": int(steps["num_prefix_hit_tokens"].sum()),
        "sim_time_s": float(steps["t_s"].iloc[-1] + steps["dur_s"].iloc[-1]) if len(steps) else 0.0,
    }
    break_counts = steps["break_reason"].value_counts()
    binned = bin_steps(steps, max_step_points)
    # Per-job timelines: the first max_jobs jobs by arrival; all turns of those jobs.
    jobs_sorted = jobs.sort_values(["arrival_s", "job_id"], kind="stable")
    shown = jobs_sorted.head(max_jobs)
    shown_turns = turns[turns["job_id"].isin(set(shown["job_id"]))].sort_values(["job_id", "turn"], kind="stable")
    hit = turns["hit_tokens"].to_numpy(dtype=float)
    pool = turns["pool_hit_tokens"].to_numpy(dtype=float)
    prompt = np.maximum(turns["prompt_tokens"].to_numpy(dtype=float), 1.0)
    return {
        "run_dir": str(run_dir.resolve()),
        "name": run_dir.resolve().name,
        "summary": summary,
        "token_budget": token_budget(summary),
        "totals": totals,
        "break_reasons": {str(k): int(v) for k, v in break_counts.items()},
        "steps_binned": len(binned) < len(steps),
        "steps": {c: _jsonable(binned[c]) for c in binned.columns},
        "turn_hit_frac": _jsonable(hit / prompt),
        "turn_pool_frac": _jsonable(pool / prompt),
        "turn_ttft_s": _jsonable(turns["ttft_s"]),
        "turn_hit_tokens": _jsonable(turns["hit_tokens"]),
        "turn_pool_hit_tokens": _jsonable(turns["pool_hit_tokens"]),
        "turn_prompt_tokens": _jsonable(turns["prompt_tokens"]),
        "turn_output_tokens": _jsonable(turns["output_tokens"]),
        # Time per output token of each turn (None for a one-token turn: no inter-token time).
        "turn_tpot_s": _jsonable(_turn_tpot_s(turns)),
        # What the SLO's tool-turn and job kinds need: arrival to last token, whether the turn
        # triggers a tool (not its job's last), and its job.
        "turn_latency_s": _jsonable(turns["finish_s"] - turns["arrival_s"]),
        "turn_has_tool": [bool(v) for v in (turns["turn"] < turns["job_id"].map(jobs.set_index("job_id")["num_turns"]) - 1)],
        "turn_job_id": _jsonable(turns["job_id"]),
        "num_turns": int(len(turns)),
        "jobs": {c: _jsonable(jobs_sorted[c]) for c in JOB_COLUMNS},
        "timeline_jobs": _jsonable(shown["job_id"]),
        "timeline_turns": {c: _jsonable(shown_turns[c]) for c in
                           ("job_id", "turn", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s",
                            "ttft_s", "num_preemptions", "hit_tokens", "prompt_tokens")},
    }


def token_budget(summary: dict[str, Any]) -> int | None:
    """The run's token budget per step (max_num_batched_tokens): as configured, as the live engine
    reported it, or, for a simulated run left at the default, what ``vllm serve`` picks for its SKU;
    None when the run does not say (the page then draws no budget line)."""
    config = summary.get("config")
    config = config if isinstance(config, dict) else {}
    metrics = summary.get("metrics")
    metrics = metrics if isinstance(metrics, dict) else {}
    engine = metrics.get("engine")
    engine = engine if isinstance(engine, dict) else {}
    for source in (config, engine):
        value = source.get("max_num_batched_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if not isinstance(config.get("sku"), str):
        return None
    from common.errors import GpubenchError
    from gpubench import skus
    from scheduling.experiments.replay import vllm_server_defaults

    try:
        return vllm_server_defaults(skus.get(config["sku"]))[0]
    except GpubenchError:  # an SKU this version does not know (a run from elsewhere)
        return None


def run_labels(run_dirs: list[Path]) -> list[str]:
    """A short label per run: its directory name, or as many trailing path parts as it takes to
    tell runs with the same name apart (runs/a/fcfs vs runs/b/fcfs)."""
    parts = [Path(d).resolve().parts for d in run_dirs]
    for depth in range(1, max(len(p) for p in parts)):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(Path(d).resolve()) for d in run_dirs]


def load_runs(run_dirs: Sequence[str | Path], *, max_step_points: int = DEFAULT_MAX_STEP_POINTS,
              max_jobs: int = DEFAULT_MAX_JOBS) -> dict[str, Any]:
    """One run: :func:`load_run`'s dict. Several: ``{"runs": [load_run(d), ...]}`` with each run's
    ``label``, which the page draws side by side (one summary table, curves overlaid)."""
    from common.errors import ConfigError

    dirs = [Path(d) for d in run_dirs]
    seen: dict[Path, Path] = {}
    for d in dirs:
        if d.resolve() in seen:
            raise ConfigError(f"{d}: given twice (as {seen[d.resolve()]}); name each run once")
        seen[d.resolve()] = d
    if len(dirs) == 1:
        return load_run(dirs[0], max_step_points=max_step_points, max_jobs=max_jobs)
    runs = []
    for label, d in zip(run_labels(dirs), dirs):
        run = load_run(d, max_step_points=max_step_points, max_jobs=max_jobs)
        run["label"] = label
        runs.append(run)
    return {"runs": runs}
