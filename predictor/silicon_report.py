"""``gpubench silicon``'s outputs: the Markdown tables, one predicted-vs-measured plot per system, the
CSVs and COMMAND, written into one locked output directory."""
from __future__ import annotations

import io
import shlex
from pathlib import Path

import numpy as np
import pandas as pd

from predictor.silicon_score import KINDS, SiliconScore, summaries


def command_line(*, systems: list[str], framework: str, calibrations: list[str], force: bool, out: str,
                 fit_from: str | None = None, learned_from: str | None = None) -> str:
    parts = ["gpubench", "silicon", "--systems", ",".join(systems), "--framework", framework]
    for c in calibrations:
        parts += ["--calibration", c]
    parts += ["--force-calibration"] if force and calibrations else []
    parts += ["--fit-from", fit_from] if fit_from else []
    parts += ["--learned-from", learned_from] if learned_from else []
    return shlex.join(parts + ["--out", out])


def markdown(score: SiliconScore, summary: pd.DataFrame, command: str, *, wheel: str) -> str:
    from common.mdtable import markdown_table

    f1 = lambda v: f"{v:.1f}"  # noqa: E731
    head = ["system", "predictor", "kind", "regime", "n", "MAPE %", "median %", "p90 %", "signed %"]
    body = [[r.system, r.predictor, r.kind, r.regime, int(r.n), f1(r.mape_pct), f1(r.median_ape_pct), f1(r.p90_ape_pct),
             f"{r.signed_pct:+.1f}"] for r in summary.itertuples()]
    pooled = summary[summary["regime"] == "all"]
    tables = [[ts.label, ts.sku, dsrc or "-", psrc or "-"] for ts, dsrc, psrc in score.tables]
    rows = score.rows
    match = rows[rows["kind"] == "gemm"].groupby(["system", "predictor", "match"]).size().reset_index(name="n")
    match = match[match["predictor"] == match["predictor"].iloc[0]] if len(match) else match
    interp = [[r.system, r.direction, r.subset, int(r.n), f1(r.mape_pct), f1(r.median_ape_pct), f1(r.p90_ape_pct)]
              for r in score.interpolation.itertuples()]
    return (f"<!-- {command} -->\n# The step model's kernel prices against measured GPU kernels\n\n"
            f"Measured: the kernel latencies NVIDIA's aiconfigurator collectors timed on each GPU, read from the "
            f"installed `aiconfigurator-core` wheel ({wheel}). Predicted: the step model's op time per call plus one "
            "CUDA-graph node interval per kernel. Only the `silicon fit`, `own <framework> fit` and `learned` predictors "
            "were fitted on tables (in-sample where those are the tables scored). Shapes: every projection GEMM "
            "of the shipped model configs at every M the table measured; decode and prefill attention rows whose "
            "heads a shipped model has (batch <= 256, context <= 32K).\n\n"
            "Predictors: `default` is what `gpubench predict --sku` uses without a calibration (published constants, "
            "else spec); `<sku> probes` a probe-run calibration and `<sku> silicon fit` one from `gpubench fit "
            "--from-silicon`, each retargeted to the other GPUs (nothing of the target measured); `own <framework> "
            "fit` each GPU's own `fit --from-silicon` of that framework's tables (in-sample when it is the framework "
            "scored here); `learned (<system> forest)` random forests trained on that system's tables and scaled to "
            "each GPU by the ratio of their spec rooflines (in-sample on that system).\n\n"
            "## Per system and kind\n\n"
            + markdown_table(head, [[r.system, r.predictor, r.kind, "all", int(r.n), f1(r.mape_pct), f1(r.median_ape_pct),
                                     f1(r.p90_ape_pct), f"{r.signed_pct:+.1f}"] for r in pooled.itertuples()])
            + "\n\n## Tables read\n\n" + markdown_table(["tables", "SKU", "decode kernel", "prefill kernel"], tables)
            + "\n\n## GEMM shapes matched (rows: shape x M)\n\n"
            + markdown_table(["system", "predictor", "match", "rows"], [list(r)[:4] for r in match.itertuples(index=False)])
            + "\n\nInterpolation along N or K, checked by predicting every interior grid point from its two "
            "neighbours (leave one out):\n\n"
            + markdown_table(["system", "direction", "subset", "n", "MAPE %", "median %", "p90 %"], interp)
            + "\n\n## Composed decode steps\n\n" + _steps_markdown(score.steps)
            + "\n\n## By regime\n\n" + markdown_table(head, body) + "\n")


def _steps_markdown(steps: pd.DataFrame) -> str:
    from common.mdtable import markdown_table

    if not len(steps):
        return "No decode step could be composed from these tables."
    g = steps.groupby(["system", "step", "predictor"], sort=False)
    rows = [[system, step, pred, int(len(s)), ", ".join(sorted(s["model"].unique())), f"{s['ape_pct'].mean():.1f}",
             f"{s['ape_pct'].quantile(0.9):.1f}", f"{s['signed_pct'].mean():+.1f}", f"{(s['ape_pct'] <= 10).mean() * 100:.0f}"]
            for (system, step, pred), s in g]
    return ("Each step: per layer the four projection GEMMs (M = batch) and the decode attention kernel from the "
            "tables, times the layers; predicted: the step model's price of the same kernels (op time + one graph-"
            "node interval each). Elementwise kernels, the KV write and the LM head are left out of both sides "
            "(the tables do not measure the first two; the vocabulary lies beyond their N grid). Batch 1-256, "
            "context 512-32K; models whose heads or shapes a table lacks are skipped. `aiconfigurator` is that "
            "tool's own step estimate of the same kernels from the same tables (its SILICON mode: table lookup, "
            "in-sample by construction); `aiconfigurator SOL` its estimate from datasheet figures alone (no table "
            "read: the counterpart of `default`); neither models Mistral. Its whole step (norms, activation, "
            "LM head added) is `aic_step_s` in steps.csv. A `mixed` step adds one prefill chunk (`chunk` new tokens, "
            "no prefix) to batch 1 or 256 decodes: GEMMs at M = batch + chunk and the chunk's own prefill kernel.\n\n"
            + markdown_table(["system", "step", "predictor", "steps", "models", "MAPE %", "p90 %", "signed %",
                              "% of steps within 10 %"], rows))


def plot_system(rows: pd.DataFrame, system: str, path: Path) -> Path:
    """Predicted vs measured, one panel per kind, one colour per predictor, on log axes in microseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from common.outdir import write_bytes_atomic

    sub = rows[rows["system"] == system]
    fig, axes = plt.subplots(1, len(KINDS), figsize=(14, 4.4), dpi=100)
    # fixed margins, not tight_layout: its measuring of every log tick label cost ~2 s a figure, and the
    # labels here are short numbers
    fig.subplots_adjust(left=0.055, right=0.99, bottom=0.12, top=0.92, wspace=0.2)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, kind in zip(axes, KINDS):
        part = sub[sub["kind"] == kind]
        for name, g in part.groupby("predictor", sort=False):
            ape = g["ape_pct"].mean()
            # markers on a line artist: drawn as one path, several times faster than a scatter collection
            ax.plot(g["measured_s"] * 1e6, g["predicted_s"] * 1e6, ".", ms=3.5, alpha=0.5, label=f"{name} (MAPE {ape:.0f} %)")
        if len(part):
            both = part[["measured_s", "predicted_s"]].to_numpy() * 1e6
            lo, hi = float(np.min(both)) * 0.8, float(np.max(both)) * 1.25
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_formatter(plain)
            ax.legend(fontsize=7, loc="upper left")
        ax.set_title(f"{system}: {kind.replace('_', ' ')}", fontsize=10)
        ax.set_xlabel("measured (us)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("predicted (us)")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return write_bytes_atomic(path, buf.getvalue())


STAGE = ".silicon-partial"


def write(score: SiliconScore, out: str, command: str, *, wheel: str) -> tuple[str, pd.DataFrame, list[Path]]:
    """silicon.csv.gz (every row: ~30 MB of CSV for nine GPUs, gzipped; pandas reads it as is), summary.csv,
    interpolation.csv, steps.csv, silicon.md, <system>.png and COMMAND.

    Written into a hidden staging folder first and moved into place at the end, COMMAND last, so an
    interrupted write leaves the previous result (or nothing) rather than half of a new one; a
    rerun's plots replace the earlier run's, and plots of GPUs this run did not score are removed."""
    import gzip
    import shutil

    from common.outdir import locked, write_bytes_atomic, write_command, write_text_atomic

    summary = summaries(score.rows)
    text = markdown(score, summary, command, wheel=wheel)
    with locked(out) as d:
        stage = d / STAGE
        shutil.rmtree(stage, ignore_errors=True)  # what an interrupted run left
        rows_csv = score.rows.to_csv(index=False, float_format="%.6g").encode()
        staged = [write_bytes_atomic(stage / "silicon.csv.gz", gzip.compress(rows_csv, mtime=0)),  # same bytes on a rerun
                  write_text_atomic(stage / "summary.csv", summary.to_csv(index=False, float_format="%.4g")),
                  write_text_atomic(stage / "interpolation.csv",
                                    score.interpolation.to_csv(index=False, float_format="%.4g")),
                  write_text_atomic(stage / "steps.csv", score.steps.to_csv(index=False, float_format="%.6g")),
                  write_text_atomic(stage / "silicon.md", text)]
        staged += [plot_system(score.rows, system, stage / f"{system}.png") for system in score.rows["system"].unique()]
        for old in d.glob("*.png"):  # plots of an earlier run into this folder
            if not (stage / old.name).exists():
                old.unlink()
        files = []
        for f in staged:
            files.append(d / f.name)
            f.replace(d / f.name)
        files.append(write_command(d, command))
        shutil.rmtree(stage, ignore_errors=True)
    return text, summary, files
