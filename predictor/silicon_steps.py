"""Whole decode steps composed from measured kernels, against the step model's device time for the same kernels.

A decode step of a dense model launches, per layer, four projection GEMMs (qkv, o, gate_up, down, each
with M = batch) and one decode attention kernel, plus the LM head once. The measured step is the sum
of those kernels' table latencies (predictor.silicon_tables, GEMMs matched or interpolated as in
predictor.silicon_match). The predicted step is the step model's price of the same kernels: each op's
time per call plus one CUDA-graph node interval per kernel, summed over the layers.

Left out of both sides, so that both sum the same kernels: the elementwise kernels (norms, rotary
embedding, activation, residual adds; the tables do not measure them), the KV-cache write, and the
LM head (its N, the vocabulary, lies beyond the tables' N grid for every shipped model of this size).
A model whose attention heads or projection shapes a table lacks is skipped, never approximated.

A mixed chunked-prefill step (``step == "mixed"``) adds one prefill chunk of ``chunk`` new tokens
(no cached prefix: the tables' prefill rows have none) to ``batch`` decodes: its GEMMs run at M =
batch + chunk, and the tables measure its attention as two kernels, the decodes' and the chunk's,
so both sides sum two (vLLM V1 runs a mixed batch's attention as one varlen kernel: this prices
the kernels the tables have, one floor more than that kernel pays). Only the (batch, chunk) pairs
whose M and chunk length the tables measured are composed: batch 1 and 256, chunks 256-2048.
"""
from __future__ import annotations

import pandas as pd

from common.model_config import load_model_config
from predictor.ops import batch_features
from predictor.silicon_match import GemmGrid

STEP_MODELS = ("llama-3.1-8b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b", "qwen3-8b")
STEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_CONTEXTS = (512, 1024, 4096, 8192, 16384, 32768)  # cached tokens; the tables' step is this minus one
MIXED_BATCHES = (1, 256)
MIXED_CHUNKS = (256, 512, 1024, 1536, 2048)
LAYER_GEMMS = ("qkv_proj", "o_proj", "gate_up", "down")


def projection_shapes(cfg, *, lm_head: bool = False) -> dict[str, tuple[int, int]]:
    """op -> (N, K) of a layer's projection GEMMs (and the LM head's); a mixture-of-experts layer's
    expert GEMMs are grouped kernels, not plain GEMMs, and are left out."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    ops = {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q)}
    if not cfg.is_moe:
        ops.update(gate_up=(2 * inter, h), down=(h, inter))
    if lm_head:
        ops["lm_head"] = (cfg.vocab_size, h)
    return ops


def composed_steps(grid: GemmGrid, decode: pd.DataFrame, step_model_for, *, models=STEP_MODELS,
                   prefill: pd.DataFrame | None = None) -> pd.DataFrame:
    """Rows (model, step, batch, context, chunk, measured_s, predicted_s, gemm_measured_s,
    attention_measured_s, signed_pct, ape_pct): every decode step the tables can compose, and with
    ``prefill`` every mixed step (module docstring)."""
    lat = {(int(r.batch_size), int(r.step), int(r.num_heads), int(r.num_key_value_heads), int(r.head_dim)): float(r.latency_s)
           for r in decode.itertuples()}
    pre = {} if prefill is None else {
        (int(r.isl), int(r.num_heads), int(r.num_key_value_heads), int(r.head_dim)): float(r.latency_s)
        for r in prefill.itertuples() if int(r.batch_size) == 1 and int(r.step) == 0}
    out = []
    for name in models:
        cfg = load_model_config(name)
        if cfg.is_moe:
            continue
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        sm = None
        shapes = list(projection_shapes(cfg).values())
        cells = [(b, 0) for b in STEP_BATCHES] + [(b, n) for b in MIXED_BATCHES for n in MIXED_CHUNKS if (n, *heads) in pre]
        for b, chunk in cells:
            hits = [grid.lookup(b + chunk, n, k) for n, k in shapes]
            if any(hit is None for hit in hits):  # M not measured (never interpolated), or N/K off the grid
                continue
            gemm_s = sum(hit[0] for hit in hits if hit is not None)
            for ctx in STEP_CONTEXTS:
                attn = lat.get((b, ctx - 1, *heads))
                if attn is None:
                    continue
                sm = sm or step_model_for(cfg)
                batch = [(1, ctx - 1)] * b
                feats = batch_features(batch + ([(chunk, 0)] if chunk else []))[None, :]
                per_call = sm.op_call_times(feats)[0]
                gemm_pred = sum(per_call[sm.graph.names.index(op)] for op in LAYER_GEMMS)
                attn_pred = sm.attention_call_time(batch)
                if chunk:  # the chunk's own kernel, as the tables measure it
                    attn += pre[(chunk, *heads)]
                    attn_pred += sm.attention_call_time([(chunk, 0)])
                kernels = len(LAYER_GEMMS) + (2 if chunk else 1)
                predicted = cfg.num_layers * (gemm_pred + attn_pred + kernels * sm.t_launch_s)
                out.append((name, "mixed" if chunk else "decode", b, ctx, chunk, cfg.num_layers * (gemm_s + attn), predicted,
                            cfg.num_layers * gemm_s, cfg.num_layers * attn))
    df = pd.DataFrame(out, columns=["model", "step", "batch", "context", "chunk", "measured_s", "predicted_s", "gemm_measured_s",
                                    "attention_measured_s"])
    df["signed_pct"] = (df["predicted_s"] - df["measured_s"]) / df["measured_s"] * 100
    df["ape_pct"] = df["signed_pct"].abs()
    return df
