"""Decode MAPE (%) per split from an evaluation's metrics.csv (pooled folds, then each held-out model).

Usage: python results/eval/cpu/decode_by_split.py results/eval/cpu/metrics.csv (the table in docs/evaluation.md).
"""
import sys

import pandas as pd

df = pd.read_csv(sys.argv[1])
d = df[(df.phase == "decode") & (df.rows == "all")]
out = {}
for split in ("in_sample", "by_batch", "by_context", "by_model"):
    out[split] = d[(d.split == split) & (d.fold == "pooled")].set_index("method").mape_pct
for fold in sorted(d[(d.split == "by_model") & (d.fold != "pooled")].fold.unique()):
    out[f"held out: {fold}"] = d[(d.split == "by_model") & (d.fold == fold)].set_index("method").mape_pct
t = pd.DataFrame(out)
t = t.reindex([m for m in ("cpu_ops", "additive", "max", "additive_rowcal", "max_rowcal", "vidur", "rf") if m in t.index])
print("| method | " + " | ".join(t.columns) + " |")
print("|---" * (len(t.columns) + 1) + "|")
for m, r in t.iterrows():
    print(f"| {m} | " + " | ".join(f"{v:.1f}" for v in r) + " |")
