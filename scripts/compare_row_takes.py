#!/usr/bin/env python3
"""How well step rows reproduce themselves: two takes of the same rows, matched on ``key``.

    python scripts/compare_row_takes.py FIRST_DIR SECOND_DIR [--target thread_cpu_s]

Each directory holds the ``.parquet`` row files of one take (``gpubench profile`` lines run with the
same arguments; the files are paired by name). For each phase it prints the second take's time over
the first's (median, p10, p90) and their mean absolute relative difference: the error a predictor
that reproduced the first take exactly would score on the second, i.e. the floor the host's drift
sets for any held-out figure. Exit 2 with one line on bad input.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def take_to_take(first: Path, second: Path, target: str):
    """One dict per (engine file group, phase): n, ratio quantiles, mean |relative difference| %."""
    import pandas as pd

    from predictor.eval_rows import load_rows

    names = sorted(p.name for p in first.glob("*.parquet"))
    if not names:
        raise ValueError(f"{first}: no .parquet row files")
    missing = [n for n in names if not (second / n).exists()]
    if missing:
        raise ValueError(f"{second}: no {missing[0]} to pair with {first / missing[0]}")
    a = load_rows([first / n for n in names])
    b = load_rows([second / n for n in names])
    if target not in a.columns:
        raise ValueError(f"the rows have no column {target!r}")
    both = a.merge(b, on="key", suffixes=("_first", "_second"))
    if both.empty:
        raise ValueError("the two takes share no row key: were they taken with the same lines?")
    out = []
    for phase, rows in both.groupby("phase_first", sort=False):
        ratio = rows[f"{target}_second"] / rows[f"{target}_first"]
        out.append({"phase": phase, "n": len(rows), "median": ratio.median(), "p10": ratio.quantile(0.1),
                    "p90": ratio.quantile(0.9), "mean_abs_diff_pct": 100 * (ratio - 1).abs().mean(),
                    "by_model": ratio.groupby(rows["model_first"]).median().round(3).to_dict()})
    return pd.DataFrame(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first", type=Path, help="directory of the first take's row files")
    ap.add_argument("second", type=Path, help="directory of the second take's row files (same names)")
    ap.add_argument("--target", default="thread_cpu_s", help="the time column compared (default: thread_cpu_s)")
    args = ap.parse_args(argv)
    from common.errors import GpubenchError

    try:
        for d in (args.first, args.second):
            if not d.is_dir():
                raise ValueError(f"{d}: not a directory")
        table = take_to_take(args.first, args.second, args.target)
    except (ValueError, GpubenchError) as err:
        print(f"compare_row_takes: {err}", file=sys.stderr)
        return 2
    for r in table.itertuples():
        print(f"{r.phase:8s} n = {r.n:4d}  second / first: median {r.median:.3f} (p10 {r.p10:.3f}, p90 {r.p90:.3f});"
              f"  mean |difference| {r.mean_abs_diff_pct:.2f} %  per model {r.by_model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
