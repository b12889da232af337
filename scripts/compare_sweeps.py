"""Whether two sweeps of one grid gave the same rows: the same cells, each once, and every outcome
column equal (the simulator is deterministic; only the wall-clock columns of a run may differ).

    python scripts/compare_sweeps.py RAY_DIR LOCAL_DIR --out DIR/same_rows.json

It checks what `gpubench sweep --ray` promises: the grid run on a Ray cluster gives the local
pool's table. Exit status: 0 when the rows are the same, 1 otherwise (the first differences are
printed and written).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

WALL_COLUMNS = ("wall_s", "cpu_s", "sim_wall_s", "steps_per_wall_s")  # how long a run took here, not what it found


def outcomes(directory: Path) -> pd.DataFrame:
    table = pd.read_csv(directory / "sweep.csv")
    return table.drop(columns=[c for c in WALL_COLUMNS if c in table.columns])


def _errors(table: pd.DataFrame) -> int:
    return int((table["error"].notna() & (table["error"].astype(str) != "")).sum())


def compare(a: Path, b: Path) -> dict:
    ta, tb = outcomes(a), outcomes(b)
    report: dict = {"a": str(a), "b": str(b), "rows_a": len(ta), "rows_b": len(tb),
                    "duplicate_keys_a": int(ta["key"].duplicated().sum()),
                    "duplicate_keys_b": int(tb["key"].duplicated().sum()),
                    "errors_a": _errors(ta), "errors_b": _errors(tb),
                    "only_in_a": sorted(set(ta["key"]) - set(tb["key"]))[:5],
                    "only_in_b": sorted(set(tb["key"]) - set(ta["key"]))[:5], "differences": []}
    joined = ta.merge(tb, on="key", suffixes=("_a", "_b"))
    for col in (c for c in ta.columns if c != "key" and c in tb.columns):
        x, y = joined[f"{col}_a"], joined[f"{col}_b"]
        differ = ~((x == y) | (x.isna() & y.isna()))
        for _, row in joined[differ].head(3).iterrows():
            report["differences"].append({"key": row["key"], "column": col, "a": str(row[f"{col}_a"]),
                                          "b": str(row[f"{col}_b"])})
    report["columns_compared"] = len([c for c in ta.columns if c != "key"])
    report["same_rows"] = (report["rows_a"] == report["rows_b"] == len(joined) and not report["differences"]
                           and not report["duplicate_keys_a"] and not report["duplicate_keys_b"])
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--out", type=Path, default=None, help="where to write the report (JSON)")
    args = p.parse_args(argv)
    report = compare(args.a, args.b)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(f"{report['rows_a']} and {report['rows_b']} rows, {report['columns_compared']} columns compared: "
          f"{'the same rows' if report['same_rows'] else 'DIFFERENT'}")
    for d in report["differences"][:5]:
        print(f"  {d['key']} {d['column']}: {d['a']} vs {d['b']}")
    return 0 if report["same_rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
