"""Reading a trace file: our JSONL job schema (:mod:`scheduling.workload.traces`) or a SWE-smith
trajectory file (parquet, or JSONL whose rows carry a ``messages`` field; :mod:`scheduling.workload.swesmith`).

Apart from the schema because SWE-smith's reader builds its jobs from the schema: the dispatch
between the two formats sits above both, so neither imports the other's floor.
"""
from __future__ import annotations

import json
from pathlib import Path

from common.errors import TraceFormatError
from common.jsonio import iter_jsonl
from scheduling.workload.traces import Job, job_from_dict

__all__ = ["load_trace"]


def _is_swesmith_file(path: Path) -> bool:
    """A parquet file, or a JSONL whose first object has a ``messages`` field, is SWE-smith."""
    if path.suffix == ".parquet":
        return True
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and "messages" in first and "turns" not in first
    return False


def load_trace(path: str | Path, *, seed: int = 0) -> list[Job]:
    """Load a trace file: our JSONL job schema, or a SWE-smith parquet/JSONL trajectory file.

    Args:
        path: the file.
        seed: seed of the tool-duration model for SWE-smith files (they carry no timestamps).

    Raises:
        TraceFormatError: unreadable file, bad JSON (file and line), invalid job, duplicate job id.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"{path}: trace file not found")
    try:
        return _load_trace(path, seed)
    except UnicodeDecodeError as err:
        raise TraceFormatError(f"{path}: not a trace (not UTF-8 text: {err.reason} at byte {err.start})") from None


def _load_trace(path: Path, seed: int) -> list[Job]:
    if _is_swesmith_file(path):
        from scheduling.workload import swesmith  # pandas/pyarrow: only for that format

        return swesmith.load_swesmith(path, seed=seed)
    jobs: list[Job] = []
    seen: dict[str, int] = {}
    for lineno, obj in iter_jsonl(path, error=TraceFormatError):
        job = job_from_dict(obj, path=path, line=lineno)
        if job.job_id in seen:
            raise TraceFormatError(
                f"{path}:{lineno}: job {job.job_id!r}: field 'job_id' duplicates line {seen[job.job_id]}")
        seen[job.job_id] = lineno
        jobs.append(job)
    if not jobs:
        raise TraceFormatError(f"{path}: no jobs in file")
    return jobs
