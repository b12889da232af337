"""A replay as a Chrome trace (the Trace Event Format that ui.perfetto.dev and chrome://tracing open).

Built from the replay's documented tables only (``steps.csv``, ``turns.csv``, ``jobs.csv`` as the
:class:`~scheduling.experiments.replay.ReplayResult` frames hold them; columns in ``scheduling.engine.outputs``), so a
replay run live through vLLM exports the same way as a simulated one.

Layout (times in microseconds of simulated time, 0 = the replay's clock origin):

- process 1 ``engine``, thread 1 ``steps``: one complete event (``ph: "X"``) per engine step,
  named by what it ran (``prefill``, ``decode``, ``mixed``), args: ``step``, ``num_seqs``,
  ``scheduled_tokens``, ``prefill_tokens``, ``decode_tokens``, ``prefill_seqs``, ``decode_seqs``,
  ``break_reason``, ``preemptions``.
- counters (``ph: "C"``) on process 1 at each step's start: ``KV blocks`` (``used``, ``free``:
  total − used, so free includes cached-but-evictable prefix blocks), ``prefix-hit tokens``
  (``gpu``: hits of the admissions in that step, ``pool``: tokens loaded from a host pool) and
  ``requests`` (``running``, ``waiting``).
- process 2 ``jobs``, one thread per job (in arrival order, named ``job <id>``): per turn
  ``queued`` (arrival → first scheduled), ``prefill`` (→ first token), ``decode`` (→ finish),
  and ``tool call`` between a turn's finish and the next turn's arrival. The four phases follow one
  another, so a job's events never overlap on its track. Zero-length phases are left out.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd

from common.errors import ConfigError

ENGINE_PID, STEPS_TID = 1, 1
JOBS_PID = 2
TRACE_SUFFIX = ".json"


def check_trace_path(path: str | os.PathLike) -> Path:
    """The ``--trace-out`` path, checked before a replay spends its time: ConfigError (one line)
    when the file could not be written afterwards. Missing parent directories are created when the
    trace is written (``write_text_atomic``), not here."""
    from common.outdir import check_output_file

    p = Path(path)
    if p.suffix.lower() != TRACE_SUFFIX:
        raise ConfigError(f"--trace-out must end in {TRACE_SUFFIX} (Chrome trace JSON), got {p}")
    return check_output_file(p, "--trace-out")


def _us(seconds: float) -> float:
    # Microseconds rounded to the nanosecond: consecutive phases share their rounded boundary, so
    # rounding cannot make them overlap.
    return round(float(seconds) * 1e6, 3)


def _finite(*values) -> bool:
    return all(v is not None and isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _meta(name: str, pid: int, tid: int, value, key: str = "name") -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "ts": 0, "args": {key: value}}


def _step_name(prefill_tokens: int, decode_tokens: int) -> str:
    if prefill_tokens and decode_tokens:
        return "mixed"
    return "prefill" if prefill_tokens else "decode"


def build_trace(steps: pd.DataFrame, turns: pd.DataFrame, jobs: pd.DataFrame, *, label: str = "replay",
                metadata: dict | None = None) -> dict:
    """The trace document (a JSON object with ``traceEvents``) of one replay's tables."""
    events: list[dict] = [
        _meta("process_name", ENGINE_PID, STEPS_TID, f"engine ({label})"),
        _meta("process_sort_index", ENGINE_PID, STEPS_TID, 0, key="sort_index"),
        _meta("thread_name", ENGINE_PID, STEPS_TID, "steps"),
        _meta("process_name", JOBS_PID, 0, "jobs"),
        _meta("process_sort_index", JOBS_PID, 0, 1, key="sort_index"),
    ]
    for row in steps.itertuples(index=False):
        ts = _us(row.t_s)
        prefill, decode = int(row.num_prefill_tokens), int(row.num_decode_tokens)
        events.append({
            "ph": "X", "name": _step_name(prefill, decode), "cat": "step", "pid": ENGINE_PID, "tid": STEPS_TID,
            "ts": ts, "dur": max(_us(row.t_s + row.dur_s) - ts, 0.0),
            "args": {"step": int(row.step), "num_seqs": int(row.num_prefill_seqs) + int(row.num_decode_seqs),
                     "scheduled_tokens": prefill + decode, "prefill_tokens": prefill, "decode_tokens": decode,
                     "prefill_seqs": int(row.num_prefill_seqs), "decode_seqs": int(row.num_decode_seqs),
                     "break_reason": "" if pd.isna(row.break_reason) else str(row.break_reason),
                     "preemptions": int(row.num_preemptions)},
        })
        used, total = int(row.kv_used_blocks), int(row.kv_total_blocks)
        for name, args in (("KV blocks", {"used": used, "free": total - used}),
                           ("prefix-hit tokens", {"gpu": int(row.num_prefix_hit_tokens),
                                                  "pool": int(row.num_pool_load_tokens)}),
                           ("requests", {"running": int(row.num_running), "waiting": int(row.num_waiting)})):
            events.append({"ph": "C", "name": name, "cat": "engine", "pid": ENGINE_PID, "tid": STEPS_TID,
                           "ts": ts, "args": args})

    order = jobs.sort_values(["arrival_s", "job_id"], kind="stable")["job_id"].tolist()
    tid_of = {job_id: i + 1 for i, job_id in enumerate(order)}
    for job_id, track in tid_of.items():
        events.append(_meta("thread_name", JOBS_PID, track, f"job {job_id}"))
        events.append(_meta("thread_sort_index", JOBS_PID, track, track, key="sort_index"))
    by_job = turns.sort_values(["job_id", "turn"], kind="stable").groupby("job_id", sort=False)
    for job_id, job_turns in by_job:
        tid = tid_of.get(job_id)
        if tid is None:  # a turn of a job jobs.csv does not list: give it its own track anyway
            tid = tid_of[job_id] = len(tid_of) + 1
            events.append(_meta("thread_name", JOBS_PID, tid, f"job {job_id}"))
        rows = list(job_turns.itertuples(index=False))
        for i, t in enumerate(rows):
            turn_args = {"job_id": str(job_id), "turn": int(t.turn), "prompt_tokens": int(t.prompt_tokens),
                    "hit_tokens": int(t.hit_tokens), "output_tokens": int(t.output_tokens),
                    "preemptions": int(t.num_preemptions)}
            phases = [("queued", t.arrival_s, t.first_scheduled_s), ("prefill", t.first_scheduled_s, t.first_token_s),
                      ("decode", t.first_token_s, t.finish_s)]
            if i + 1 < len(rows):
                phases.append(("tool call", t.finish_s, rows[i + 1].arrival_s))
            for name, start, end in phases:
                if not _finite(start, end):
                    continue  # a turn that never reached this phase
                ts, dur = _us(start), _us(end) - _us(start)
                if dur <= 0:
                    continue
                events.append({"ph": "X", "name": name, "cat": "turn", "pid": JOBS_PID, "tid": tid,
                               "ts": ts, "dur": dur, "args": turn_args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"label": label, **(metadata or {})}}


def trace_of_result(result, *, label: str | None = None) -> dict:
    """The trace of a :class:`~scheduling.experiments.replay.ReplayResult` (simulated or live)."""
    if result.steps.empty and int(result.summary.get("steps", 0)):
        raise ConfigError("the replay kept no step log (--no-step-log); the trace needs it")
    config = result.config.to_dict()
    label = label or f"{config.get('policy', 'replay')} · {config.get('sku', 'vllm')} · {config.get('model', '')}"
    metadata = {"config": config, "steps": int(result.summary.get("steps", len(result.steps))),
                "num_jobs": int(result.summary.get("num_jobs", len(result.jobs)))}
    return build_trace(result.steps, result.turns, result.jobs, label=label, metadata=metadata)


def write_trace(trace: dict, path: str | os.PathLike) -> Path:
    """Write the trace as compact JSON, whole or not at all."""
    from common.outdir import write_text_atomic

    return write_text_atomic(path, json.dumps(trace, separators=(",", ":"), default=str) + "\n")
