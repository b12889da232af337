"""What ``gpubench evaluate`` writes for people: the headline (goal, baselines, Wilcoxon tests,
interval coverage, the phase-matched diagnostic), Markdown tables and the plots.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from predictor.eval_methods import FORM_PAIRS, METHODS, ape_pct

if TYPE_CHECKING:  # pragma: no cover
    from predictor.evaluate import EvalResult

def markdown_table(df: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A GitHub Markdown table (no tabulate dependency)."""
    def cell(v):
        if isinstance(v, (float, np.floating)):
            return "" if np.isnan(v) else format(v, floatfmt)
        return str(v)

    from common.mdtable import markdown_table as layout

    return layout(list(df.columns), ([cell(v) for v in row] for row in df.itertuples(index=False)))


def _pooled(metrics_df: pd.DataFrame, split: str, phase: str, rows: str) -> pd.DataFrame:
    m = metrics_df[(metrics_df.split == split) & (metrics_df.fold == "pooled") & (metrics_df.phase == phase)
                   & (metrics_df.rows == rows)]
    return m.set_index("method")


def headline_text(metrics_df: pd.DataFrame, wil: pd.DataFrame, *, goal_pct: float = 10.0,
                  stretch_pct: float = 5.0) -> str:
    """The held-out-by-model decode table and the verdicts the issue asks for, as Markdown."""
    split = "by_model" if (metrics_df.split == "by_model").any() else "by_batch"
    cols = ["method", "rows", "n", "mape_pct", "median_ape_pct", "p90_ape_pct", "r2"]
    sel = metrics_df[(metrics_df.split == split) & (metrics_df.fold == "pooled") & (metrics_df.phase == "decode")]
    order = {m: i for i, m in enumerate(METHODS)}
    sel = sel.sort_values(["rows", "method"], key=lambda s: s.map(order) if s.name == "method" else s)
    lines = [f"Held out {split.replace('_', ' ')} ({'leave one model out' if split == 'by_model' else 'interleaved'}), "
             "decode steps:", "", markdown_table(sel[cols]), ""]
    all_rows, prof = _pooled(metrics_df, split, "decode", "all"), _pooled(metrics_df, split, "decode", "op_profiled")
    for a, b in FORM_PAIRS:
        if a not in all_rows.index:
            continue
        x = all_rows.loc[a, "mape_pct"]
        verdict = "met" if x <= goal_pct else "NOT met"
        stretch = "met" if x <= stretch_pct else "not met"
        lines.append(f"- `{a}`, decode, {split}: MAPE {x:.2f} % (goal <= {goal_pct:g} %: {verdict}; "
                     f"stretch <= {stretch_pct:g} %: {stretch})")
        y = all_rows.loc[b, "mape_pct"] if b in all_rows.index else np.nan
        lines.append(f"  - beats `{b}` on the same rows: {'yes' if x < y else 'NO'} ({x:.2f} % vs {y:.2f} %)")
        if "vidur" in prof.index and a in prof.index:
            av, vv = prof.loc[a, "mape_pct"], prof.loc["vidur", "mape_pct"]
            lines.append(f"  - beats the Vidur-style baseline on the op-profiled rows: {'yes' if av < vv else 'NO'} "
                         f"({av:.2f} % vs {vv:.2f} %, n = {int(prof.loc['vidur', 'n'])})")
        w = wil[(wil.split == split) & (wil.phase == "decode") & (wil.pair == f"{a} vs {b}")] if len(wil) else wil
        if len(w):
            r = w.iloc[0]
            lines.append(f"  - paired Wilcoxon of |error| vs `{b}`: n = {int(r.n)}, p = {r.p_value:.3g} "
                         f"(median |err| {r.median_abs_err_a_ms:.3f} ms vs {r.median_abs_err_b_ms:.3f} ms)")
    return "\n".join(lines) + "\n"


def plot_predictions(pred: pd.DataFrame, out: Path, split: str) -> list[Path]:
    """Predicted vs measured (log-log, one panel per method) and median APE vs batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = pred[pred.split == split]
    models = sorted(g.model.unique())
    colors = {m: plt.cm.tab10(i) for i, m in enumerate(models)}
    fig, axes = plt.subplots(1, len(METHODS), figsize=(4 * len(METHODS), 4), squeeze=False)
    for ax, method in zip(axes[0], METHODS):
        gm = g[(g.method == method) & np.isfinite(g.predicted_s)]
        for m in models:
            s = gm[gm.model == m]
            ax.scatter(s.measured_s * 1e3, s.predicted_s * 1e3, s=10, color=colors[m], label=m, alpha=0.8)
        ax.set(title=f"{method} ({split})", xlabel="measured step (ms)", ylabel="predicted step (ms)")
        if len(gm):
            lo = 0.8 * min(gm.measured_s.min(), gm.predicted_s.min()) * 1e3
            hi = 1.25 * max(gm.measured_s.max(), gm.predicted_s.max()) * 1e3
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set(xscale="log", yscale="log")
        else:  # e.g. no op-profiled rows for the Vidur-style baseline (vLLM's rows)
            ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "pred_vs_measured.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, phase in zip(axes, ("decode", "all")):
        gp = g if phase == "all" else g[g.phase == phase]
        drawn = 0
        for method in METHODS:
            gm = gp[(gp.method == method) & np.isfinite(gp.predicted_s)]
            if not len(gm):
                continue
            e = gm.assign(ape=ape_pct(gm.measured_s, gm.predicted_s)).groupby("num_seqs").ape.median()
            e = e[(e > 0) & (e.index > 0)]  # a log axis: an exact prediction has no place on it
            if len(e):
                ax.plot(e.index, e.to_numpy(), marker="o", label=method)
                drawn += 1
        ax.set(xlabel="sequences in the batch", ylabel="median APE (%)", title=f"error vs batch, {phase} steps ({split})")
        if drawn:
            ax.set(xscale="log", yscale="log")
            ax.legend(fontsize=8)
    fig.tight_layout()
    p2 = out / "error_vs_batch.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


MAX_PHASE_RATIO = 3.0


def phase_matched_text(df: pd.DataFrame, predicted: pd.Series, calibration, target: str) -> str:
    """A diagnostic, not a prediction a user can make ahead of time: the CPU op tables' decode MAPE
    when each prediction is taken to the machine phase of its row, i.e. multiplied by the row's own
    reference GEMV over the probe run's median one (the same cold GEMV, timed right before the
    row's steps). What it removes is the host's drift between the probe run and the rows; nothing
    is fitted. Empty when the rows or the calibration lack the reference."""
    from predictor.calibrate import Calibration

    if "ref_gemv_s" not in df.columns:
        return ""
    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    probe_ref = np.array([(cal.cpu_ops[dt].d.get("phase_spread") or {}).get("reference_median_s") or np.nan
                          for dt in df.dtype], dtype=float)
    phase = df["ref_gemv_s"].to_numpy(float) / probe_ref
    y, p = df[target].to_numpy(np.float64), predicted.to_numpy()
    decode = (df.phase == "decode").to_numpy() & np.isfinite(phase)
    # a reference more than 3x off the probes' was itself disturbed (a 4 MiB GEMV of 76 ms was seen
    # beside vLLM rows): it says nothing about the phase, so its row is left out and counted
    sel = decode & (phase >= 1 / MAX_PHASE_RATIO) & (phase <= MAX_PHASE_RATIO)
    if not sel.any():
        return ""
    left_out = int(decode.sum() - sel.sum())
    raw, matched = ape_pct(y[sel], p[sel]).mean(), ape_pct(y[sel], p[sel] * phase[sel]).mean()
    return (f"- `cpu_ops` at each row's machine phase (prediction x the row's reference GEMV / the probe run's, "
            f"a diagnostic of host drift, not a held-out figure): decode MAPE {matched:.2f} % against "
            f"{raw:.2f} % as predicted (n = {int(sel.sum())}"
            + (f", {left_out} rows whose reference was over {MAX_PHASE_RATIO:g}x off left out" if left_out else "")
            + "; row phase / probe phase median "
            f"{np.median(phase[sel]):.3f}, p10..p90 {np.percentile(phase[sel], 10):.3f}..{np.percentile(phase[sel], 90):.3f})\n")


TIMES_OF = {"thread_cpu_s": "thread_cpu_times_s", "wall_s": "wall_times_s"}


def reference_spread_text(df: pd.DataFrame, target: str) -> str:
    """How far one repetition of a decode row lies from the row's median, the value scored: the
    reference's own noise, a floor no predictor of the median's typical step can be held below
    step for step. Torch rows repeat a step in one process; vLLM rows repeat it over fresh engine
    starts (``--takes``). Empty when no decode row has two or more repetitions."""
    column = TIMES_OF.get(target)
    if column is None or column not in df.columns:
        return ""
    devs, counts = [], []
    for value, times in zip(df[target][df.phase == "decode"], df[column][df.phase == "decode"]):
        times = np.asarray(times if times is not None else [], dtype=float)
        if len(times) >= 2 and value > 0:
            devs.append(np.abs(times / value - 1).mean() * 100)
            counts.append(len(times))
    if not devs:
        return ""
    return (f"- reference spread: one repetition of a decode row is {np.mean(devs):.2f} % from its row's median "
            f"(mean |difference|; {len(devs)} rows, median {int(np.median(counts))} repetitions each; the "
            f"measured value scored is that median)\n")


def interval_coverage_text(df: pd.DataFrame, predicted: pd.Series, calibration, target: str) -> str:
    """How often the measured step lies inside the CPU op tables' 80 % interval, per phase."""
    from predictor.calibrate import Calibration

    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    lows, highs = zip(*(cal.cpu_ops[dt].interval_factors() for dt in df.dtype))
    y, p = df[target].to_numpy(np.float64), predicted.to_numpy()
    inside = (y >= p * np.array(lows)) & (y <= p * np.array(highs))
    parts = []
    for phase in ("decode", "prefill", "mixed"):
        sel = (df.phase == phase).to_numpy()
        if sel.any():
            parts.append(f"{phase} {inside[sel].mean():.0%} of {int(sel.sum())}")
    return (f"- `cpu_ops` 80 % interval (x{min(lows):.2f} .. x{max(highs):.2f} of the prediction, from the probe "
            f"run's own spread): holds the measured step for {', '.join(parts)} rows\n")


def report_markdown(res: EvalResult, df: pd.DataFrame, cmd: str, *, target: str) -> str:
    """Every pooled table, the S(N) fits, Wilcoxon and transfer pairs, stamped with the command."""
    cols = ["method", "phase", "rows", "n", "mape_pct", "median_ape_pct", "p90_ape_pct", "r2"]
    parts = [f"# Step-time evaluation\n\nRegenerate: `{cmd}`\n",
             f"Rows: {len(df)} steps of {', '.join(sorted(df.model.unique()))} "
             f"(target `{target}`; device {', '.join(sorted(df.device_type.unique()))}; "
             f"host load average during profiling {df.get('loadavg_1m_before', pd.Series([np.nan])).median():.1f}).\n",
             "## Headline\n", res.headline]
    for split in res.metrics.split.unique():
        m = res.metrics[(res.metrics.split == split) & (res.metrics.fold == "pooled")]
        folds = ", ".join(res.metrics[(res.metrics.split == split) & (res.metrics.fold != "pooled")].fold.unique())
        parts += [f"\n## {split} (test folds: {folds})\n", markdown_table(m[cols]), ""]
    parts += ["\n## Host residual S(N) per training split (ms)\n", markdown_table(res.host_fits, ".4f"),
              "\n## Paired Wilcoxon: |error| additive vs max\n", markdown_table(res.wilcoxon, ".4g")]
    if len(res.transfer):
        parts += ["\n## Train on one model, score on another\n", markdown_table(res.transfer)]
    return "\n".join(parts) + "\n"
