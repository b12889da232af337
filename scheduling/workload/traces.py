"""Agent traces: multi-turn jobs, their JSONL format, validation and arrivals.

A **job** is one agent trajectory (docs/traces.md)::

    {"job_id": "j0", "prefix_group": "g0", "system_tokens": 3000, "arrival_s": 0.0,
     "turns": [{"input_tokens": 800, "output_tokens": 150, "tool": "bash", "tool_s": 0.4}, ...]}

Turn k's prompt is the system prompt, then every earlier turn's input and output, then turn k's
input::

    | system_tokens | in_0 | out_0 | in_1 | out_1 | ... | in_k |  -> generates out_k
    '-- shared by the prefix group --'

``tool_s`` is the idle gap between turn k's last output token and turn k+1's arrival (closed
loop: the next turn is sent when the previous one finished plus the gap); the last turn has
``tool=None`` and ``tool_s=0``.

File format: one JSON object per line (``.jsonl``); ``arrival_s`` is optional (default 0).
Reading a trace file of either format (ours, or SWE-smith trajectories) is
:func:`scheduling.workload.trace_files.load_trace`, one floor up: it dispatches to
:mod:`scheduling.workload.swesmith`, which builds its jobs from this schema. Synthetic jobs come from
:mod:`scheduling.workload.trace_synth`.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from common.errors import TraceFormatError

__all__ = [
    "Turn", "Job", "save_trace", "job_from_dict", "job_to_dict", "validate_job",
    "with_poisson_arrivals",
]


@dataclass(frozen=True)
class Turn:
    """One request of an agent: new input tokens, generated output tokens, then a tool gap.

    Args:
        input_tokens: new tokens appended to the prompt for this turn (observation or task), ≥ 0
            (the first turn of a job must have input_tokens + system_tokens ≥ 1).
        output_tokens: tokens the model generates, ≥ 1.
        tool: the tool the agent runs after this turn (None on the last turn).
        tool_s: seconds between this turn's last output token and the next turn's arrival.
    """

    input_tokens: int
    output_tokens: int
    tool: str | None = None
    tool_s: float = 0.0


@dataclass(frozen=True)
class Job:
    """One multi-turn agent trajectory; see the module docstring for the prompt layout."""

    job_id: str
    prefix_group: str
    system_tokens: int
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def prompt_tokens(self, k: int) -> int:
        """Prompt length of turn k: system + all earlier inputs and outputs + turn k's input."""
        history = sum(t.input_tokens + t.output_tokens for t in self.turns[:k])
        return self.system_tokens + history + self.turns[k].input_tokens

    def total_tokens(self) -> int:
        """Context length after the last turn's output (system + every input and output)."""
        return self.system_tokens + sum(t.input_tokens + t.output_tokens for t in self.turns)


# --------------------------------------------------------------------------------------------
# Validation and (de)serialization
# --------------------------------------------------------------------------------------------

def _where(job_id: Any, path: str | Path | None, line: int | None) -> str:
    loc = f"{path}:{line}: " if path is not None and line is not None else (f"{path}: " if path else "")
    return f"{loc}job {job_id!r}"


def _int_field(obj: dict, name: str, ctx: str, minimum: int) -> int:
    if name not in obj:
        raise TraceFormatError(f"{ctx}: missing field {name!r}")
    val = obj[name]
    if isinstance(val, bool) or not isinstance(val, (int, float)) or (isinstance(val, float) and not val.is_integer()) \
            or abs(val) > 2**53:  # 1e300 "is an integer" but no token count
        raise TraceFormatError(f"{ctx}: field {name!r} must be an integer, got {val!r}")
    if val < minimum:
        raise TraceFormatError(f"{ctx}: field {name!r} must be >= {minimum}, got {val!r}")
    return int(val)


def _float_field(obj: dict, name: str, ctx: str, default: float | None = None) -> float:
    if name not in obj or obj[name] is None:
        if default is None:
            raise TraceFormatError(f"{ctx}: missing field {name!r}")
        return default
    val = obj[name]
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val < 0:
        raise TraceFormatError(f"{ctx}: field {name!r} must be a finite number >= 0, got {val!r}")
    return float(val)


def job_from_dict(obj: Any, *, path: str | Path | None = None, line: int | None = None) -> Job:
    """Build a validated :class:`Job` from one decoded JSON object.

    Raises:
        TraceFormatError: naming the file and line (when given), the job and the offending field.
    """
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{_where(None, path, line)}: expected a JSON object, got {type(obj).__name__}")
    job_id = obj.get("job_id")
    ctx = _where(job_id, path, line)
    if not isinstance(job_id, str) or not job_id:
        raise TraceFormatError(f"{ctx}: field 'job_id' must be a non-empty string, got {job_id!r}")
    group = obj.get("prefix_group", "default")
    if not isinstance(group, str) or not group:
        raise TraceFormatError(f"{ctx}: field 'prefix_group' must be a non-empty string, got {group!r}")
    system_tokens = _int_field(obj, "system_tokens", ctx, 0)
    arrival_s = _float_field(obj, "arrival_s", ctx, default=0.0)
    raw_turns = obj.get("turns")
    if not isinstance(raw_turns, list) or not raw_turns:
        raise TraceFormatError(f"{ctx}: field 'turns' must be a non-empty list, got {raw_turns!r:.80}")
    turns = []
    for k, t in enumerate(raw_turns):
        tctx = f"{ctx} turn {k}"
        if not isinstance(t, dict):
            raise TraceFormatError(f"{tctx}: expected an object, got {t!r:.80}")
        tool = t.get("tool")
        if tool is not None and (not isinstance(tool, str) or not tool):
            raise TraceFormatError(f"{tctx}: field 'tool' must be a non-empty string or null, got {tool!r}")
        turns.append(Turn(
            input_tokens=_int_field(t, "input_tokens", tctx, 0),
            output_tokens=_int_field(t, "output_tokens", tctx, 1),
            tool=tool,
            tool_s=_float_field(t, "tool_s", tctx, default=0.0),
        ))
    job = Job(job_id=job_id, prefix_group=group, system_tokens=system_tokens, turns=tuple(turns), arrival_s=arrival_s)
    validate_job(job, path=path, line=line)
    return job


def validate_job(job: Job, *, path: str | Path | None = None, line: int | None = None) -> None:
    """Check a job's invariants (also for jobs built in code).

    Raises:
        TraceFormatError: on a negative count, a zero-length first prompt, a last turn with a tool
            gap, or a non-finite time; the message names the job, turn and field.
    """
    ctx = _where(job.job_id, path, line)
    if job.system_tokens < 0:
        raise TraceFormatError(f"{ctx}: field 'system_tokens' must be >= 0, got {job.system_tokens}")
    if not (math.isfinite(job.arrival_s) and job.arrival_s >= 0):
        raise TraceFormatError(f"{ctx}: field 'arrival_s' must be a finite number >= 0, got {job.arrival_s}")
    if not job.turns:
        raise TraceFormatError(f"{ctx}: field 'turns' must be non-empty")
    for k, t in enumerate(job.turns):
        tctx = f"{ctx} turn {k}"
        if t.input_tokens < 0:
            raise TraceFormatError(f"{tctx}: field 'input_tokens' must be >= 0, got {t.input_tokens}")
        if t.output_tokens < 1:
            raise TraceFormatError(f"{tctx}: field 'output_tokens' must be >= 1, got {t.output_tokens}")
        if not (math.isfinite(t.tool_s) and t.tool_s >= 0):
            raise TraceFormatError(f"{tctx}: field 'tool_s' must be a finite number >= 0, got {t.tool_s}")
    if job.system_tokens + job.turns[0].input_tokens < 1:
        raise TraceFormatError(f"{ctx} turn 0: field 'input_tokens' gives an empty first prompt (system_tokens 0)")
    last = job.turns[-1]
    if last.tool is not None or last.tool_s != 0:
        raise TraceFormatError(
            f"{ctx} turn {len(job.turns) - 1}: field 'tool' must be null and 'tool_s' 0 on the last turn "
            f"(got tool={last.tool!r}, tool_s={last.tool_s})")


def job_to_dict(job: Job) -> dict:
    """The JSON object of one job (the docs/traces.md schema, ``arrival_s`` included)."""
    return {
        "job_id": job.job_id, "prefix_group": job.prefix_group, "system_tokens": job.system_tokens,
        "arrival_s": job.arrival_s, "turns": [asdict(t) for t in job.turns],
    }


def save_trace(jobs: Iterable[Job], path: str | Path) -> Path:
    """Write jobs as JSONL (one job per line); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for job in jobs:
            f.write(json.dumps(job_to_dict(job), separators=(",", ":")) + "\n")
    return path


# --------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------

def with_poisson_arrivals(jobs: Sequence[Job], jps: float, seed: int, *, start_s: float = 0.0) -> list[Job]:
    """Give jobs Poisson arrival times at rate ``jps`` jobs per second, in the given order.

    Inter-arrival gaps are exponential with mean 1/jps, drawn from ``numpy.random.default_rng(seed)``;
    the first job arrives after one gap (``start_s`` + gap). ``jps <= 0`` or ``inf`` puts every job
    at ``start_s`` (all at once: a closed batch).
    """
    if jps is None or not math.isfinite(jps) or jps <= 0:
        return [replace(j, arrival_s=float(start_s)) for j in jobs]
    rng = np.random.default_rng([int(seed), 0x5EED])
    gaps = rng.exponential(1.0 / jps, size=len(jobs))
    times = start_s + np.cumsum(gaps)
    return [replace(j, arrival_s=float(t)) for j, t in zip(jobs, times)]
