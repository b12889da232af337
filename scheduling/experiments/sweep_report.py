"""The sweep's report: ``tables.md`` (SKU x policy by JPS) and the plots of metric vs load."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

# Metric names as the replay summary may spell them; the first present is plotted.
METRIC_CANDIDATES = {
    "jct_mean": ("jct_mean_s", "jct_s_mean", "mean_jct_s"),
    "jct_p90": ("jct_p90_s", "jct_s_p90"),
    "ttft_p90": ("ttft_p90_s", "ttft_s_p90"),
    "gpu_hit": ("gpu_prefix_hit_rate", "prefix_hit_rate", "gpu_hit_rate"),
    "pool_hit": ("pool_hit_rate", "offload_hit_rate", "pool_prefix_hit_rate"),
    "preemptions": ("preemptions", "num_preemptions"),
    "recomputed": ("recomputed_tokens", "num_recomputed_tokens"),
    "jct_p50": ("jct_p50_s",), "jct_p99": ("jct_p99_s",),
    "ttft_p50": ("ttft_p50_s",), "ttft_p99": ("ttft_p99_s",),
    "tpot_p50": ("tpot_p50_s",), "tpot_p90": ("tpot_p90_s",), "tpot_p99": ("tpot_p99_s",),
    "slo_share": ("slo_turn_share",), "goodput": ("goodput_tok_per_s",),
    # The agent SLO of every replay (scheduling.slo: TTFT, TPOT, a tool-turn deadline, a job deadline)
    "slo_turn": ("slo_attainment_turn",), "slo_job": ("slo_attainment_job",), "slo_ttft": ("slo_attainment_ttft",),
    "slo_tpot": ("slo_attainment_tpot",), "slo_tool_turn": ("slo_attainment_tool_turn",),
    "slo_job_deadline": ("slo_attainment_job_deadline",), "job_goodput": ("slo_attainment_job_goodput_per_s",),
    "token_goodput": ("slo_attainment_token_goodput_per_s",),
}
# The tables of tables.md: (metric, title, format). Serving metrics as users ask for them: JCT,
# TTFT and TPOT percentiles, and goodput under the replay's SLO (TTFT <= 2 s, TPOT <= 0.1 s).
TABLES = (
    ("jct_mean", "JCT mean (s)", "{:.0f}"), ("jct_p50", "JCT p50 (s)", "{:.0f}"), ("jct_p90", "JCT p90 (s)", "{:.0f}"),
    ("jct_p99", "JCT p99 (s)", "{:.0f}"),
    ("ttft_p50", "turn TTFT p50 (s)", "{:.3g}"), ("ttft_p90", "turn TTFT p90 (s)", "{:.3g}"),
    ("ttft_p99", "turn TTFT p99 (s)", "{:.3g}"),
    ("tpot_p50", "TPOT p50 (ms)", "ms"), ("tpot_p90", "TPOT p90 (ms)", "ms"), ("tpot_p99", "TPOT p99 (ms)", "ms"),
    ("slo_share", "turns meeting the SLO (TTFT <= 2 s, TPOT <= 0.1 s)", "{:.1%}"),
    ("goodput", "goodput (output tokens/s of turns meeting the SLO)", "{:.0f}"),
    ("slo_turn", "agent SLO: turns meeting every target that applies (TTFT, TPOT, tool turn)", "{:.1%}"),
    ("slo_job", "agent SLO: jobs whose every turn meets it (and the job deadline, if set)", "{:.1%}"),
    ("slo_ttft", "agent SLO attainment: TTFT", "{:.1%}"), ("slo_tpot", "agent SLO attainment: TPOT", "{:.1%}"),
    ("slo_tool_turn", "agent SLO attainment: tool-turn deadline (turns that trigger a tool)", "{:.1%}"),
    ("slo_job_deadline", "agent SLO attainment: job deadline", "{:.1%}"),
    ("job_goodput", "job goodput (jobs/s meeting the agent SLO)", "{:.3g}"),
    ("token_goodput", "token goodput (output tokens/s of turns meeting the agent SLO)", "{:.0f}"),
    ("gpu_hit", "GPU prefix-hit rate", "{:.1%}"), ("pool_hit", "pool hit rate (share of GPU misses)", "{:.1%}"),
    ("preemptions", "preemptions", "{:.0f}"),
)
POLICY_COLORS = {"fcfs": "#d43c3c", "continuum": "#3b6fd8", "cpu-offload": "#2fa37a", "lmcache": "#d97a2b",
                 "continuum-offload": "#8a4fc7"}


_VARIANT_COLORS = ("#6b6b6b", "#b8860b", "#17becf", "#e377c2", "#bcbd22", "#1f77b4", "#8c564b", "#2ca02c",
                   "#9467bd", "#ff7f0e", "#393b79", "#e7ba52")


def policy_colors(labels) -> dict[str, str]:
    """Each label's colour: a policy its own; the variants (``NAME@...``) the fixed list's colours in
    the order they come (distinct up to twelve of them)."""
    out, k = {}, 0
    for label in dict.fromkeys(labels):
        if label in POLICY_COLORS:
            out[label] = POLICY_COLORS[label]
        else:
            out[label] = _VARIANT_COLORS[k % len(_VARIANT_COLORS)]
            k += 1
    return out


def legend_names(labels) -> tuple[dict[str, str], str]:
    """Short legend names when every label shares a head up to an ``@`` or ``+`` (a sweep of one
    policy's variants, e.g. ``fcfs@replicas=4+router=`` before each router): ``(label -> what
    follows the head, the head)``; the labels themselves and "" otherwise."""
    import os

    labels = list(dict.fromkeys(labels))
    head = os.path.commonprefix(labels) if len(labels) > 1 else ""
    cut = max(head.rfind("@"), head.rfind("+"))
    if cut < 0 or any(len(label) == cut + 1 for label in labels):
        return {label: label for label in labels}, ""
    head = head[: cut + 1]
    return {label: label[len(head):] for label in labels}, head


def metric_column(frame: pd.DataFrame, what: str) -> str | None:
    """The table's column for a metric (see METRIC_CANDIDATES), or None."""
    return next((c for c in METRIC_CANDIDATES[what] if c in frame.columns), None)


def _panel_grid(num: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, num)
    nrows = math.ceil(num / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(8.0, 4.4 * ncols), 3.3 * nrows + 0.9), squeeze=False,
                             sharex=True)
    for ax in axes.flat[num:]:
        ax.set_visible(False)
    return plt, fig, list(axes.flat)


def _plot_metric(frame: pd.DataFrame, out_png: Path, series: list[tuple[str, str, str]], ylabel: str,
                 title: str, logy: bool = False) -> Path | None:
    """One panel per SKU; x = JPS; one line per policy per (column, linestyle, label) in series;
    the line is the mean over seeds, the band min..max over seeds."""
    ok = frame[frame["error"] == ""] if "error" in frame.columns else frame
    series = [s for s in series if s[0] in ok.columns]
    if ok.empty or not series:
        return None
    from matplotlib.ticker import NullLocator

    from common.plotaxes import plain_log_ticks

    skus = list(dict.fromkeys(ok["sku"]))
    colors = policy_colors(frame["policy"])
    names, head = legend_names(frame["policy"])
    plt, fig, axes = _panel_grid(len(skus))
    for ax, sku in zip(axes, skus):
        sub = ok[ok["sku"] == sku]
        for policy in dict.fromkeys(frame["policy"]):
            rows = sub[sub["policy"] == policy]
            if rows.empty:
                continue
            for col, style, label in series:
                g = rows.groupby("jps")[col].agg(["mean", "min", "max"]).reset_index()
                color = colors[policy]
                ax.plot(g["jps"], g["mean"], style, color=color, marker="o", ms=3,
                        label=f"{names[policy]}{label}" if sku == skus[0] else None)
                if (g["max"] > g["min"]).any():
                    ax.fill_between(g["jps"], g["min"], g["max"], color=color, alpha=0.15, lw=0)
        ax.set_title(sku)
        ax.set_xscale("log")
        levels = sorted(ok["jps"].unique())
        ax.set_xticks(levels, [f"{j:g}" for j in levels])
        ax.xaxis.set_minor_locator(NullLocator())  # the JPS levels run are the x ticks, nothing between
        if logy:
            ax.set_yscale("log")
            plain_log_ticks(ax.yaxis)  # 600, not 6x10^2
        ax.grid(alpha=0.3, which="both")
        ax.set_xlabel("arrival rate (jobs/s)")
        ax.set_ylabel(ylabel)
    handles, labels = axes[0].get_legend_handles_labels()
    num_rows = math.ceil(len(labels) / 4)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False, fontsize=8)
    fig.suptitle(f"{title} · {head}…" if head else title, fontsize=10)
    fig.tight_layout(rect=(0, 0.045 * num_rows + 0.02, 1, 0.97))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _format_cell(value: float, fmt: str) -> str:
    if value != value:
        return "–"
    return f"{value * 1e3:.1f}" if fmt == "ms" else fmt.format(value)


def _pivot_lines(pivot: pd.DataFrame, title: str, fmt: str) -> str:
    from common.mdtable import markdown_table

    header = ["SKU", "policy", *(f"{j:g} jobs/s" for j in pivot.columns)]
    rows = ([sku, policy, *(_format_cell(v, fmt) for v in row)] for (sku, policy), row in pivot.iterrows())
    return "\n".join([title, "", markdown_table(header, rows)])


def markdown_tables(frame: pd.DataFrame) -> str:
    """SKU × policy by JPS tables (seed means) of every metric in :data:`TABLES`, and mean JCT as
    a ratio to FCFS at the same cell (FCFS / policy: above 1 is faster)."""
    ok = frame[frame["error"] == ""] if "error" in frame.columns else frame
    parts = []
    slo_note = _slo_targets(ok)
    if slo_note:
        parts.append(slo_note)
    jobs_col = "num_jobs" if "num_jobs" in ok.columns else None
    if jobs_col and not ok.empty:
        counts = sorted(ok[jobs_col].dropna().astype(int).unique())
        parts.append(f"Every cell replays {', '.join(map(str, counts))} jobs; at a high arrival rate they all arrive "
                     "within a short span (`arrival_span_s`) and a cell measures how long the engine takes to "
                     "drain them.")
    for what, title, fmt in TABLES:
        col = metric_column(ok, what)
        if col is None or ok.empty:
            continue
        pivot = ok.groupby(["sku", "policy", "jps"])[col].mean().unstack("jps")
        parts.append(_pivot_lines(pivot, f"**{title}** (`{col}`)", fmt))
        if what == "jct_mean" and "fcfs" in set(ok["policy"]):
            fcfs = pivot.xs("fcfs", level="policy")
            ratio = pd.DataFrame({key: fcfs.loc[key[0]] / row for key, row in pivot.iterrows()}).T
            ratio.index = pd.MultiIndex.from_tuples(ratio.index, names=["sku", "policy"])
            parts.append(_pivot_lines(ratio, "**JCT mean, FCFS ÷ policy** (above 1: the policy is faster)",
                                      "{:.2f}x"))
    n_cells = len(frame)
    return f"{n_cells} runs ({(frame['error'] != '').sum() if 'error' in frame.columns else 0} failed).\n\n" + "\n\n".join(parts) + "\n"


def _slo_targets(ok: pd.DataFrame) -> str | None:
    """One line naming the agent SLO the cells were scored against (the targets are recorded per
    cell as ``slo_ttft_s``/``slo_tpot_s``, and the tool-turn and job deadlines in each replay's
    summary.json), or None for a table from before it was recorded."""
    if "slo_attainment_turn" not in ok.columns or ok.empty:
        return None
    ttft = sorted(set(ok["slo_ttft_s"].dropna())) if "slo_ttft_s" in ok.columns else []
    tpot = sorted(set(ok["slo_tpot_s"].dropna())) if "slo_tpot_s" in ok.columns else []
    said = ", ".join(p for p in (f"TTFT <= {'/'.join(f'{v:g}' for v in ttft)} s" if ttft else "",
                                 f"TPOT <= {'/'.join(f'{v * 1e3:g}' for v in tpot)} ms" if tpot else "") if p)
    return (f"The agent SLO of these replays: {said or 'see summary.json'}, a turn that triggers a tool done within "
            "its tool-turn deadline (default 10 s); a job meets it when all its turns do (`gpubench replay --help`, "
            "--slo).")


def pool_note(frame: pd.DataFrame) -> str | None:
    """One line when some runs' GPU KV pool never filled (nothing evicted, no request short of
    blocks, no preemption): there the policies' KV handling made no difference. None otherwise, and
    for a table from before these columns were recorded."""
    counts = ["kv_evicted_blocks", "kv_block_shortages", "preemptions"]
    if frame.empty or any(c not in frame.columns for c in counts + ["kv_peak_blocks", "num_gpu_blocks"]):
        return None
    ok = frame[frame["error"] == ""] if "error" in frame.columns else frame
    never = ok[(ok[counts].fillna(1) == 0).all(axis=1)]
    if never.empty:
        return None
    fullest = never.loc[(never["kv_peak_blocks"] / never["num_gpu_blocks"]).idxmax()]
    return (f"note: the GPU KV pool never filled in {len(never)} of {len(ok)} runs (at most "
            f"{int(fullest['kv_peak_blocks']):,} of {int(fullest['num_gpu_blocks']):,} blocks; kv_peak_blocks in "
            f"sweep.csv): there KV-cache eviction, pinning and offload made no difference; to compare KV policies "
            f"add jobs (--jobs), raise --jps or shrink the pool (--set num_gpu_blocks=N)")


def write_plots(frame: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """jct_vs_jps.png, ttft_vs_jps.png, tpot_vs_jps.png, goodput_vs_jps.png, slo_attainment_vs_jps.png,
    hit_rates.png, preemptions.png (those whose metrics exist), and tables.md."""
    out = Path(out_dir)
    made = []
    col = metric_column
    specs = [
        ("jct_vs_jps.png", [(col(frame, "jct_mean"), "-", " mean"), (col(frame, "jct_p90"), ":", " p90")],
         "job completion time (s)", "JCT vs load, per policy (line: mean over seeds; dotted: p90)", True),
        ("ttft_vs_jps.png", [(col(frame, "ttft_p50"), "-", " p50"), (col(frame, "ttft_p90"), ":", " p90")],
         "TTFT (s)", "Turn TTFT vs load (solid: p50; dotted: p90)", True),
        ("tpot_vs_jps.png", [(col(frame, "tpot_p50"), "-", " p50"), (col(frame, "tpot_p90"), ":", " p90")],
         "TPOT (s)", "Time per output token vs load (solid: p50; dotted: p90)", True),
        ("goodput_vs_jps.png", [(col(frame, "goodput"), "-", "")], "output tokens/s meeting the SLO",
         "Goodput under the SLO (TTFT <= 2 s, TPOT <= 0.1 s) vs load", False),
        ("slo_attainment_vs_jps.png", [(col(frame, "slo_turn"), "-", " turns"), (col(frame, "slo_job"), ":", " jobs")],
         "share meeting the agent SLO", "Agent SLO attainment vs load (solid: turns; dotted: jobs)", False),
        ("hit_rates.png", [(col(frame, "gpu_hit"), "-", " GPU"), (col(frame, "pool_hit"), "--", " pool")],
         "hit rate (share of prompt tokens)", "Prefix hit rates: GPU cache (solid), offload pool (dashed)", False),
        ("preemptions.png", [(col(frame, "preemptions"), "-", "")], "preemptions", "Preemptions vs load", False),
    ]
    for name, series, ylabel, title, logy in specs:
        present = [(c, style, label) for c, style, label in series if c is not None]
        if present:
            path = _plot_metric(frame, out / name, present, ylabel, title, logy)
            if path:
                made.append(path)
    (out / "tables.md").write_text(markdown_tables(frame))
    made.append(out / "tables.md")
    return made
