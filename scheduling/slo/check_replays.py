"""``gpubench slo check --replays``: the analytical model beside replay directories, takes grouped.

Each directory is a ``gpubench replay`` output, the simulator's or live vLLM's (``--engine vllm``).
Directories whose recorded commands differ only in ``--out`` are takes of one setting (a real engine
does not repeat itself): the model is put beside their mean, min and max. For each setting the jobs
are rebuilt from the recorded command (the same synthetic jobs or trace, seed and arrival rate), the
engine's limits are the ones the replay ran with (vLLM's reported block size, pool, token budget and
max_num_seqs for a live run), and the step cost is the predictor's for ``--sku`` and
``--calibration`` (a live replay records neither: the engine ran on this host). The replays are
scored again from their ``turns.csv``/``jobs.csv`` against one SLO (``--slo``, default the one the
first take recorded), so old takes and new ones are scored alike.

The model is also evaluated over a range of rates around the replayed ones (same jobs, other
arrival rates) for the plot's curve: the points are the replays, the line the model.
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import ConfigError
from scheduling.slo.spec import SLOSpec

KINDS = ("turn", "job", "ttft", "tpot", "tool_turn")
CURVE_POINTS = 17


@dataclass
class Setting:
    """One replayed setting: its command without ``--out`` and its takes."""

    command: list[str]
    takes: list  # scheduling.experiments.compare.Replay

    @property
    def live(self) -> bool:
        return self.takes[0].summary.get("config", {}).get("engine") == "vllm"


def replay_args(command: str | None, where: Path) -> list[str]:
    """A recorded ``gpubench replay`` command's options, less those that only shape the output."""
    words = shlex.split(command or "")
    if len(words) < 2 or words[0] != "gpubench" or words[1] != "replay":
        raise ConfigError(f"--replays {where}: its summary.json records no `gpubench replay` command "
                          "(the model rebuilds the jobs from it)")
    out, i = [], 2
    while i < len(words):  # drop --out and what only shapes the output
        w = words[i]
        if w in ("--out", "--trace-out"):
            i += 2
            continue
        if w.startswith(("--out=", "--trace-out=")) or w in ("--no-progress", "--quiet", "--json", "--no-step-log"):
            i += 1
            continue
        out.append(w)
        i += 1
    return out


def group_takes(dirs: list[str]) -> list[Setting]:
    from scheduling.experiments.compare import load_replay

    groups: dict[tuple, Setting] = {}
    seen: set[Path] = set()
    for d in dirs:
        where = Path(d).resolve()
        if where in seen:  # one take counted twice would narrow the range and weigh the mean
            raise ConfigError(f"--replays {d}: given twice")
        seen.add(where)
        r = load_replay(d)
        policy = r.summary.get("config", {}).get("policy", "fcfs")
        if policy != "fcfs":
            raise ConfigError(f"--replays {d}: a replay under {policy}; the model prices fcfs (vLLM's default)")
        key = tuple(replay_args(r.summary.get("command"), r.path))
        groups.setdefault(key, Setting(list(key), [])).takes.append(r)
    return list(groups.values())


def parse_replay_command(words: list[str]) -> argparse.Namespace:
    """The ``gpubench replay`` arguments of a recorded command (with a placeholder ``--out``)."""
    from scheduling import cli

    class Quiet(argparse.ArgumentParser):
        def error(self, message):  # a recorded command this build no longer reads: one line
            raise ConfigError(f"a replay's recorded command no longer parses: {message}")

    parser = Quiet(prog="gpubench")
    cli.register(parser.add_subparsers(dest="command", parser_class=Quiet))
    return parser.parse_args(["replay", *words, "--out", "-"])


def limits_and_cost(take, sku: str | None, calibration: str | None, step_cost: str = "predictor"):
    """The engine limits the take ran with and the step cost: the predictor's (``sku``/``calibration``
    override the replay's own; a live take needs ``sku``), or with ``step_cost="take"`` the step times
    the take itself recorded (a diagnostic: fitted on what it is scored against, it separates the
    model's error from the predictor's)."""
    from scheduling.engine.step_cost import make_step_cost
    from scheduling.experiments.replay import ReplayConfig, engine_config
    from scheduling.slo.model import Limits, limits_of

    cfg = take.summary.get("config", {})
    if step_cost == "take":
        sku = sku or cfg.get("sku") or "cpu"  # the limits only: the cost is the take's own
    if cfg.get("engine") == "vllm":
        if not sku:
            raise ConfigError(f"--replays {take.path}: a live replay records no SKU; give --sku (cpu for this host's engine)")
        eng = take.summary["metrics"].get("engine") or {}
        block = int(eng.get("block_size") or cfg["block_size"])
        lim = Limits(int(eng.get("max_num_batched_tokens") or cfg["max_num_batched_tokens"]),
                     int(eng.get("max_num_seqs") or cfg["max_num_seqs"]),
                     int(cfg["num_gpu_blocks"]) * block, block)
        cost = make_step_cost("predictor" if step_cost != "take" else f"measured:{take.path}", sku=sku,
                              model=cfg["model"], calibration=calibration, cuda_graphs=False,
                              async_scheduling=bool(eng.get("async_scheduling", False)))
        return lim, cost
    fields = {k: v for k, v in cfg.items() if k != "engine"}
    fields.update({k: v for k, v in (("sku", sku), ("calibration", calibration)) if v})
    rc = ReplayConfig(**fields)
    e = engine_config(rc)
    cost = make_step_cost(rc.step_cost if step_cost != "take" else f"measured:{take.path}", sku=rc.sku, model=rc.model,
                          calibration=rc.calibration, cuda_graphs=rc.cuda_graphs, async_scheduling=rc.async_scheduling)
    return limits_of(e), cost


def _slo_of(settings: list[Setting], slo_text: str | None) -> SLOSpec:
    from scheduling.slo import parse_slo

    if slo_text:
        return parse_slo(slo_text)
    recorded = (settings[0].takes[0].summary.get("metrics", {}).get("slo_attainment") or {}).get("slo")
    return SLOSpec(**recorded) if recorded else parse_slo(None)


def run_check_replays(dirs: list[str], out: str, *, sku: str | None = None, calibration: str | None = None,
                      slo_text: str | None = None, step_cost: str = "predictor", argv: list | None = None,
                      progress=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """check.csv (one row per setting), curve.csv (the model over rates), check.md,
    attainment_vs_jps.png and COMMAND in ``out``; (rows, curve) returned."""
    from scheduling.cli import load_jobs
    from scheduling.slo.attainment import attainment
    from scheduling.slo.model import predict

    settings = group_takes(dirs)
    slo = _slo_of(settings, slo_text)
    rows, curve = [], []
    for s in settings:
        args = parse_replay_command(s.command)
        if args.jps is None:
            raise ConfigError(f"--replays {s.takes[0].path}: replayed without --jps; the model needs an arrival rate")
        lim, cost = limits_and_cost(s.takes[0], sku, calibration, step_cost)
        measured = [attainment(t.turns, t.jobs, slo) for t in s.takes]
        pred = predict(load_jobs(args), lim, cost, slo)
        row = {"engine": "vllm" if s.live else "sim", "jps": float(args.jps), "seed": int(args.seed),
               "jobs": measured[0]["jobs"], "takes": len(s.takes), "dirs": " ".join(str(t.path) for t in s.takes)}
        for k in KINDS:
            vals = np.array([m[k] for m in measured if m.get(k) is not None], float)
            row[f"{k}_model"] = pred.attainment.get(k)
            if len(vals):
                row.update({f"{k}_mean": vals.mean(), f"{k}_min": vals.min(), f"{k}_max": vals.max()})
        for metric in ("ttft_p50_s", "tpot_p50_s", "jct_mean_s"):
            row[f"{metric}_replay"] = float(np.mean([t.summary["metrics"][metric] for t in s.takes]))
            row[f"{metric}_model"] = float(pred.percentiles[metric])
        row["turn_error_pp"] = (row["turn_model"] - row["turn_mean"]) * 100
        row["turn_within_takes"] = bool(row["turn_min"] - 1e-9 <= row["turn_model"] <= row["turn_max"] + 1e-9)
        rows.append(row)
        if progress:
            progress(f"{row['engine']} {args.jps:g} jobs/s, {len(s.takes)} take(s): turns meeting the SLO "
                     f"{row['turn_mean']:.1%} (takes {row['turn_min']:.1%}-{row['turn_max']:.1%}), model {row['turn_model']:.1%}")
        for jps in np.geomspace(args.jps / 2, args.jps * 2, 5):
            p = predict(load_jobs(argparse.Namespace(**{**vars(args), "jps": float(jps)})), lim, cost, slo)
            curve.append({"engine": row["engine"], "seed": row["seed"], "jps": float(jps), "turn_model": p.attainment["turn"],
                          "job_model": p.attainment["job"]})
    df = pd.DataFrame(rows).sort_values(["engine", "seed", "jps"]).reset_index(drop=True)
    cv = pd.DataFrame(curve).drop_duplicates(["engine", "seed", "jps"]).sort_values(["engine", "seed", "jps"])
    _write(df, cv, out, slo, argv, dirs)
    return df, cv


def _write(df: pd.DataFrame, cv: pd.DataFrame, out: str, slo: SLOSpec, argv, dirs) -> None:
    from common.outdir import locked, write_command, write_text_atomic

    with locked(out) as d:
        write_text_atomic(d / "check.csv", df.to_csv(index=False, float_format="%.6g"))
        write_text_atomic(d / "curve.csv", cv.to_csv(index=False, float_format="%.6g"))
        write_text_atomic(d / "check.md", markdown(df, slo))
        _plot(df, cv, slo, d / "attainment_vs_jps.png")
        write_command(d, "gpubench " + " ".join(shlex.quote(a) for a in argv) if argv else
                      f"gpubench slo check --replays {' '.join(dirs)} --out {out}")


def markdown(df: pd.DataFrame, slo: SLOSpec) -> str:
    from common.mdtable import markdown_table

    err = df["turn_error_pp"].abs()
    head = ["engine", "jobs/s", "seed", "takes", "turns meeting the SLO: takes mean (min-max)", "model", "error (pp)",
            "jobs meeting it: takes / model", "TTFT p50 replay / model (s)", "TPOT p50 replay / model (s)",
            "mean JCT replay / model (s)"]
    body = [[r.engine, f"{r.jps:g}", r.seed, r.takes, f"{r.turn_mean:.1%} ({r.turn_min:.1%}-{r.turn_max:.1%})",
             f"{r.turn_model:.1%}", f"{r.turn_error_pp:+.1f}", f"{r.job_mean:.1%} / {r.job_model:.1%}",
             f"{r.ttft_p50_s_replay:.3g} / {r.ttft_p50_s_model:.3g}", f"{r.tpot_p50_s_replay:.3g} / {r.tpot_p50_s_model:.3g}",
             f"{r.jct_mean_s_replay:.0f} / {r.jct_mean_s_model:.0f}"] for r in df.itertuples()]
    return (f"# The SLO model against replays (SLO: {slo.describe()})\n\n"
            f"{len(df)} settings. Turn attainment: mean absolute error {err.mean():.2f} pp, max {err.max():.1f} pp; "
            f"{(err <= 5).sum()} of {len(df)} within 5 pp of the takes' mean, {int(df['turn_within_takes'].sum())} "
            f"inside the takes' range.\n\n" + markdown_table(head, body) + "\n")


def _plot(df: pd.DataFrame, cv: pd.DataFrame, slo: SLOSpec, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scheduling.slo.check import save_attainment_plot

    fig, ax = plt.subplots(figsize=(8.5, 4.6), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((engine, seed), g) in enumerate(df.groupby(["engine", "seed"])):
        c = colors[i % len(colors)]
        line = cv[(cv["engine"] == engine) & (cv["seed"] == seed)]
        ax.plot(line["jps"], line["turn_model"] * 100, "-", color=c, label=f"model (seed {seed})")
        yerr = np.vstack([(g["turn_mean"] - g["turn_min"]) * 100, (g["turn_max"] - g["turn_mean"]) * 100])
        ax.errorbar(g["jps"], g["turn_mean"] * 100, yerr=yerr, fmt="o", color=c, capsize=3,
                    label=f"{'live vLLM' if engine == 'vllm' else 'simulator'} (seed {seed}): takes' mean, min-max")
    ax.legend(fontsize=7, loc="lower left")
    save_attainment_plot(fig, ax, path, f"SLO attainment ({slo.describe()}): replays and the analytical model")


__all__ = ["run_check_replays", "group_takes", "parse_replay_command", "limits_and_cost", "markdown"]
