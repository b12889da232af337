"""Evaluate protocols on tasks: accuracy with bootstrap intervals, receiver TTFT, recomputed tokens.

One run directory holds::

    results.jsonl   one row per (task, example, protocol), appended and flushed as measured
    config.json     model, seed, tasks, protocols of the run (a rerun must match it to resume)
    summary.csv     one row per (task, protocol): EM/F1 with 95 % bootstrap CIs, EM and F1 relative to
    summary.md      text (paired bootstrap), exact McNemar test on EM vs text, median KL of B's first
                    answer token vs text, median receiver TTFT, paired speedup vs text, recompute
                    share, and the goal verdict (yes / no / n too small to decide; kvcomm.metrics)
    summary.png     accuracy relative to text vs receiver prefill speedup, per protocol and task
    COMMAND         the command line that regenerates the directory

Agreement with text: for every example B's ``text`` reception is computed first and each row stores
``kl_text``, KL(text receiver || this receiver) of the first answer-token distribution over the full
vocabulary (0 for ``text`` itself). Computing it at evaluation time against the same example's text
logits costs nothing extra when text runs anyway, and one untimed text prefill when a resumed run
only lacks other protocols' rows.

Timing: for one example every protocol runs back to back on the same senders and B prefix, so the
paired ratio text_TTFT / protocol_TTFT of that example sees the same machine state; the speedup we
report is the median of those per-example ratios (robust on a shared, noisy machine). TTFT is the
wall time of ``kvcomm.protocols.receive`` (B's fixed prefix cached, see there); decoding is not timed.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from gpubench.errors import KVCommError
from kvcomm.metrics import (  # noqa: F401
    GOAL_RECOMPUTE_FRACTION,
    GOAL_RELATIVE_ACCURACY,
    NUM_BOOTSTRAP,
    bootstrap_ci,
    discordant_counts,
    first_token_kl,
    goal_verdict,
    mcnemar_exact,
    median_ci,
    relative_ci,
)
from kvcomm.protocols import ProtocolSpec, answer, encode_sender, receive, receiver_layout, receiver_prefix, reencode_in_receiver_frame
from kvcomm.tasks import check_task, extract_answer, generate, score

RESULTS_FILE = "results.jsonl"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate (the CLI's arguments)."""

    model: str
    tasks: tuple[str, ...]
    protocols: tuple[ProtocolSpec, ...]
    n: int
    out_dir: Path
    seed: int = 0
    max_new_tokens: int = 5
    num_threads: int = 1

    def identity(self) -> dict:
        """What must match for a rerun to resume into the same directory."""
        return {"model": self.model, "seed": self.seed, "max_new_tokens": self.max_new_tokens}


@dataclass
class Row:
    """One (task, example, protocol) measurement."""

    task: str
    index: int
    protocol: str
    name: str
    boundary_k: int
    ratio: float
    answer: str
    generated: str
    prediction: str
    em: float
    f1: float  # token F1, or ROUGE-L F1 where scoring == "rouge_l"
    prefill_s: float
    num_imported: int
    num_recomputed: int
    num_prompt_tokens: int
    seam_aligned: bool
    sender_s: float
    kl_text: float = float("nan")  # KL(text || this protocol) of B's first answer token, nats
    drift_tokens: list = field(default_factory=list)  # per sender: message start in its chat minus in B's
    extra: dict = field(default_factory=dict)
    # what handing the messages over moves, summed over senders: their KV in fp32, bf16 and 8-bit
    # (kvcomm.quant, scales and zero points included), and their text as UTF-8 (what `text` sends)
    transfer_bytes: dict = field(default_factory=dict)
    scoring: str = "exact"  # the task's: "exact" (goal on exact match) or "rouge_l" (goal on ROUGE-L)


# ---- run ----------------------------------------------------------------------------------------
def _read_done(path: Path) -> set[tuple[str, int, str]]:
    done: set[tuple[str, int, str]] = set()
    if not path.exists():
        return done
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            done.add((row["task"], int(row["index"]), row["protocol"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            # NOTE(H): a run killed mid-write leaves at most a torn last line; anything else is corruption.
            if line_no != len(path.read_text().splitlines()):
                raise KVCommError(f"{path}:{line_no}: malformed result row") from None
    return done


def _drop_torn_tail(path: Path) -> None:
    """Cut a partial last line (a run killed mid-write) so that appended rows start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _check_config(cfg: EvalConfig) -> None:
    path = cfg.out_dir / CONFIG_FILE
    identity = cfg.identity()
    results = cfg.out_dir / RESULTS_FILE
    has_rows = False
    if results.exists():
        with results.open(encoding="utf-8", errors="replace") as f:
            has_rows = any(line.strip() for line in f)
    if path.exists() and has_rows:
        # Only settings that produced rows bind the directory: a run that failed before its first
        # row (a typo in --model) leaves nothing to protect, and the corrected command goes ahead.
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise KVCommError(f"{path}: unreadable; it describes the rows in {results}: restore it or use another --out") from None
        mismatch = {k: (old.get(k), v) for k, v in identity.items() if old.get(k) != v}
        if mismatch:
            raise KVCommError(f"{cfg.out_dir} holds a run with other settings {mismatch} (old, new): use another --out")
    from gpubench.outdir import write_text_atomic

    write_text_atomic(path, json.dumps({**identity, "tasks": list(cfg.tasks), "protocols": [p.label for p in cfg.protocols],
                                "n": cfg.n}, indent=2) + "\n")


def run_eval(cfg: EvalConfig, model=None, tokenizer=None, *, progress: bool = True) -> pd.DataFrame:
    """Run every (task, example, protocol) not yet in ``results.jsonl``; returns all rows.

    The output directory is locked for the run: two evals on one --out would interleave rows.

    Args:
        model, tokenizer: an already loaded model (tests); loaded from ``cfg.model`` when None.
    """
    from gpubench.outdir import locked

    for task in cfg.tasks:
        check_task(task)
    with locked(cfg.out_dir, "kvcomm run directory"):
        _check_config(cfg)
        results = cfg.out_dir / RESULTS_FILE
        _drop_torn_tail(results)
        done = _read_done(results)
        todo = [(task, ex) for task in cfg.tasks for ex in generate(task, cfg.n, cfg.seed)
                if any((task, ex.index, p.label) not in done for p in cfg.protocols)]
        if todo:
            _run_todo(cfg, todo, done, results, model, tokenizer, progress)
        return load_rows(cfg.out_dir)


def _run_todo(cfg: EvalConfig, todo, done, results: Path, model, tokenizer, progress: bool) -> None:
    import torch

    from kvcomm.models import load_model, rope_info

    torch.set_num_threads(cfg.num_threads)
    if model is None:
        model, tokenizer = load_model(cfg.model)
    if tokenizer is None:
        raise KVCommError(f"model '{cfg.model}' has no tokenizer: the tasks are text")
    rope = rope_info(model)
    with _progress(progress, len(todo) * len(cfg.protocols)) as advance, results.open("a") as fh:
        for task, ex in todo:
            for row in _run_example(model, tokenizer, rope, cfg, ex, done):
                fh.write(json.dumps(asdict(row)) + "\n")
                fh.flush()
                advance(f"{task} {ex.index} {row.protocol}")


def _run_example(model, tokenizer, rope, cfg: EvalConfig, ex, done) -> Iterable[Row]:
    t0 = time.perf_counter()
    senders = [encode_sender(model, tokenizer, m) for m in ex.messages]
    sender_s = time.perf_counter() - t0
    layout = receiver_layout(tokenizer, ex, senders)
    if any(s.ships_reencoded and (ex.task, ex.index, s.label) not in done for s in cfg.protocols):
        senders = reencode_in_receiver_frame(model, layout, senders)
    transfer = transfer_bytes(senders, [m.text for m in ex.messages])
    drift = [int(s.cache.positions[0]) - start for s, start in zip(senders, layout.import_starts)]
    prefix = receiver_prefix(model, layout)
    # text first: every other row's KL is measured against this example's text distribution
    specs = sorted(cfg.protocols, key=lambda s: s.name != "text")
    text_logits = None
    for spec in specs:
        if (ex.task, ex.index, spec.label) in done and (spec.name != "text" or text_logits is not None):
            continue
        rec = receive(model, spec, layout, senders, prefix, rope)
        if spec.name == "text":
            text_logits = rec.last_logits
            if (ex.task, ex.index, spec.label) in done:
                continue  # recomputed only as the KL reference of a resumed example
        elif text_logits is None:
            text_logits = receive(model, ProtocolSpec("text"), layout, senders, prefix, rope).last_logits
        if spec.ships_reencoded:  # the senders' extra prefill, off B's critical path
            rec.extra["sender_reencode_s"] = sum(s.reencode_s for s in senders)
        generated = answer(model, tokenizer, rec, ex.answer_tokens or cfg.max_new_tokens)
        prediction = extract_answer(generated)
        em, f1 = score(ex, prediction)
        yield Row(task=ex.task, index=ex.index, protocol=spec.label, name=spec.name, boundary_k=spec.boundary_k,
                  ratio=spec.ratio, answer=ex.answer, generated=generated, prediction=prediction,
                  em=em, f1=f1, scoring=ex.scoring,
                  prefill_s=rec.prefill_s, num_imported=rec.num_imported, num_recomputed=rec.num_recomputed,
                  num_prompt_tokens=len(layout.ids), seam_aligned=layout.seam_aligned, sender_s=sender_s,
                  kl_text=first_token_kl(text_logits, rec.last_logits), drift_tokens=drift, extra=rec.extra,
                  transfer_bytes=transfer)


def transfer_bytes(senders, texts: list[str]) -> dict:
    """Bytes the senders' messages take on the wire: KV in fp32, bf16 and int8 (kvcomm.quant's
    storage, scales and zero points included), and the message text as UTF-8."""
    from kvcomm.quant import quantize

    elements = sum(t.numel() for s in senders for t in (*s.cache.keys, *s.cache.values))
    return {"fp32": 4 * elements, "bf16": 2 * elements,
            "int8": sum(quantize(s.cache).nbytes for s in senders),
            "text_utf8": sum(len(t.encode("utf-8")) for t in texts)}


class _progress:
    """A rich progress bar (or nothing); ``advance(description)`` per finished measurement."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda _desc: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # on stderr: stdout carries the results (the table, or --json's object); only on a terminal,
        # so that a one-line error stays one line
        console = Console(stderr=True)
        self._bar = Progress(TextColumn("kvcomm eval {task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                             TimeRemainingColumn(), console=console, disable=not console.is_terminal)
        self._bar.start()
        task_id = self._bar.add_task("", total=self.total)
        return lambda desc: self._bar.update(task_id, advance=1, description=desc)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._bar.stop()


def load_rows(out_dir: Path) -> pd.DataFrame:
    """All result rows of a run directory (a torn last line is ignored)."""
    path = Path(out_dir) / RESULTS_FILE
    if not path.exists():
        raise KVCommError(f"no {RESULTS_FILE} in {out_dir}")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return pd.DataFrame(rows)


# ---- summary ------------------------------------------------------------------------------------
def summarize(rows: pd.DataFrame, protocol_order: list[str] | None = None) -> pd.DataFrame:
    """One row per (task, protocol); every comparison with ``text`` is paired on the same examples.

    Columns beyond EM/F1: ``rel_em``/``rel_f1`` (Σ protocol / Σ text, paired bootstrap CI),
    ``text_only_right``/``protocol_only_right`` (the discordant pairs) and ``mcnemar_p`` (exact
    McNemar on EM), ``kl_median`` with its CI (rows without ``kl_text``, from older runs, give NaN),
    and ``goal`` ("yes" / "no" / "n too small to decide"; "-" for text), ``meets_goal`` = goal == "yes",
    ``goal_metric``: "em", or "rouge_l" for a free-text task (the goal then reads ``rel_f1``'s interval).
    """
    out = []
    order = protocol_order or list(dict.fromkeys(rows["protocol"]))
    for task, trows in rows.groupby("task", sort=False):
        text = trows[trows["protocol"] == "text"].set_index("index")
        for proto in [p for p in order if p in set(trows["protocol"])]:
            prow = trows[trows["protocol"] == proto].set_index("index")
            em, em_lo, em_hi = bootstrap_ci(prow["em"])
            f1, f1_lo, f1_hi = bootstrap_ci(prow["f1"])
            common = prow.index.intersection(text.index)
            paired = len(common) > 0
            nan3 = (np.nan,) * 3
            rel, rel_lo, rel_hi = relative_ci(prow.loc[common, "em"], text.loc[common, "em"]) if paired else nan3
            rel_f1, rel_f1_lo, rel_f1_hi = relative_ci(prow.loc[common, "f1"], text.loc[common, "f1"]) if paired else nan3
            text_only, proto_only = discordant_counts(prow.loc[common, "em"], text.loc[common, "em"]) if paired else (0, 0)
            kl = prow["kl_text"] if "kl_text" in prow else pd.Series(np.nan, index=prow.index)
            kl_med, kl_lo, kl_hi = median_ci(kl)
            speedup = (text.loc[common, "prefill_s"] / prow.loc[common, "prefill_s"]) if paired else pd.Series(dtype=float)
            frac = prow["num_recomputed"].sum() / max(1, prow["num_imported"].sum())
            # NOTE(H): agreement with text's own answer is the fidelity of the import, right or wrong
            agree = (prow.loc[common, "prediction"] == text.loc[common, "prediction"]).mean() if paired else np.nan
            # a free-text task's goal is on ROUGE-L kept (exact match of a sentence says little);
            # its "right" examples are those where text's summary shares any word with the reference
            metric = "f1" if "scoring" in prow and (prow["scoring"] == "rouge_l").any() else "em"
            lo_hi = (rel_f1_lo, rel_f1_hi) if metric == "f1" else (rel_lo, rel_hi)
            num_text_right = int((text.loc[common, metric] > (0.0 if metric == "f1" else 0.5)).sum()) if paired else 0
            goal = ("-" if proto == "text" else "no text rows" if not paired
                    else goal_verdict(*lo_hi, frac, num_text_right=num_text_right))
            out.append({
                "task": task, "protocol": proto, "n": len(prow), "n_paired": len(common),
                "em": em, "em_lo": em_lo, "em_hi": em_hi, "f1": f1, "f1_lo": f1_lo, "f1_hi": f1_hi,
                "rel_em": rel, "rel_em_lo": rel_lo, "rel_em_hi": rel_hi,
                "rel_f1": rel_f1, "rel_f1_lo": rel_f1_lo, "rel_f1_hi": rel_f1_hi,
                "text_only_right": text_only, "protocol_only_right": proto_only,
                "mcnemar_p": mcnemar_exact(text_only, proto_only),
                "kl_median": kl_med, "kl_lo": kl_lo, "kl_hi": kl_hi,
                "agree_text": float(agree),
                "ttft_median_s": float(prow["prefill_s"].median()),
                "ttft_p20_s": float(prow["prefill_s"].quantile(0.2)), "ttft_p80_s": float(prow["prefill_s"].quantile(0.8)),
                "speedup_median": float(speedup.median()) if len(speedup) else np.nan,
                "recompute_fraction": float(frac),
                "num_imported_mean": float(prow["num_imported"].mean()),
                "drift_mean": _mean_drift(prow),
                "seam_aligned_share": float(prow["seam_aligned"].mean()) if "seam_aligned" in prow else np.nan,
                **_transfer_medians(prow),
                "goal": goal, "meets_goal": goal == "yes", "goal_metric": "rouge_l" if metric == "f1" else "em",
            })
    return pd.DataFrame(out)


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


def _kl_cell(r) -> str:
    if not np.isfinite(r.kl_median):
        return "not recorded"
    return f"{r.kl_median:.3g} [{r.kl_lo:.3g}, {r.kl_hi:.3g}]"


def markdown_table(summary: pd.DataFrame) -> str:
    """The summary as a Markdown table (the README pastes this file, never retypes it)."""
    head = ("| task | protocol | n | EM [95% CI] | F1 (summary: ROUGE-L) | EM rel. text [95% CI] | F1 rel. text [95% CI] | "
            "text-only / protocol-only right | McNemar p | KL to text, median [95% CI] | same answer as text | "
            "receiver TTFT median ms | speedup vs text | recomputed / imported | drift, tokens (mean) | seams aligned | "
            "moved per example, KiB (KV fp32 / bf16 / int8) | goal |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in summary.itertuples():
        lines.append(
            f"| {r.task} | {r.protocol} | {r.n} | {r.em:.3f} [{r.em_lo:.3f}, {r.em_hi:.3f}] | {r.f1:.3f} | "
            f"{r.rel_em:.3f} [{r.rel_em_lo:.3f}, {r.rel_em_hi:.3f}] | {r.rel_f1:.3f} [{r.rel_f1_lo:.3f}, {r.rel_f1_hi:.3f}] | "
            f"{r.text_only_right} / {r.protocol_only_right} | {r.mcnemar_p:.3g} | {_kl_cell(r)} | {r.agree_text:.3f} | "
            f"{1e3 * r.ttft_median_s:.1f} | {r.speedup_median:.2f}x | {r.recompute_fraction:.3f} | "
            f"{'not recorded' if not np.isfinite(r.drift_mean) else f'{r.drift_mean:.0f}'} | "
            f"{r.seam_aligned_share:.2f} | {_transfer_cell(r)} | {r.goal}{_goal_note(r)} |")
    return head + "\n".join(lines) + "\n"


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
        err = np.vstack([t["rel_em"] - t["rel_em_lo"], t["rel_em_hi"] - t["rel_em"]])
        row[0].barh(y, t["rel_em"], xerr=err, color="tab:blue", alpha=0.7, capsize=3, label="EM / EM(text), 95 % CI")
        row[0].plot(t["agree_text"], y, "k|", markersize=12, label="same answer as text")
        row[0].axvline(GOAL_RELATIVE_ACCURACY, color="gray", linestyle="--", linewidth=0.8)
        row[0].set_yticks(y, labels, fontsize=8)
        row[0].set_title(f"{task}: EM relative to text (text EM {t.loc[t['protocol'] == 'text', 'em'].mean():.2f}, "
                         f"n={int(t['n'].max())})", fontsize=9)
        row[0].legend(fontsize=7, loc="lower right")
        row[1].barh(y, t["speedup_median"], color="tab:green", alpha=0.7)
        row[1].axvline(1.0, color="gray", linewidth=0.8)
        row[1].set_yticks(y, [""] * len(t))
        row[1].set_title(f"{task}: receiver prefill speedup vs text (median paired ratio)", fontsize=9)
        for yi, v in zip(y, t["speedup_median"]):
            row[1].annotate(f"{v:.2f}x", (v, yi), fontsize=7, xytext=(3, -3), textcoords="offset points")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(out_dir: Path, rows: pd.DataFrame, command: str, protocol_order: list[str] | None = None) -> pd.DataFrame:
    """summary.csv/.md/.png and COMMAND from the rows; returns the summary."""
    out_dir = Path(out_dir)
    summary = summarize(rows, protocol_order)
    summary.to_csv(out_dir / "summary.csv", index=False, float_format="%.5g")
    (out_dir / "summary.md").write_text(f"<!-- generated by: {command} -->\n" + markdown_table(summary))
    plot_summary(summary, out_dir / "summary.png")
    from gpubench.outdir import write_command

    write_command(out_dir, command)
    return summary
