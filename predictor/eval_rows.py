"""The rows ``gpubench evaluate`` scores and the held-out splits over them (predictor.evaluate).

``load_rows`` reads step-row files and refuses what is not ground truth (missing columns, rows
taken under contention, a row in two files); a :class:`Fold` is one split's train and test masks;
``metrics`` is what every split reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import ResultsFormatError
from predictor.eval_methods import ape_pct

REQUIRED_COLUMNS = ("key", "model", "dtype", "device_type", "phase", "num_seqs", "num_new_tokens",
                    "context_sum", "context_max", "batch_json", "wall_s", "ops_profiled", "op_sum_s")
PHASES = ("all", "decode", "prefill", "mixed")


# ----------------------------------------------------------------------------- metrics
def metrics(measured, predicted) -> dict:
    """n, R^2 (1 - SS_res/SS_tot on seconds), MAPE, median and p90 APE (percent); NaN rows dropped."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    ok = np.isfinite(m) & np.isfinite(p)
    m, p = m[ok], p[ok]
    if m.size == 0:
        return {"n": 0, "r2": np.nan, "mape_pct": np.nan, "median_ape_pct": np.nan, "p90_ape_pct": np.nan}
    ss_tot = float(np.sum((m - m.mean()) ** 2))
    r2 = 1.0 - float(np.sum((m - p) ** 2)) / ss_tot if ss_tot > 0 else np.nan
    e = ape_pct(m, p)
    return {"n": int(m.size), "r2": r2, "mape_pct": float(e.mean()), "median_ape_pct": float(np.median(e)),
            "p90_ape_pct": float(np.percentile(e, 90))}


# ----------------------------------------------------------------------------- rows
def load_rows(paths, *, allow_contended: bool = False) -> pd.DataFrame:
    """Concatenate step-row files (parquet from ``gpubench profile``); checks the columns it needs.

    Rows flagged ``contended`` (taken while the host gave the engine less CPU than it asked for:
    ``gpubench profile --engine vllm`` marks them) are not ground truth: a file with any is refused
    unless ``allow_contended``, and then those rows are dropped rather than scored.
    """
    from predictor.profile_rows import read_rows

    frames = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise ResultsFormatError(f"{p}: no such rows file (make one with `gpubench profile ... --out {p}`)")
        rows = read_rows(p)
        if not rows:
            raise ResultsFormatError(f"{p}: no rows")
        df = pd.DataFrame(rows)
        missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
        if missing:
            raise ResultsFormatError(f"{p}: not step rows (missing columns: {', '.join(missing)})")
        if "contended" in df.columns and df["contended"].fillna(False).astype(bool).any():
            bad = int(df["contended"].fillna(False).astype(bool).sum())
            if not allow_contended:
                raise ResultsFormatError(f"{p}: {bad} of {len(df)} rows were taken under contention (low CPU share or "
                                         f"high load): re-take them on a quiet machine, or pass --allow-contended to "
                                         f"score the other rows only")
            df = df[~df["contended"].fillna(False).astype(bool)]
        df["source_file"] = str(p)
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    dup = df.key[df.key.duplicated()]
    if len(dup):
        raise ResultsFormatError(f"step row '{dup.iloc[0]}' appears in more than one input")
    return df.sort_values("key", kind="stable").reset_index(drop=True)


# ----------------------------------------------------------------------------- splits
@dataclass(frozen=True)
class Fold:
    split: str
    name: str
    train: np.ndarray  # bool masks over the rows
    test: np.ndarray


def interleaved_folds(df: pd.DataFrame, column: str, split: str) -> list[Fold]:
    """Hold out every other distinct value of ``column`` (interpolation, not extrapolation)."""
    values = np.sort(df[column].unique())
    held = set(values[1::2].tolist())
    test = df[column].isin(held).to_numpy()
    return [Fold(split, f"{column} in {sorted(held)}", ~test, test)]


def model_folds(df: pd.DataFrame) -> list[Fold]:
    """Leave one model out (needs >= 2 models)."""
    models = sorted(df.model.unique())
    if len(models) < 2:
        return []
    return [Fold("by_model", f"test={m}", (df.model != m).to_numpy(), (df.model == m).to_numpy()) for m in models]


def all_folds(df: pd.DataFrame) -> list[Fold]:
    every = np.ones(len(df), dtype=bool)
    return ([Fold("in_sample", "all rows", every, every)] + interleaved_folds(df, "num_seqs", "by_batch")
            + interleaved_folds(df, "context_max", "by_context") + model_folds(df))
