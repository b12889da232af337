"""The step model's price of each kernel against latencies measured on real GPUs (predictor.silicon_tables).

What is scored, per system the tables cover and gpubench has a SKU for:

- ``gemm``: every projection GEMM of the shipped model configs (qkv_proj, o_proj, gate_up, down,
  lm_head; a mixture-of-experts model's expert GEMMs are grouped kernels, not plain GEMMs, and are
  left out), at every M the table measured, matched exactly or interpolated along N/K
  (predictor.silicon_match). Shapes two models share are scored once.
- ``decode_attention``: the table's decode rows whose (heads, KV heads, head dim) a shipped model
  has, batch 1-256, cached context up to 32K: ``batch`` sequences of one new token over ``step``
  cached tokens.
- ``prefill_attention``: the prefill rows of those heads: ``batch`` sequences of ``isl`` new tokens
  and no cached prefix.

The price of a kernel is what the step model adds for it in a step run as a CUDA graph: its op time
per call (``StepModel.op_call_times`` / ``attention_call_time``) plus one graph-node interval, the
device-side gap each kernel of a graph pays. Both are kept (``predicted_op_s``, ``predicted_s``).
Nothing is fitted on the tables here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from common.model_config import ModelConfig, available_models, load_model_config
from predictor.silicon_match import GemmGrid, bracket_ratio, interpolation_summary
from predictor.silicon_steps import composed_steps, projection_shapes
from predictor.silicon_tables import TableSet, read_attention, read_gemm

KINDS = ("gemm", "decode_attention", "prefill_attention")
MAX_BATCH = 256
MAX_CONTEXT = 32768


def gemm_regime(m) -> np.ndarray:
    """M <= 16: weight streaming; 16 < M <= 512: in between; M > 512: compute bound."""
    m = np.asarray(m)
    return np.where(m <= 16, "M<=16", np.where(m <= 512, "16<M<=512", "M>512"))


def decode_regime(batch, context) -> np.ndarray:
    b = np.where(np.asarray(batch) <= 8, "b<=8", np.where(np.asarray(batch) <= 64, "b<=64", "b>64"))
    c = np.where(np.asarray(context) < 1024, "ctx<1K", np.where(np.asarray(context) < 8192, "ctx<8K", "ctx>=8K"))
    return np.char.add(np.char.add(b.astype(str), " "), c.astype(str))


def prefill_regime(batch, isl) -> np.ndarray:
    tokens = np.asarray(batch) * np.asarray(isl)
    return np.where(tokens <= 512, "tok<=512", np.where(tokens <= 8192, "tok<=8K", "tok>8K"))


@dataclass(frozen=True)
class Predictor:
    """One way of pricing a SKU: ``calibration`` None is the model's default (published, else spec);
    else one calibration for every SKU, or a dict SKU -> calibration (each retargeted to its SKU)."""

    name: str
    calibration: object = None

    def calibration_for(self, sku: str):
        return self.calibration.get(sku) if isinstance(self.calibration, dict) else self.calibration


@dataclass
class SiliconScore:
    """Per-kernel rows of every scored table, and the interpolation check of the GEMM grids."""

    rows: pd.DataFrame
    interpolation: pd.DataFrame
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)  # composed decode steps (predictor.silicon_steps)
    tables: list = field(default_factory=list)  # (TableSet, decode source, prefill source)


def gemm_shapes(models: list[ModelConfig]) -> pd.DataFrame:
    """Unique (op, n, k) projection shapes of ``models`` and which models use each."""
    seen: dict[tuple, list[str]] = {}
    for cfg in models:
        for op, (n, k) in projection_shapes(cfg, lm_head=True).items():
            seen.setdefault((op, n, k), []).append(cfg.name)
    return pd.DataFrame([(op, n, k, ",".join(sorted(set(ms)))) for (op, n, k), ms in sorted(seen.items())],
                        columns=["op", "n", "k", "models"])


def shipped_models() -> list[ModelConfig]:
    """Every shipped config a GPU serves (the test-sized ones are left out: tiny-llama, llama-60m)."""
    return [load_model_config(n) for n in available_models() if n not in ("tiny-llama", "llama-60m")]


def score_gemm(grid: GemmGrid, step_model_for, models: list[ModelConfig]) -> pd.DataFrame:
    """Rows (op, n, k, m, match, models, measured_s, predicted_op_s, predicted_s) for every model GEMM
    shape the grid covers. ``step_model_for(cfg)`` builds the StepModel that prices ``cfg``."""
    by_name = {cfg.name: cfg for cfg in models}
    out = []
    for s in gemm_shapes(models).itertuples():
        matched = [(m, *hit) for m in grid.m_values if (hit := grid.lookup(m, s.n, s.k)) is not None]
        if not matched:
            continue
        sm = step_model_for(by_name[s.models.split(",")[0]])  # any model with the shape prices it the same
        j = sm.graph.names.index(s.op)
        m = np.array([r[0] for r in matched], dtype=np.float64)
        feats = np.column_stack([np.ones_like(m), m, m, m, 2 * m])  # a decode batch of m sequences: T = S = m
        op_s = sm.op_call_times(feats)[:, j]
        for (mm, measured, how), t in zip(matched, op_s):
            out.append((s.op, s.n, s.k, int(mm), how, s.models, measured, float(t), float(t) + sm.t_launch_s))
    df = pd.DataFrame(out, columns=["op", "n", "k", "m", "match", "models", "measured_s", "predicted_op_s", "predicted_s"])
    df["regime"] = gemm_regime(df["m"]) if len(df) else []
    return df


def score_attention(rows: pd.DataFrame, kind: str, step_model_for, models: list[ModelConfig]) -> pd.DataFrame:
    """Decode or prefill attention rows whose heads a shipped model has, priced by that model."""
    by_heads: dict[tuple, ModelConfig] = {}
    for cfg in models:
        by_heads.setdefault((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), cfg)
    out = []
    for (h, kv, hd), g in rows.groupby(["num_heads", "num_key_value_heads", "head_dim"]):
        heads_of = by_heads.get((int(h), int(kv), int(hd)))
        if heads_of is None:
            continue
        sm = step_model_for(heads_of)
        for r in g.itertuples():
            b, isl, step = int(r.batch_size), int(r.isl), int(r.step)
            if b > MAX_BATCH or step + isl > MAX_CONTEXT:
                continue
            batch = [(1, step)] * b if kind == "decode_attention" else [(isl, 0)] * b
            t = sm.attention_call_time(batch)
            out.append((heads_of.name, int(h), int(kv), int(hd), b, isl, step, float(r.latency_s), t, t + sm.t_launch_s))
    df = pd.DataFrame(out, columns=["models", "num_heads", "num_kv_heads", "head_dim", "batch", "isl", "step",
                                    "measured_s", "predicted_op_s", "predicted_s"])
    if len(df):
        df["regime"] = (decode_regime(df["batch"], df["step"]) if kind == "decode_attention"
                        else prefill_regime(df["batch"], df["isl"]))
    else:
        df["regime"] = []
    return df


def score_tables(table_sets: list[TableSet], predictors: list[Predictor], *, models: list[ModelConfig] | None = None,
                 progress=None) -> SiliconScore:
    """Score every predictor on every table set (each with a gpubench SKU)."""
    from predictor.step import StepModel

    models = models or shipped_models()
    frames, checks, tables, steps = [], [], [], []
    for ts in table_sets:
        grid = GemmGrid(read_gemm(ts))
        decode, dsrc = read_attention(ts.decode)
        prefill, psrc = read_attention(ts.prefill)
        tables.append((ts, dsrc, psrc))
        if progress:
            progress(f"{ts.label}: {len(grid.rows)} GEMM, {len(decode)} decode, {len(prefill)} prefill rows")
        shapes = gemm_shapes(models)
        used = {d: _widest_bracket(grid_d, shapes[d]) for d, grid_d in (("n", grid.n_grid), ("k", grid.k_grid))}
        checks.append(interpolation_summary(grid.interpolation_check(), {d: r for d, r in used.items() if r > 1})
                      .assign(system=ts.system, framework=ts.framework, version=ts.version))
        for p in predictors:
            cache: dict[str, StepModel] = {}

            def step_model_for(cfg, _p=p, _cache=cache, _sku=ts.sku):
                if cfg.name not in _cache:
                    _cache[cfg.name] = StepModel(_sku, cfg, calibration=_p.calibration_for(_sku), cuda_graphs=True, dtype="bf16")
                return _cache[cfg.name]

            parts = [score_gemm(grid, step_model_for, models).assign(kind="gemm"),
                     score_attention(decode, "decode_attention", step_model_for, models).assign(kind="decode_attention"),
                     score_attention(prefill, "prefill_attention", step_model_for, models).assign(kind="prefill_attention")]
            labels = dict(system=ts.system, sku=ts.sku, framework=ts.framework, version=ts.version, predictor=p.name)
            steps.append(composed_steps(grid, decode, step_model_for, prefill=prefill).assign(**labels))
            for part in parts:
                if len(part):
                    frames.append(part.assign(**labels))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(rows):
        rows["signed_pct"] = (rows["predicted_s"] - rows["measured_s"]) / rows["measured_s"] * 100
        rows["ape_pct"] = rows["signed_pct"].abs()
    return SiliconScore(rows=rows, interpolation=pd.concat(checks, ignore_index=True) if checks else pd.DataFrame(),
                        steps=pd.concat(steps, ignore_index=True) if steps else pd.DataFrame(), tables=tables)


def _widest_bracket(grid: list[int], sizes) -> float:
    """The widest grid bracket (upper / lower point) any of ``sizes`` inside the grid is interpolated in."""
    ratios = [r for r in (bracket_ratio(grid, int(x)) for x in sizes) if np.isfinite(r)]
    return max(ratios, default=1.0)


def summarize(rows: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """n, MAPE, median APE, p90 APE and mean signed error per group."""
    g = rows.groupby(by, sort=False)
    return pd.DataFrame({"n": g.size(), "mape_pct": g["ape_pct"].mean(), "median_ape_pct": g["ape_pct"].median(),
                         "p90_ape_pct": g["ape_pct"].quantile(0.9), "signed_pct": g["signed_pct"].mean()}).reset_index()


def summaries(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (system, predictor, kind): every row ("all"), each regime, and for GEMMs the exact matches."""
    keys = ["system", "sku", "framework", "predictor", "kind"]
    parts = [summarize(rows, keys).assign(regime="all"), summarize(rows, keys + ["regime"])]
    exact = rows[(rows["kind"] == "gemm") & (rows["match"] == "exact")]
    if len(exact):
        parts.append(summarize(exact, keys).assign(regime="exact shapes"))
    out = pd.concat(parts, ignore_index=True)
    return out[keys + ["regime", "n", "mape_pct", "median_ape_pct", "p90_ape_pct", "signed_pct"]]
