"""``gpubench slo check``: the analytical model beside a sweep's replays, cell by cell.

For each cell of one policy in a sweep directory the same jobs (the sweep's model, job count, trace
and seed, arrivals at the cell's rate) are priced by the model on the cell's SKU, with the sweep's
SLO (its ``slo_ttft_s``/``slo_tpot_s`` columns; no tool-turn or job deadline, which a sweep does not
score), and put beside the replay: turn attainment, TTFT p50/p90, TPOT p50, mean JCT. The model
prices fcfs (vLLM's default): a policy that pins or offloads changes what it assumes of LRU.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pandas as pd

from common.errors import ConfigError

COMPARED = (("attainment", "slo_turn_share", "turn"), ("ttft_p50_s", "ttft_p50_s", None), ("ttft_p90_s", "ttft_p90_s", None),
            ("tpot_p50_s", "tpot_p50_s", None), ("jct_mean_s", "jct_mean_s", None))


def read_sweep(sweep_dir: str | Path, policy: str) -> tuple[pd.DataFrame, dict]:
    d = Path(sweep_dir)
    if not (d / "sweep.csv").is_file() or not (d / "spec.json").is_file():
        raise ConfigError(f"--sweep {d}: not a sweep directory (needs sweep.csv and spec.json)")
    table = pd.read_csv(d / "sweep.csv")
    spec = json.loads((d / "spec.json").read_text())
    rows = table[(table["policy"] == policy) & table["slo_turn_share"].notna()]
    if not len(rows):
        raise ConfigError(f"--sweep {d}: no finished cell of policy '{policy}' (has: {', '.join(sorted(set(table['policy'])))})")
    if spec.get("replay_params"):
        raise ConfigError(f"--sweep {d}: its cells set engine settings ({', '.join(spec['replay_params'])}) the model "
                          "does not take; check a sweep with the defaults")
    return rows, spec


def run_check(sweep_dir, policy: str, out: str, *, argv: list | None = None, progress=None) -> pd.DataFrame:
    """check.csv, check.md, attainment_vs_jps.png and COMMAND in ``out``; the rows returned."""
    from scheduling.experiments.sweep import SweepSpec, cell_jobs
    from scheduling.slo.model import engine_limits_and_cost, predict
    from scheduling.slo.spec import SLOSpec

    rows, spec_doc = read_sweep(sweep_dir, policy)
    spec = SweepSpec(model=spec_doc["model"], num_jobs=spec_doc["num_jobs"], trace=spec_doc.get("trace"))
    engines: dict[str, tuple] = {}
    out_rows = []
    for r in rows.sort_values(["sku", "jps", "seed"]).itertuples():
        if r.sku not in engines:
            engines[r.sku] = engine_limits_and_cost(r.sku, spec.model)
        lim, cost = engines[r.sku]
        slo = SLOSpec(ttft_s=float(r.slo_ttft_s), tpot_s=float(r.slo_tpot_s), tool_turn_s=None, job_s=None)
        pred = predict(cell_jobs(spec, float(r.jps), int(r.seed)), lim, cost, slo)
        got = {**pred.attainment, **pred.percentiles}
        row = {"sku": r.sku, "jps": float(r.jps), "seed": int(r.seed)}
        for name, sim_col, model_key in COMPARED:
            row[f"{name}_replay"] = float(getattr(r, sim_col))
            row[f"{name}_model"] = float(got[model_key or name])
        out_rows.append(row)
        if progress:
            progress(f"{r.sku} {r.jps:g} jobs/s seed {r.seed}: replay {row['attainment_replay']:.1%}, model {row['attainment_model']:.1%}")
    df = pd.DataFrame(out_rows)
    df["attainment_error_pp"] = (df["attainment_model"] - df["attainment_replay"]) * 100
    write(df, out, sweep_dir, policy, argv)
    return df


def write(df: pd.DataFrame, out: str, sweep_dir, policy: str, argv) -> None:
    from common.outdir import locked, write_command, write_text_atomic

    with locked(out) as d:
        write_text_atomic(d / "check.csv", df.to_csv(index=False, float_format="%.6g"))
        write_text_atomic(d / "check.md", markdown(df, sweep_dir, policy))
        _plot(df, d / "attainment_vs_jps.png")
        write_command(d, "gpubench " + " ".join(shlex.quote(a) for a in argv) if argv else
                      f"gpubench slo check --sweep {sweep_dir} --policy {policy} --out {out}")


def markdown(df: pd.DataFrame, sweep_dir, policy: str) -> str:
    from common.mdtable import markdown_table

    err = df["attainment_error_pp"].abs()
    within = (err <= 3).mean()
    head = ["SKU", "jobs/s", "seed", "attainment replay", "model", "error (pp)", "TTFT p50 replay / model (s)",
            "TTFT p90 replay / model (s)", "TPOT p50 replay / model (s)", "mean JCT replay / model (s)"]
    body = [[r.sku, f"{r.jps:g}", r.seed, f"{r.attainment_replay:.1%}", f"{r.attainment_model:.1%}",
             f"{r.attainment_error_pp:+.1f}", f"{r.ttft_p50_s_replay:.3g} / {r.ttft_p50_s_model:.3g}",
             f"{r.ttft_p90_s_replay:.3g} / {r.ttft_p90_s_model:.3g}", f"{r.tpot_p50_s_replay:.3g} / {r.tpot_p50_s_model:.3g}",
             f"{r.jct_mean_s_replay:.0f} / {r.jct_mean_s_model:.0f}"] for r in df.itertuples()]
    return (f"# The SLO model against the replays of {sweep_dir} ({policy})\n\n"
            f"{len(df)} cells. Turn attainment of the sweep's SLO: mean absolute error {err.mean():.2f} pp, "
            f"median {err.median():.2f}, max {err.max():.1f} pp; {within:.0%} of cells within 3 pp.\n\n"
            + markdown_table(head, body) + "\n")


def _plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skus = list(dict.fromkeys(df["sku"]))
    fig, ax = plt.subplots(figsize=(9.5, 4.8), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, sku in enumerate(skus):
        g = df[df["sku"] == sku].groupby("jps").mean(numeric_only=True).reset_index()
        c = colors[i % len(colors)]
        ax.plot(g["jps"], g["attainment_model"] * 100, "-", color=c, label=f"{sku} model")
        ax.plot(g["jps"], g["attainment_replay"] * 100, "o", color=c, label=f"{sku} replay")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no point hidden
    save_attainment_plot(fig, ax, path, "SLO attainment: replays (points) and the analytical model (lines)", title_size=10)


def save_attainment_plot(fig, ax, path: Path, title: str, title_size: int = 9) -> None:
    """The attainment-vs-rate axes (log rate, percent) titled and written atomically as PNG."""
    import io

    import matplotlib
    import matplotlib.pyplot as plt

    from common.outdir import write_bytes_atomic

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("job arrivals per second")
    ax.set_ylabel("turns meeting the SLO (%)")
    ax.set_ylim(-3, 103)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=title_size)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


__all__ = ["run_check", "read_sweep", "markdown", "save_attainment_plot"]
