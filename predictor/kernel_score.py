"""``gpubench score-kernels``: the step model's device time, op kind by op kind, against the kernel
times torch.profiler recorded in GPU step rows.

An eager engine loop on a fast GPU is bound by the host (each step's wall time is the time Python
takes to launch its kernels), so its wall time says nothing about the device model. The rows that
``gpubench profile`` ran under the profiler (``ops_profiled``) also hold, per op kind, the summed
device time of the kernels each op launched (``ops_json``, median over the profiled steps). Those
are scored here against what the model prices for the same batch, with nothing fitted on them:

- ``linear``: the rows' linear layers (torch ``aten::linear``/``addmm``/``mm``, lm_head included)
  against the model's GEMM ops (its projections and lm_head), counted as the loop runs them
  (separate q, k, v, gate and up kernels, each paying the fixed time per GEMM kernel);
- ``attention``: scaled-dot-product attention against the model's attention op;
- ``kernels``: every kernel of the step against the model's device time (its ops, without the
  launch interval and host residual, which are not kernel time). The eager loop runs unfused
  elementwise kernels (RMSNorm, rotary embedding, residual adds) that a serving engine fuses and the
  model prices as such, so this kind measures the loop, not only the model.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import ConfigError

# measured kind (profiler) -> model op kinds it is scored against
SCORED_KINDS = {"linear": ("gemm",), "attention": ("attention",)}
KINDS = ("linear", "attention", "kernels")


@dataclass(frozen=True)
class KernelScore:
    """Per (row, kind) measured and predicted device time, and the summary tables."""
    rows: pd.DataFrame     # key, model, phase, num_seqs, context_max, kind, measured_s, predicted_s, ape_pct, signed_pct
    by_model: pd.DataFrame  # kind, model, n, mape_pct, signed_pct
    pooled: pd.DataFrame    # kind, phase, n, mape_pct, signed_pct, median_ape_pct
    notes: tuple = ()       # warnings for the user (rows of another GPU than --sku)


# NOTE(kernel_score): `gpubench profile`'s torch engine runs each layer's projections as separate
# kernels (q, k, v, o, gate, up, down) where the model's GPU graph holds a serving engine's fused
# ones (qkv, o, gate_up, down). The bytes and FLOPs are the same; the kernel count is not, and each
# kernel pays the calibration's fixed GEMM time (t_gemm_fixed_s, 0 when not measured), so the
# prediction is scored for the loop's count.
SEPARATE_GEMMS_PER_LAYER = 7


def _predicted_by_kind(model, batch) -> dict[str, float]:
    pred = model.predict(batch)
    by_kind: dict[str, float] = {}
    for op in pred.ops.values():
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.t_s
    out = {kind: sum(by_kind.get(k, 0.0) for k in model_kinds) for kind, model_kinds in SCORED_KINDS.items()}
    model_kernels = sum(op.num_kernels for op in pred.ops.values() if op.kind == "gemm")  # over its calls
    loop_kernels = SEPARATE_GEMMS_PER_LAYER * model.model.num_layers + 1  # + lm_head
    separate = (loop_kernels - model_kernels) * model.t_gemm_fixed_s
    out["linear"] += separate
    out["kernels"] = pred.blocks_s + pred.sample_s + separate
    return out


def score_kernels(df: pd.DataFrame, *, sku: str, calibration) -> KernelScore:
    """Score the op-profiled rows of ``df`` (step rows of one or more models) on ``sku``."""
    from predictor.hardware import HardwareSpec
    from predictor.step import StepModel

    if HardwareSpec.from_sku(sku).backend == "cpu":
        raise ConfigError(f"--sku {sku}: score-kernels scores GPU kernel times (CPU op times are scored by "
                          "`gpubench evaluate`, whose op tables price them)")
    if set(df.device_type) != {"cuda"}:
        raise ConfigError(f"score-kernels needs GPU step rows; these were measured on {', '.join(sorted(set(df.device_type)))}")
    notes = []
    names = sorted({str(n) for n in df.get("device_name", pd.Series(dtype=str)).dropna()})
    family = sku.split("-")[0].lower()
    if names and not any(family in n.lower().replace(" ", "") for n in names):
        notes.append(f"--sku {sku}: the rows were measured on {', '.join(names)}; scored as {sku} anyway")
    prof = df[df["ops_profiled"].fillna(False).astype(bool)]
    if not len(prof):
        raise ConfigError("no row was profiled per op (profile with --ops-subset K > 0)")
    models: dict = {}
    out = []
    for r in prof.itertuples(index=False):
        key = (r.model, r.dtype)
        if key not in models:
            models[key] = StepModel(sku, r.model, calibration=calibration, dtype=r.dtype)
        predicted = _predicted_by_kind(models[key], [tuple(s) for s in json.loads(r.batch_json)])
        ops = json.loads(r.ops_json)
        measured = {kind: float(ops.get(kind, 0.0)) for kind in SCORED_KINDS}
        measured["kernels"] = float(r.op_sum_s)
        for kind in KINDS:
            if measured[kind] <= 0:
                continue  # a kind this step did not run (no attention in a zero-context prefill, say)
            out.append({"key": r.key, "model": r.model, "phase": r.phase, "num_seqs": int(r.num_seqs),
                        "context_max": int(r.context_max), "kind": kind, "measured_s": measured[kind],
                        "predicted_s": predicted[kind]})
    rows = pd.DataFrame(out)
    rows["signed_pct"] = (rows["predicted_s"] - rows["measured_s"]) / rows["measured_s"] * 100
    rows["ape_pct"] = rows["signed_pct"].abs()

    def summarize(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
        g = frame.groupby(by, sort=False)
        return pd.DataFrame({"n": g.size(), "mape_pct": g["ape_pct"].mean(), "median_ape_pct": g["ape_pct"].median(),
                             "signed_pct": g["signed_pct"].mean()}).reset_index()

    pooled = pd.concat([summarize(rows, ["kind"]).assign(phase="all"), summarize(rows, ["kind", "phase"])],
                       ignore_index=True)[["kind", "phase", "n", "mape_pct", "median_ape_pct", "signed_pct"]]
    return KernelScore(rows=rows, by_model=summarize(rows, ["kind", "model"]), pooled=pooled, notes=tuple(notes))


def command_line(rows: list[str], *, sku: str, calibration: str | None, out: str, force_calibration: bool = False) -> str:
    parts = ["gpubench", "score-kernels", *rows, "--sku", sku]
    if calibration:
        parts += ["--calibration", calibration] + (["--force-calibration"] if force_calibration else [])
    return shlex.join(parts + ["--out", out])


def markdown(score: KernelScore, command: str) -> str:
    from common.mdtable import markdown_table as md_table

    fmt = lambda v: f"{v:.1f}"  # noqa: E731
    pooled = [[r.kind, r.phase, int(r.n), fmt(r.mape_pct), fmt(r.median_ape_pct), f"{r.signed_pct:+.1f}"]
              for r in score.pooled.itertuples()]
    by_model = [[r.kind, r.model, int(r.n), fmt(r.mape_pct), f"{r.signed_pct:+.1f}"] for r in score.by_model.itertuples()]
    return (f"<!-- {command} -->\n# Kernel time: the step model against torch.profiler\n\n"
            "Measured: the summed CUDA time of each op kind's kernels in one step (median over the profiled "
            "steps). Predicted: the model's device time for the same batch (linear: its GEMM ops; attention: "
            "its attention op; kernels: all its ops, no launch interval or host residual). Nothing is fitted "
            "on these rows.\n\n"
            + md_table(["kind", "phase", "n", "MAPE %", "median APE %", "mean signed %"], pooled)
            + "\n\n## By model\n\n"
            + md_table(["kind", "model", "n", "MAPE %", "mean signed %"], by_model) + "\n")


def plot(score: KernelScore, path: Path) -> Path:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.outdir import write_bytes_atomic

    fig, axes = plt.subplots(1, len(KINDS), figsize=(13, 4.2), dpi=100)
    for ax, kind in zip(axes, KINDS):
        sub = score.rows[score.rows["kind"] == kind]
        for model, g in sub.groupby("model"):
            ax.scatter(g["measured_s"] * 1e3, g["predicted_s"] * 1e3, s=18, label=model)
        if len(sub):
            lo = float(np.min(sub[["measured_s", "predicted_s"]].to_numpy())) * 1e3 * 0.8
            hi = float(np.max(sub[["measured_s", "predicted_s"]].to_numpy())) * 1e3 * 1.25
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_title(kind, fontsize=10)
        ax.set_xlabel("measured kernel time (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("predicted (ms)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return write_bytes_atomic(path, buf.getvalue())


def run_score(rows: list[str], *, sku: str, calibration, calibration_path: str | None, out: str,
              force_calibration: bool = False) -> tuple[KernelScore, str, list[Path]]:
    """Score, then write kernels.csv, summary.csv, kernels.md, kernels.png and COMMAND into ``out``.
    ``calibration``: what the model uses (None, or the Calibration host_match.calibration_for gave);
    ``calibration_path`` and ``force_calibration`` are what the COMMAND records. Returns the score,
    its Markdown and the files written."""
    from common.outdir import locked, write_command, write_text_atomic
    from predictor.eval_rows import load_rows

    score = score_kernels(load_rows(rows), sku=sku, calibration=calibration)
    command = command_line(rows, sku=sku, calibration=calibration_path, out=out, force_calibration=force_calibration)
    text = markdown(score, command)
    with locked(out) as d:
        summary = pd.concat([score.pooled.assign(model="all"), score.by_model.assign(phase="all")], ignore_index=True)
        files = [write_text_atomic(d / "kernels.csv", score.rows.to_csv(index=False)),
                 write_text_atomic(d / "summary.csv", summary.to_csv(index=False)),
                 write_text_atomic(d / "kernels.md", text), plot(score, d / "kernels.png"), write_command(d, command)]
    return score, text, files
