"""Step-row files: the JSONL sidecar a profile run appends to, the parquet file it ends with, and a
row's key (what a resumed run skips).

Separate from predictor.profile because the files are shared: predictor.vllm_profile writes its
rows the same way and the evaluation reads them, with no torch engine involved.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from common.errors import ResultsFormatError
from common.stats import summarize
from predictor.profile_grid import GridPoint

SCHEMA_VERSION = 1


def sidecar_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial.jsonl")


def read_rows(path: Path) -> list[dict]:
    """Rows of a parquet file or a JSONL sidecar; a malformed line is a one-line user error."""
    if not path.exists():
        return []
    if path.suffix == ".jsonl":
        from common.jsonio import iter_jsonl

        # A torn last line (interrupted mid-write) is left out: its point is measured again.
        return [row for _, row in iter_jsonl(path, error=ResultsFormatError, torn_tail_ok=True)]
    import pandas as pd

    try:
        return pd.read_parquet(path).to_dict("records")
    except Exception as e:  # pyarrow raises several types for a bad file
        raise ResultsFormatError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


def write_parquet(rows: list[dict], out: Path) -> None:
    """All rows to ``out`` (zstd parquet), written to a temp file and renamed."""
    import pandas as pd

    df = pd.DataFrame(rows)
    tmp = out.with_name(out.name + ".tmp")
    df.to_parquet(tmp, compression="zstd", index=False)
    os.replace(tmp, out)


def append_jsonl(path: Path, row: dict) -> None:
    """One row appended to a sidecar and fsynced (an interrupted run keeps every row before it)."""
    with open(path, "a") as f:
        f.write(json.dumps(row, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


def row_key(model: str, device: str, dtype: str, point: GridPoint, engine: str = "torch") -> str:
    """A row's identity in its file; the eager torch engine's keys predate the engine field."""
    head = model if engine == "torch" else f"{model}|{engine}"
    return f"{head}|{device}|{dtype}|{point.key}"


def wall_fields(wall_times_s) -> dict:
    """A row's wall-time fields from every repetition it keeps (none discarded: warm-up steps are
    never recorded): the median ``wall_s``, the spread, ``num_repeats`` and the times themselves."""
    s = summarize(wall_times_s, discard_first=False)
    return {"wall_s": s["t_median_s"], "wall_min_s": s["t_min_s"], "wall_p20_s": s["t_p20_s"],
            "wall_p80_s": s["t_p80_s"], "wall_max_s": s["t_max_s"], "wall_cv": s["cv"], "num_repeats": s["n"],
            "wall_times_s": [float(t) for t in wall_times_s]}
