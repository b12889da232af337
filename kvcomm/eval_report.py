"""The reports of a kvcomm run directory, built from its rows: the per-(task, protocol) summary
(summary.csv), its Markdown table (summary.md), the accuracy-vs-speedup plot (summary.png) and
COMMAND.

Separate from kvcomm.evaluate, which measures the rows: everything here takes the rows as a
DataFrame (``kvcomm.evaluate.load_rows`` reads them), needs no model, and computes its statistics
with kvcomm.metrics.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvcomm.metrics import (
    GOAL_LOWER_BOUND,
    GOAL_RECOMPUTE_FRACTION,
    GOAL_RELATIVE_ACCURACY,
    above_chance,
    bootstrap_ci,
    discordant_counts,
    goal_verdict,
    mcnemar_exact,
    median_ci,
    relative_ci,
    retention_ci,
    simultaneous_level,
)
from kvcomm.names import E2E_LINK_GBS, TASK_CHANCE, protocol_features


def summarize(rows: pd.DataFrame, protocol_order: list[str] | None = None) -> pd.DataFrame:
    """One row per (task, protocol); every comparison with ``text`` is paired on the same examples.

    Columns beyond EM/F1: ``retention`` (text's right answers the protocol also gets right) with its
    simultaneous interval ``retention_lo``/``_hi`` (Bonferroni over the ``num_compared`` protocols of
    the task: kvcomm.metrics), ``agree_text`` (same answer as text, right or wrong) with its
    simultaneous interval; ``rel_em``/``rel_f1`` (Σ protocol / Σ text, paired bootstrap 95 % CI: a
    lucky gain offsets a loss there, so the goal never reads it for EM);
    ``text_only_right``/``protocol_only_right`` and ``mcnemar_p`` (exact McNemar on EM); ``kl_median``
    with its CI; ``chance`` and ``text_above_chance``; ``goal`` ("yes" / "no" / "n too small to decide"
    / "text not above chance"; "-" for text), ``meets_goal`` = goal == "yes", ``goal_metric``: "em"
    (retention), or "rouge_l" for a free-text task (the goal then reads ``rel_f1`` at the simultaneous
    level).
    """
    out = []
    order = protocol_order or list(dict.fromkeys(rows["protocol"]))
    for task, trows in rows.groupby("task", sort=False):
        text = trows[trows["protocol"] == "text"].set_index("index")
        protos = [p for p in order if p in set(trows["protocol"])]
        num_compared = sum(1 for p in protos if p != "text")
        level = simultaneous_level(num_compared)
        chance = TASK_CHANCE.get(str(task))
        text_ok = above_chance(int((text["em"] > 0.5).sum()), len(text), chance) if len(text) else False
        for proto in protos:
            prow = trows[trows["protocol"] == proto].set_index("index")
            common = prow.index.intersection(text.index)
            out.append(_summary_row(task, proto, prow, text, common, level, num_compared, chance, text_ok))
    return pd.DataFrame(out)


def _summary_row(task, proto, prow, text, common, level, num_compared, chance, text_ok) -> dict:
    em, em_lo, em_hi = bootstrap_ci(prow["em"])
    f1, f1_lo, f1_hi = bootstrap_ci(prow["f1"])
    paired = len(common) > 0
    nan3 = (np.nan,) * 3
    p_em, t_em = (prow.loc[common, "em"], text.loc[common, "em"]) if paired else ([], [])
    rel, rel_lo, rel_hi = relative_ci(p_em, t_em) if paired else nan3
    rel_f1, rel_f1_lo, rel_f1_hi = relative_ci(prow.loc[common, "f1"], text.loc[common, "f1"]) if paired else nan3
    kept, kept_lo, kept_hi = retention_ci(p_em, t_em, level=level) if paired else nan3
    text_only, proto_only = discordant_counts(p_em, t_em) if paired else (0, 0)
    kl = prow["kl_text"] if "kl_text" in prow else pd.Series(np.nan, index=prow.index)
    kl_med, kl_lo, kl_hi = median_ci(kl)
    kla = prow["kl_answer"] if "kl_answer" in prow else pd.Series(np.nan, index=prow.index)
    kla_med, kla_lo, kla_hi = median_ci(kla)
    speedup = (text.loc[common, "prefill_s"] / prow.loc[common, "prefill_s"]) if paired else pd.Series(dtype=float)
    e2e = _end_to_end_s(prow, str(proto))
    e2e_speedup = (_end_to_end_s(text, "text").loc[common] / e2e.loc[common]) if paired else pd.Series(dtype=float)
    frac = prow["num_recomputed"].sum() / max(1, prow["num_imported"].sum())
    # NOTE(H): agreement with text's own answer is the fidelity of the import, right or wrong
    same = (prow.loc[common, "prediction"] == text.loc[common, "prediction"]).astype(float) if paired else []
    agree, agree_lo, agree_hi = bootstrap_ci(same, level=level) if paired else nan3
    # a free-text task's goal is on ROUGE-L kept (exact match of a sentence says little), at the
    # simultaneous level; its "right" examples are those where text's summary shares any word with the reference
    metric = "f1" if "scoring" in prow and (prow["scoring"] == "rouge_l").any() else "em"
    if metric == "f1" and paired:
        judged = relative_ci(prow.loc[common, "f1"], text.loc[common, "f1"], level=level)
    else:
        judged = (kept, kept_lo, kept_hi)
    num_text_right = int((text.loc[common, metric] > (0.0 if metric == "f1" else 0.5)).sum()) if paired else 0
    goal = ("-" if proto == "text" else "no text rows" if not paired else PLACEBO if _is_placebo(proto)
            else REFERENCE if _is_reference(proto)
            else goal_verdict(*judged, frac, num_text_right=num_text_right, text_above_chance=text_ok))
    return {
        "task": task, "protocol": proto, "n": len(prow), "n_paired": len(common),
        "em": em, "em_lo": em_lo, "em_hi": em_hi, "f1": f1, "f1_lo": f1_lo, "f1_hi": f1_hi,
        "retention": kept, "retention_lo": kept_lo, "retention_hi": kept_hi, "num_text_right": num_text_right,
        "agree_text": float(agree), "agree_lo": agree_lo, "agree_hi": agree_hi,
        "num_compared": num_compared, "ci_level": level,
        "rel_em": rel, "rel_em_lo": rel_lo, "rel_em_hi": rel_hi,
        "rel_f1": rel_f1, "rel_f1_lo": rel_f1_lo, "rel_f1_hi": rel_f1_hi,
        "text_only_right": text_only, "protocol_only_right": proto_only,
        "mcnemar_p": mcnemar_exact(text_only, proto_only),
        "kl_median": kl_med, "kl_lo": kl_lo, "kl_hi": kl_hi,
        "kl_answer_median": kla_med, "kl_answer_lo": kla_lo, "kl_answer_hi": kla_hi,
        "ttft_median_s": float(prow["prefill_s"].median()),
        "ttft_p20_s": float(prow["prefill_s"].quantile(0.2)), "ttft_p80_s": float(prow["prefill_s"].quantile(0.8)),
        "speedup_median": float(speedup.median()) if len(speedup) else np.nan,
        "e2e_median_s": float(e2e.median()), "e2e_speedup_median": float(e2e_speedup.median()) if len(e2e_speedup) else np.nan,
        "recompute_fraction": float(frac),
        "num_imported_mean": float(prow["num_imported"].mean()),
        "drift_mean": _mean_drift(prow),
        "seam_aligned_share": float(prow["seam_aligned"].mean()) if "seam_aligned" in prow else np.nan,
        **_transfer_medians(prow),
        "chance": np.nan if chance is None else chance, "text_above_chance": bool(text_ok),
        "goal": goal, "meets_goal": goal == "yes", "goal_metric": "rouge_l" if metric == "f1" else "em",
    }


REFERENCE = "reference (sender re-prefill, not its own K/V)"
PLACEBO = "placebo: the flip floor (text's K/V + noise of kv-rerotated's KL)"


def _end_to_end_s(prow: pd.DataFrame, label: str) -> pd.Series:
    """Per example, from the sender's finished message to B's first token: the sender's extra prefill
    (remote-prefill and its kin), the move over E2E_LINK_GBS, and B's TTFT. Serializing the K/V is not
    measured yet and not included."""
    extra = prow["extra"].map(lambda e: float(e.get("sender_reencode_s", 0.0)) if isinstance(e, dict) else 0.0) \
        if "extra" in prow else pd.Series(0.0, index=prow.index)
    if "transfer_bytes" in prow:
        kind = "text_utf8" if label == "text" else "bf16"
        moved = prow["transfer_bytes"].map(lambda t: float(t.get(kind, np.nan)) if isinstance(t, dict) else np.nan)
    else:
        moved = pd.Series(np.nan, index=prow.index)
    return prow["prefill_s"] + extra + moved / (E2E_LINK_GBS * 1e9)


def _is_placebo(label: str) -> bool:
    return str(label).partition(" ")[0] == "placebo"


def _is_reference(label: str) -> bool:
    """Whether a row's protocol ships K/V computed by an extra prefill in B's frame (never judged)."""
    try:
        return protocol_features(str(label).partition(" ")[0]).reference
    except KeyError:  # a name outside PROTOCOLS (tests' stand-ins): judged
        return False


def _mean_drift(prow: pd.DataFrame) -> float:
    """Mean over examples and senders of the position drift (NaN for rows without it)."""
    if "drift_tokens" not in prow:
        return float("nan")
    values = [d for cell in prow["drift_tokens"] if isinstance(cell, list) for d in cell]
    return float(np.mean(values)) if values else float("nan")


TRANSFER_KINDS = ("fp32", "bf16", "int8", "text_utf8")


def _transfer_medians(prow: pd.DataFrame) -> dict:
    """Median bytes per example of each transfer kind, as ``transfer_<kind>_bytes`` (NaN for rows
    measured before transfer_bytes was recorded)."""
    cells = [c for c in prow["transfer_bytes"] if isinstance(c, dict) and c] if "transfer_bytes" in prow else []
    return {f"transfer_{kind}_bytes": float(np.median([c[kind] for c in cells])) if cells else float("nan")
            for kind in TRANSFER_KINDS}


def _transfer_cell(r) -> str:
    """What this protocol moves per example: the text's bytes for ``text``, else its KV in three dtypes."""
    if not np.isfinite(r.transfer_fp32_bytes):
        return "not recorded"
    if r.protocol == "text":
        return f"{r.transfer_text_utf8_bytes / 1024:.2f} (text)"
    return f"{r.transfer_fp32_bytes / 1024:.0f} / {r.transfer_bf16_bytes / 1024:.0f} / {r.transfer_int8_bytes / 1024:.0f}"


def _goal_note(r) -> str:
    return " (on ROUGE-L)" if r.goal_metric == "rouge_l" and r.goal != "-" else ""


def _kl_cell(r, prefix: str = "kl") -> str:
    med, lo, hi = (getattr(r, f"{prefix}_{k}") for k in ("median", "lo", "hi"))
    if not np.isfinite(med):
        return "not recorded"
    return f"{med:.3g} [{lo:.3g}, {hi:.3g}]"


def _kept_cell(r) -> str:
    if not np.isfinite(r.retention):
        return "-"
    return f"{r.retention:.3f} [{r.retention_lo:.3f}, {r.retention_hi:.3f}] of {r.num_text_right}"


def _chance_cell(r) -> str:
    if not np.isfinite(r.chance):
        return "n/a (free text)"
    return f"{r.chance:.2f}: {'above' if r.text_above_chance else 'NOT above'}"


def markdown_table(summary: pd.DataFrame) -> str:
    """The summary as a Markdown table (docs/results.md pastes this file, never retypes it). Intervals
    of kept answers and agreement are simultaneous over the task's protocols (the level is in the
    header of each task's text row: 1 - 0.05 / m)."""
    from common.mdtable import markdown_table as layout

    header = ["task", "protocol", "n", "EM [95% CI]", "F1 (summary: ROUGE-L)", "text's right answers kept [sim. CI] of N",
              "same answer as text [sim. CI]", "EM rel. text (sums) [95% CI]", "F1 rel. text [95% CI]",
              "text-only / protocol-only right", "McNemar p", "KL to text, first token, median [95% CI]",
              "KL to text at the answer's first digit, median [95% CI]", "chance: text",
              "receiver TTFT median ms", "speedup vs text", "end to end vs text", "recomputed / imported",
              "drift, tokens (mean)", "seams aligned",
              "moved per example, KiB (KV fp32 / bf16 / int8)", "goal"]
    rows = [[r.task, r.protocol, r.n, f"{r.em:.3f} [{r.em_lo:.3f}, {r.em_hi:.3f}]", f"{r.f1:.3f}", _kept_cell(r),
             f"{r.agree_text:.3f} [{r.agree_lo:.3f}, {r.agree_hi:.3f}]",
             f"{r.rel_em:.3f} [{r.rel_em_lo:.3f}, {r.rel_em_hi:.3f}]", f"{r.rel_f1:.3f} [{r.rel_f1_lo:.3f}, {r.rel_f1_hi:.3f}]",
             f"{r.text_only_right} / {r.protocol_only_right}", f"{r.mcnemar_p:.3g}", _kl_cell(r), _kl_cell(r, "kl_answer"),
             _chance_cell(r),
             f"{1e3 * r.ttft_median_s:.1f}", f"{r.speedup_median:.2f}x", f"{r.e2e_speedup_median:.2f}x",
             f"{r.recompute_fraction:.3f}",
             "not recorded" if not np.isfinite(r.drift_mean) else f"{r.drift_mean:.0f}",
             f"{r.seam_aligned_share:.2f}", _transfer_cell(r), f"{r.goal}{_goal_note(r)}"] for r in summary.itertuples()]
    levels = sorted({f"{100 * lv:.1f} %" for lv in summary["ci_level"]})
    note = (f"\nSimultaneous intervals (Bonferroni over each task's protocols) at {', '.join(levels)}. Goal: at least "
            f"{GOAL_RELATIVE_ACCURACY:.2f} of text's right answers kept, the simultaneous lower bound at least "
            f"{GOAL_LOWER_BOUND:.2f}, at most {100 * GOAL_RECOMPUTE_FRACTION:.0f} % of imported tokens recomputed, text "
            "above chance. End to end: the sender's extra prefill + the move over a "
            f"{E2E_LINK_GBS:g} GB/s link (K/V in bf16, text in UTF-8; serialization not measured) + B's TTFT.\n")
    return layout(header, rows) + note


def plot_summary(summary: pd.DataFrame, path: Path) -> None:
    """Per protocol (one row of panels per task): accuracy relative to text with its CI, and speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(summary["task"].unique())
    num_protocols = summary.groupby("task").size().max()
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 0.45 * num_protocols * len(tasks) + 1.6), squeeze=False)
    for row, task in zip(axes, tasks):
        t = summary[summary["task"] == task].reset_index(drop=True)
        y = np.arange(len(t))[::-1]
        labels = [f"{p}  ({100 * f:.0f}% recomputed)" for p, f in zip(t["protocol"], t["recompute_fraction"])]
        kept = t["retention"].fillna(t["rel_f1"])  # a free-text task keeps ROUGE-L instead
        lo, hi = t["retention_lo"].fillna(t["rel_f1_lo"]), t["retention_hi"].fillna(t["rel_f1_hi"])
        err = np.vstack([kept - lo, hi - kept])
        row[0].barh(y, kept, xerr=err, color="tab:blue", alpha=0.7, capsize=3,
                    label="text's right answers kept (free text: ROUGE-L kept), simultaneous CI")
        row[0].plot(t["agree_text"], y, "k|", markersize=12, label="same answer as text")
        row[0].axvline(GOAL_RELATIVE_ACCURACY, color="gray", linestyle="--", linewidth=0.8)
        row[0].set_yticks(y, labels, fontsize=8)
        row[0].set_title(f"{task}: kept of text's right answers (text EM {t.loc[t['protocol'] == 'text', 'em'].mean():.2f}, "
                         f"n={int(t['n'].max())})", fontsize=9)
        row[1].barh(y, t["speedup_median"], color="tab:green", alpha=0.7)
        row[1].axvline(1.0, color="gray", linewidth=0.8)
        row[1].set_yticks(y, [""] * len(t))
        row[1].set_title(f"{task}: receiver prefill speedup vs text (median paired ratio)", fontsize=9)
        row[1].margins(x=0.12)  # room right of the longest bar for its "1.39x"
        for yi, v in zip(y, t["speedup_median"]):
            row[1].annotate(f"{v:.2f}x", (v, yi), fontsize=7, xytext=(3, -3), textcoords="offset points")
    # One legend below every panel: inside an axes it sat on the bars whatever corner it took.
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def by_template(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (task, template, protocol): n, EM, and text's right answers kept (both right / text right,
    no interval: a template holds a third of the examples, too few to judge alone); empty for rows
    without templates. A protocol doing well on average can fail one template, which this shows."""
    if "template" not in rows or not (rows["template"].fillna("") != "").any():
        return pd.DataFrame()
    out = []
    for (task, template), trows in rows.groupby(["task", "template"], sort=True):
        text = trows[trows["protocol"] == "text"].set_index("index")["em"]
        for proto, prow in trows.groupby("protocol", sort=False):
            em = prow.set_index("index")["em"]
            common = em.index.intersection(text.index)
            right = text.loc[common] > 0.5
            kept = float((em.loc[common][right] > 0.5).mean()) if right.any() else np.nan
            out.append({"task": task, "template": template, "protocol": proto, "n": len(prow),
                        "em": float(em.mean()), "retention": kept, "num_text_right": int(right.sum())})
    return pd.DataFrame(out)


def _template_markdown(table: pd.DataFrame) -> str:
    from common.mdtable import markdown_table as layout

    rows = [[r.task, r.template, r.protocol, r.n, f"{r.em:.3f}",
             "-" if not np.isfinite(r.retention) else f"{r.retention:.3f} of {r.num_text_right}"]
            for r in table.itertuples()]
    return "\n## By template\n\n" + layout(["task", "template", "protocol", "n", "EM", "text's right answers kept"], rows)


def write_reports(out_dir: Path, rows: pd.DataFrame, command: str, protocol_order: list[str] | None = None) -> pd.DataFrame:
    """summary.csv/.md/.png and COMMAND from the rows (and summary_by_template.csv where the task has
    templates); returns the summary."""
    out_dir = Path(out_dir)
    summary = summarize(rows, protocol_order)
    summary.to_csv(out_dir / "summary.csv", index=False, float_format="%.5g")
    templates = by_template(rows)
    extra = ""
    if len(templates):
        templates.to_csv(out_dir / "summary_by_template.csv", index=False, float_format="%.5g")
        extra = _template_markdown(templates)
    (out_dir / "summary.md").write_text(f"<!-- generated by: {command} -->\n" + markdown_table(summary) + extra)
    plot_summary(summary, out_dir / "summary.png")
    from common.outdir import write_command

    write_command(out_dir, command)
    return summary
