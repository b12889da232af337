"""The sweep's table on disk: ``sweep.csv`` appended row by row, resumed, and read back.

A sweep directory outlives one run: cells are appended and flushed as they finish, a resumed
sweep skips the keys already there (and re-runs the error rows), and ``spec.json`` pins what a
resumed or extended sweep must share with the one that started the table.
"""
from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from common.errors import ConfigError

if TYPE_CHECKING:
    from scheduling.experiments.sweep import SweepSpec

CSV_NAME, SPEC_NAME, COMMAND_NAME = "sweep.csv", "spec.json", "COMMAND"
ID_COLUMNS = ("key", "policy", "sku", "jps", "seed")
TAIL_COLUMNS = ("wall_s", "cpu_s", "error")


def done_keys(csv_path: Path) -> tuple[set[str], set[str]]:
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


class SweepTable:
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


def check_spec(out_dir: Path, spec: SweepSpec) -> None:
    path = out_dir / SPEC_NAME
    fixed = json.loads(json.dumps(spec.fixed()))
    if path.is_file():
        old = json.loads(path.read_text())
        if old != fixed:
            diff = sorted(k for k in set(old) | set(fixed) if old.get(k) != fixed.get(k))
            raise ConfigError(f"{out_dir} holds a sweep with different {', '.join(diff)} "
                              f"({', '.join(f'{k}={old.get(k)!r}' for k in diff)}); use another --out")
    else:
        from common.outdir import write_text_atomic

        write_text_atomic(path, json.dumps(fixed, indent=2) + "\n")



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
