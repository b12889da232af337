"""A learned baseline for ``gpubench silicon``: a random forest trained on one GPU's measured kernels and
spec-scaled to the others, so that the step model's transfer to an unmeasured GPU is compared with
what a learned model does, not assumed better.

Trained on the source system's tables only (GEMM rows with N, K >= 256; decode and prefill attention
rows, full attention, bf16), on log features of the kernel's shape and its FLOPs and bytes, with the
log latency as target. On a target GPU each prediction is the source prediction times the ratio of
the two GPUs' spec rooflines for that kernel, max(FLOPs / P, bytes / B): the usual way a learned
per-GPU model is carried to hardware it has not seen.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from predictor.hardware import HardwareSpec
from predictor.silicon_tables import TableSet, read_attention, read_gemm

MIN_NK = 256
SEED = 0
DTYPE = "bf16"


def _gemm_terms(m, n, k):
    m, n, k = (np.asarray(v, dtype=np.float64) for v in (m, n, k))
    return 2.0 * m * n * k, 2.0 * (m * k + n * k + m * n)


def _attention_terms(batch, isl, step, heads, kv_heads, head_dim, decode: bool):
    b, n, c = (np.asarray(v, dtype=np.float64) for v in (batch, isl, step))
    h, kv, d = (np.asarray(v, dtype=np.float64) for v in (heads, kv_heads, head_dim))
    pairs = n * c + n * (n + 1) / 2  # causal query-key pairs per sequence
    flops = b * pairs * 4.0 * h * d
    nbytes = b * 2.0 * (2.0 * kv * d * (c + n) + 2.0 * h * d * n)  # K/V read, q and out rows
    return flops, nbytes


def _features(cols: list, flops, nbytes) -> np.ndarray:
    return np.column_stack([np.log2(np.maximum(np.asarray(c, dtype=np.float64), 1.0)) for c in cols]
                           + [np.log2(np.maximum(flops, 1.0)), np.log2(np.maximum(nbytes, 1.0))])


class LearnedBaseline:
    """Random forests (GEMM, decode attention, prefill attention) of one source system's tables."""

    def __init__(self, source: TableSet):
        from sklearn.ensemble import RandomForestRegressor

        self.source = source
        self.hw = HardwareSpec.from_sku(source.sku) if source.sku else None
        g = read_gemm(source)
        g = g[(g["n"] >= MIN_NK) & (g["k"] >= MIN_NK)]
        self.models: dict = {}
        flops, nbytes = _gemm_terms(g["m"], g["n"], g["k"])
        self._fit("gemm", _features([g["m"], g["n"], g["k"]], flops, nbytes), g["latency_s"], RandomForestRegressor)
        for kind, path in (("decode_attention", source.decode), ("prefill_attention", source.prefill)):
            a, _ = read_attention(path)
            if len(a):
                x = self._attention_x(a["batch_size"], a["isl"], a["step"], a["num_heads"], a["num_key_value_heads"],
                                      a["head_dim"], kind == "decode_attention")
                self._fit(kind, x, a["latency_s"], RandomForestRegressor)

    def _fit(self, kind: str, x: np.ndarray, y, forest) -> None:
        model = forest(n_estimators=60, min_samples_leaf=2, random_state=SEED, n_jobs=1)
        model.fit(x, np.log(np.asarray(y, dtype=np.float64)))
        self.models[kind] = model

    @staticmethod
    def _attention_x(batch, isl, step, heads, kv_heads, head_dim, decode: bool) -> np.ndarray:
        flops, nbytes = _attention_terms(batch, isl, step, heads, kv_heads, head_dim, decode)
        return _features([batch, isl, step, heads, kv_heads, head_dim], flops, nbytes)

    def _scale(self, target_sku: str, flops, nbytes) -> np.ndarray:
        """Target spec roofline / source spec roofline, per kernel."""
        if self.hw is None:
            return np.ones_like(np.asarray(flops, dtype=np.float64))
        tgt = HardwareSpec.from_sku(target_sku)

        def roof(hw):
            return np.maximum(np.asarray(flops) / hw.peak(DTYPE), np.asarray(nbytes) / hw.mem_bytes_per_s)

        return roof(tgt) / roof(self.hw)

    def gemm(self, target_sku: str, m, n, k) -> np.ndarray:
        flops, nbytes = _gemm_terms(m, n, k)
        raw = np.exp(self.models["gemm"].predict(_features([m, n, k], flops, nbytes)))
        return raw * self._scale(target_sku, flops, nbytes)

    def attention(self, target_sku: str, kind: str, batch, isl, step, heads, kv_heads, head_dim) -> np.ndarray:
        decode = kind == "decode_attention"
        flops, nbytes = _attention_terms(batch, isl, step, heads, kv_heads, head_dim, decode)
        raw = np.exp(self.models[kind].predict(self._attention_x(batch, isl, step, heads, kv_heads, head_dim, decode)))
        return raw * self._scale(target_sku, flops, nbytes)

    def price_rows(self, rows: pd.DataFrame, target_sku: str) -> np.ndarray:
        """Predicted seconds of ``gpubench silicon`` rows (one kind each, as scored rows carry)."""
        out = np.full(len(rows), np.nan)
        for kind, g in rows.groupby("kind"):
            idx = rows.index.get_indexer(g.index)
            if kind == "gemm":
                out[idx] = self.gemm(target_sku, g["m"], g["n"], g["k"])
            elif kind in self.models:
                out[idx] = self.attention(target_sku, str(kind), g["batch"], g["isl"], g["step"], g["num_heads"],
                                          g["num_kv_heads"], g["head_dim"])
        return out

    def price_steps(self, steps: pd.DataFrame, target_sku: str) -> np.ndarray:
        """Composed steps (predictor.silicon_steps rows): the layers' four GEMMs (M = batch + chunk) and
        decode attention, and a mixed step's chunk as its own prefill kernel. Every kernel of every step
        is priced in one forest call per kind (a call per kernel cost ~25 ms of sklearn overhead each)."""
        from common.model_config import load_model_config
        from predictor.silicon_steps import projection_shapes

        gemm_q: list[tuple[int, int, int]] = []
        attn_q: dict[str, list[tuple]] = {"decode_attention": [], "prefill_attention": []}
        plan = []  # per step: its layers, its GEMM queries' positions, its attention queries' positions
        for r in steps.itertuples():
            cfg = load_model_config(r.model)
            heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            m = r.batch + r.chunk
            shapes = list(projection_shapes(cfg).values())
            g_idx = list(range(len(gemm_q), len(gemm_q) + len(shapes)))
            gemm_q += [(m, n, k) for n, k in shapes]
            a_idx = [("decode_attention", len(attn_q["decode_attention"]))]
            attn_q["decode_attention"].append((r.batch, 1, r.context - 1, *heads))
            if r.chunk:
                a_idx.append(("prefill_attention", len(attn_q["prefill_attention"])))
                attn_q["prefill_attention"].append((1, r.chunk, 0, *heads))
            plan.append((cfg.num_layers, g_idx, a_idx))
        gemm_s = self.gemm(target_sku, *zip(*gemm_q)) if gemm_q else np.zeros(0)
        attn_s = {kind: self.attention(target_sku, kind, *zip(*q)) for kind, q in attn_q.items() if q}
        out = np.zeros(len(steps))
        for i, (layers, g_idx, a_idx) in enumerate(plan):
            gemm = sum(float(gemm_s[j]) for j in g_idx)
            attn = 0.0
            for kind, j in a_idx:
                attn += float(attn_s[kind][j])
            out[i] = layers * (gemm + attn)
        return out


def add_learned(score, learned: LearnedBaseline) -> None:
    """Append the learned baseline's prices of the rows and steps ``score`` already holds (those of its
    first predictor: every predictor scores the same kernels) to ``score``, as predictor
    ``learned (<source> forest)``."""
    name = f"learned ({learned.source.system} forest)"
    first = score.rows["predictor"].iloc[0]
    rows = score.rows[score.rows["predictor"] == first].copy()
    for sku, g in rows.groupby("sku"):
        rows.loc[g.index, "predicted_s"] = learned.price_rows(g, str(sku))
    rows["predicted_op_s"] = rows["predicted_s"]
    rows["predictor"] = name
    rows["signed_pct"] = (rows["predicted_s"] - rows["measured_s"]) / rows["measured_s"] * 100
    rows["ape_pct"] = rows["signed_pct"].abs()
    score.rows = pd.concat([score.rows, rows], ignore_index=True)
    if len(score.steps):
        steps = score.steps[score.steps["predictor"] == first].copy()
        for sku, g in steps.groupby("sku"):
            steps.loc[g.index, "predicted_s"] = learned.price_steps(g, str(sku))
        steps["predictor"] = name
        steps["signed_pct"] = (steps["predicted_s"] - steps["measured_s"]) / steps["measured_s"] * 100
        steps["ape_pct"] = steps["signed_pct"].abs()
        score.steps = pd.concat([score.steps, steps], ignore_index=True)
