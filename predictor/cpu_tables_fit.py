"""Fitting the CPU op-cost tables (predictor.cpu_tables) from a probe run's rows.

Kept apart from the tables' use: pricing a step reads a calibration without numpy's fitting or
pandas, while fitting needs both and runs once per ``gpubench fit``. The rules (machine-phase
normalization, the attention laws' non-negative relative least squares, the segment context grid)
are described in predictor.cpu_tables' docstring.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from common.errors import ConfigError
from predictor.cpu_tables import DECODE_TERMS, MAIN_CONTEXT_ELEMENTS, PREFILL_TERMS, SCHEMA, SEGMENTS, decode_terms, prefill_terms


def fit_tables(frame, dtype: str, source: str, vllm_frame=None) -> dict:
    """The ``cpu_ops.<dtype>`` block from a run's ``torch_ops`` rows (a DataFrame), plus its
    ``vllm_ops`` rows when it has them. Raises ConfigError if a torch_ops family is missing."""
    d: dict = {"schema": SCHEMA, "dtype": dtype, "source": source, "tier": "measured"}
    lin = _rows(frame, "linear", dtype)
    if not len(lin):
        raise ConfigError(f"{source}: no valid torch_ops linear rows for {dtype}")
    d["linear"] = _linear_nodes(lin)
    # the thread count the probes ran torch (and vLLM) with: the tables describe an engine at that count
    d["num_threads"] = int(lin["num_threads"].median()) if "num_threads" in lin else 1
    # The vLLM rows: a DataFrame, or () when the run has none (only len() is asked of that).
    vllm_lin: Any = _rows(vllm_frame, "linear", dtype) if vllm_frame is not None and len(vllm_frame) else ()
    engine: Any = _engine_rows(vllm_frame, "engine_step", dtype)
    if len(engine):
        engine = engine.sort_values("batch")
        d["engine_vllm"] = {"model": str(engine["model"].iloc[0]), "num_seqs": [int(v) for v in engine["batch"]],
                            "s": [float(v) for v in engine["t_median_s"]],
                            "context_mean": [float(v) for v in engine["context_mean"]], "num_rows": int(len(engine))}
    layers: Any = _engine_rows(vllm_frame, "engine_layers", dtype)
    if len(layers):
        d["layers_vllm"] = _layer_nodes(layers)
    if len(vllm_lin) and "num_threads" in vllm_lin:
        d["num_threads_vllm"] = int(vllm_lin["num_threads"].median())
    if len(vllm_lin):
        d["linear_vllm"] = {**_linear_nodes(vllm_lin), "engine": "vllm",
                            "vllm_version": str(vllm_lin["vllm_version"].iloc[0]) if "vllm_version" in vllm_lin else None}
    dec = _rows(frame, "attn_decode", dtype)
    if not len(dec):
        raise ConfigError(f"{source}: no valid torch_ops attn_decode rows for {dtype}")
    # torch's decode rows read L keys per sequence (the probe's query is not in the cache)
    d["attn_decode"] = _decode_law(dec, dec["context"].to_numpy(float) * dec["batch"].to_numpy(float))
    pre = _rows(frame, "attn_prefill", dtype)
    if not len(pre):
        raise ConfigError(f"{source}: no valid torch_ops attn_prefill rows for {dtype}")
    d["attn_prefill"] = {}
    for mode, masked in (("causal", False), ("masked", True)):
        sub = pre[pre["masked"].astype(bool) == masked]
        if not len(sub):
            raise ConfigError(f"{source}: no valid {mode} attn_prefill rows for {dtype}")
        d["attn_prefill"][mode] = _prefill_law(sub, masked)
    vllm_dec: Any = _rows(vllm_frame, "attn_decode", dtype) if vllm_frame is not None and len(vllm_frame) else ()
    vllm_pre: Any = _rows(vllm_frame, "attn_prefill", dtype) if vllm_frame is not None and len(vllm_frame) else ()
    if len(vllm_dec) and len(vllm_pre):
        # vLLM's kernel: a decode's query is in the cache (L + 1 keys); a prefill chunk is causal
        # over its cached context (n*c + n(n+1)/2 pairs), the masked pairs skipped
        kv_tokens = (vllm_dec["context"].to_numpy(float) + 1) * vllm_dec["batch"].to_numpy(float)
        d["attn_vllm"] = {"engine": "vllm", "block_size": int(vllm_dec["block_size"].iloc[0]),
                          "decode": _decode_law(vllm_dec, kv_tokens), "prefill": _prefill_law(vllm_pre, False)}
    seg = _rows(frame, "segment", dtype)
    if len(seg) and "context_elements" not in seg.columns:
        seg = seg.assign(context_elements=MAIN_CONTEXT_ELEMENTS)
    # the main grid's context: the one its T > 1 rows ran after (16 MiB unless a test shrank it)
    main_context = int(seg.loc[seg["rows"] > 1, "context_elements"].max()) if (seg["rows"] > 1).any() else MAIN_CONTEXT_ELEMENTS
    itemsize = 2 if dtype == "bf16" else 4
    d["segments"] = {}
    for name in SEGMENTS:
        sub = seg[seg["segment"] == name] if len(seg) else seg
        if not len(sub):
            raise ConfigError(f"{source}: no valid torch_ops '{name}' segment rows for {dtype}")
        nodes = []
        for w, g in sub.groupby("width"):
            main = g[g["context_elements"] == main_context].sort_values("rows")
            ctx = g[g["rows"] == 1].sort_values("context_elements")
            nodes.append({"w": int(w), "t": [int(v) for v in main["rows"]], "s": [float(v) for v in main["t_median_s"]],
                          "context_bytes": [int(v) * itemsize for v in ctx["context_elements"]],
                          "s_at_t1": [float(v) for v in ctx["t_median_s"]]})
        d["segments"][name] = nodes
    d["segment_spread"] = _spread(seg)
    import pandas as pd  # fit only: a calibration is read (and steps priced) without pandas

    d["phase_spread"] = _phase_spread(pd.concat([lin, dec], ignore_index=True))
    return d


def _nnls_relative(features: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative coefficients minimising the relative error; (coefficients, relative residuals)."""
    from scipy.optimize import nnls

    scale = features.max(axis=0)
    scale[scale == 0] = 1.0
    a = features / scale / t[:, None]
    coef, _ = nnls(a, np.ones_like(t))
    coef = coef / scale
    return coef, features @ coef / t - 1.0


def _rows(frame, family: str, dtype: str):
    df = frame[(frame["family"] == family) & (frame["dtype"] == dtype)]
    if "valid" in df.columns:
        df = df[df["valid"].astype(bool)]
    return df


def _engine_rows(frame, family: str, dtype: str):
    """The whole-engine-step rows of ``family`` (() without any), each timed as the engine's step takes.

    NOTE(cpu_tables): an engine step's time is the CPU time of all the process's threads, which is
    its wall time at one thread and robust to a busy neighbour. At N threads it counts every thread's
    time (about N x the wall time: OpenMP workers spin between parallel regions), so there the step is
    the median of its wall times instead (first repetition discarded, as the stats do)."""
    if frame is None or not len(frame):
        return ()
    rows = _rows(frame, family, dtype)
    if not len(rows) or "num_threads" not in rows.columns or "wall_times_s" not in rows.columns:
        return rows
    multi = rows["num_threads"].fillna(1).astype(int) > 1
    if multi.any():
        rows = rows.copy()
        wall = [float(np.median(np.asarray(w, dtype=float)[1:])) if w is not None and len(w) > 1 else np.nan
                for w in rows.loc[multi, "wall_times_s"]]
        rows.loc[multi, "t_median_s"] = wall
        rows = rows[np.isfinite(rows["t_median_s"].astype(float))]
    return rows


def _spread(df) -> float:
    """Median relative p20..p80 half-width over repetitions of the rows (0 without them)."""
    if not len(df) or "t_p80_s" not in df.columns:
        return 0.0
    return float(np.median((df["t_p80_s"] - df["t_p20_s"]) / (2 * df["t_median_s"])))


def _reference_medians(df) -> np.ndarray:
    """Per row, the median of its reference GEMV's repetitions (first one discarded, as the stats
    do); NaN for rows without references (older runs, families that take none)."""
    if "ref_times_s" not in df.columns:
        return np.full(len(df), np.nan)
    return np.array([np.median(r[1:]) if isinstance(r, (list, np.ndarray)) and len(r) > 1 else np.nan
                     for r in df["ref_times_s"]])


def _linear_nodes(lin) -> dict:
    """Per (K, N) node, seconds per weight element at each measured M (machine phase normalized).

    A cell timed in several passes (the probes' ``pass`` column) is the median of its passes, each
    normalized to the machine phase on its own: one pass in a slow moment of the host is outvoted."""
    lin = lin.assign(t_phase_s=_phase_normalized(lin))
    nodes = []
    for (k, n), g in lin.groupby(["k", "n"]):
        cells = g.groupby("m")["t_phase_s"].median().sort_index()
        nodes.append({"k": int(k), "n": int(n), "m": [int(v) for v in cells.index],
                      "s_per_element": [float(v) for v in cells.to_numpy() / (k * n)]})
    return {"nodes": nodes, "num_rows": int(len(lin)), "spread": _spread(lin),
            "num_threads": int(lin["num_threads"].iloc[0]) if "num_threads" in lin else 1}


def _layer_nodes(rows) -> dict:
    """The ``engine_layers`` rows per width: the synthetic model's config at each depth and the
    median step seconds per (depth, number of sequences); CpuTableStep prices the difference."""
    nodes = []
    for w, g in rows.groupby("width"):
        depths = sorted({int(v) for v in g["layers"]})
        batches = sorted({int(v) for v in g["batch"]})
        if len(depths) < 2:
            continue
        cell = {(int(r.layers), int(r.batch)): r for r in g.itertuples()}
        if any((dd, b) not in cell for dd in depths for b in batches):
            continue  # an incomplete grid (a row failed): no per-layer cost at this width
        nodes.append({"width": int(w), "depths": depths, "num_seqs": batches,
                      "configs": [dict(cell[(dd, batches[0])].config) for dd in depths],
                      "s": [[float(cell[(dd, b)].t_median_s) for b in batches] for dd in depths],
                      "context_mean": [[float(cell[(dd, b)].context_mean) for b in batches] for dd in depths]})
    return {"nodes": nodes, "num_rows": int(len(rows))}


def _phase_normalized(df):
    """Row medians rescaled to the run's median reference GEMV (see the module docstring); rows
    without ``ref_times_s`` (older runs) are used as measured."""
    t = df["t_median_s"].to_numpy(float)
    ref = _reference_medians(df)
    ok = np.isfinite(ref) & (ref > 0)
    if not ok.any():
        return t
    typical = float(np.median(ref[ok]))
    return np.where(ok, t * typical / np.where(ok, ref, 1.0), t)


def _decode_law(dec, kv_tokens: np.ndarray) -> dict:
    """The decode law (DECODE_TERMS) fitted to decode rows reading ``kv_tokens`` keys each (phase
    normalized: a decode group streams its KV as a GEMV streams its weight)."""
    f = decode_terms(dec["batch"].to_numpy(float), kv_tokens, dec["heads"].to_numpy(float),
                     dec["kv_heads"].to_numpy(float), dec["head_dim"].to_numpy(float))
    t = _phase_normalized(dec)
    coef, resid = _nnls_relative(f, t)
    return {"coef": dict(zip(DECODE_TERMS, map(float, coef))), "num_rows": int(len(dec)),
            "fit_mape": float(np.mean(np.abs(resid))), "spread": _spread(dec),
            "by_config": _fit_by_config(dec, f, t, DECODE_TERMS)}


def _prefill_law(rows, masked: bool) -> dict:
    """The prefill law (PREFILL_TERMS) fitted to prefill rows of one mode (masked or causal)."""
    f = prefill_terms(rows["new_tokens"].to_numpy(float), rows["cached_tokens"].to_numpy(float),
                      rows["heads"].to_numpy(float), rows["kv_heads"].to_numpy(float),
                      rows["head_dim"].to_numpy(float), masked)
    t = rows["t_median_s"].to_numpy(float)
    coef, resid = _nnls_relative(f, t)
    return {"coef": dict(zip(PREFILL_TERMS, map(float, coef))), "num_rows": int(len(rows)),
            "fit_mape": float(np.mean(np.abs(resid))), "spread": _spread(rows),
            "by_config": _fit_by_config(rows, f, t, PREFILL_TERMS)}


def _fit_by_config(df, features: np.ndarray, t: np.ndarray, terms: tuple) -> list:
    """The law fitted separately per probed head configuration (query heads per KV head, head_dim):
    the per-key cost depends on the grouping in ways one linear law misses (one law: ~10-19 % fit
    error here; per configuration: a few %)."""
    out = []
    group = (df["heads"] / df["kv_heads"]).to_numpy(float)
    dim = df["head_dim"].to_numpy(float)
    for g, hd in sorted(set(zip(group, dim))):
        sel = (group == g) & (dim == hd)
        if sel.sum() < len(terms) + 1:
            continue
        coef, resid = _nnls_relative(features[sel], t[sel])
        out.append({"group": float(g), "head_dim": int(hd), "coef": dict(zip(terms, map(float, coef))),
                    "fit_mape": float(np.mean(np.abs(resid))), "num_rows": int(sel.sum())})
    return out


def _phase_spread(df) -> dict:
    """p10 and p90 of the reference GEMV's medians over their median (1.0 without references), and
    that median itself (``reference_median_s``: the phase the tables describe, which a step row's
    own reference GEMV is compared with)."""
    ref = _reference_medians(df)
    ref = ref[np.isfinite(ref) & (ref > 0)]
    if not ref.size:
        return {"p10": 1.0, "p90": 1.0, "num_rows": 0, "reference_median_s": None}
    typical = float(np.median(ref))
    rel = ref / typical
    return {"p10": float(np.percentile(rel, 10)), "p90": float(np.percentile(rel, 90)), "num_rows": int(ref.size),
            "reference_median_s": typical}
