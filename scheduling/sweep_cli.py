"""``gpubench sweep``: policies × SKUs × JPS × seeds of replays, a tidy CSV and plots."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from common import argtypes
from common.clihelp import DefaultsHelpFormatter, add_deprecated_flag
from scheduling.experiments.sweep_defaults import (
    DEFAULT_JPS,
    DEFAULT_MODEL,
    DEFAULT_NUM_JOBS,
    DEFAULT_POLICIES,
    DEFAULT_SEEDS,
    DEFAULT_SKUS,
)


def _csv_list(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {kind.__name__}: {text!r}") from None
    return parse


def _flat(values, default):
    if not values:
        return tuple(default)
    return tuple(v for group in values for v in group)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``sweep`` sub-command."""
    p = sub.add_parser(
        "sweep", help="replay a grid of policies x SKUs x arrival rates x seeds; tidy CSV + plots",
        description="Run `gpubench replay` over policies x SKUs x JPS x seeds on a local process pool "
                    "(or Ray), appending one row per run to OUT/sweep.csv and drawing OUT/*.png. "
                    "Finished cells are skipped, so an interrupted sweep resumes where it stopped. "
                    "Lists take commas or spaces: --jps 0.1,0.2 or --jps 0.1 0.2.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--policies", nargs="+", type=_csv_list(str), default=None, metavar="P",
                   help=f"policies; NAME@KEY=VALUE[+KEY=VALUE] is a variant with its own parameters, "
                        f"named so in the table (default: {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--skus", nargs="+", type=_csv_list(str), default=None, metavar="SKU",
                   help=f"SKUs (default: {','.join(DEFAULT_SKUS)})")
    p.add_argument("--jps", nargs="+", type=_csv_list(float), default=None, metavar="X",
                   help=f"arrival rates in jobs/s (default: {','.join(map(str, DEFAULT_JPS))})")
    p.add_argument("--seeds", nargs="+", type=_csv_list(argtypes.seed), default=None, metavar="K",
                   help=f"seeds (default: {','.join(map(str, DEFAULT_SEEDS))})")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or config.json path")
    p.add_argument("--jobs", type=int, default=DEFAULT_NUM_JOBS, dest="num_jobs", help="jobs per run")
    p.add_argument("--trace", default=None, help="trace file (JSONL or SWE-smith); default: synthetic agents")
    p.add_argument("--set", action="append", default=[], metavar="[POLICY.]KEY=VALUE", dest="assignments",
                   help="a policy parameter (continuum.ttl_s=5) or a replay setting (max_num_seqs=128); repeatable")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, default=None, help="local worker processes (default: usable CPUs)")
    where.add_argument("--ray", metavar="ADDRESS", default=None,
                       help="run on Ray: 'local' starts one here, else a cluster address (needs the ray extra)")
    p.add_argument("--out", type=Path, required=True, help="output directory (resumed if it exists)")
    p.add_argument("--fresh", action="store_true",
                   help="discard OUT's table first and run every cell (regenerate instead of resuming)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print the table as JSON records, not a summary table")
    p.add_argument("--plots-only", action="store_true",
                   help="only redraw OUT's plots and tables.md from its sweep.csv (runs nothing)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_deprecated_flag(p, "--quiet", "--no-progress", dest="no_progress")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the spec from the options, run the missing cells, print a small table."""
    from common.errors import ConfigError
    from scheduling.experiments.sweep import SweepSpec, parse_assignments, run_sweep, split_policy_label

    if args.plots_only:
        from scheduling.experiments.sweep_report import write_plots
        from scheduling.experiments.sweep_table import load_table

        frame = load_table(args.out)
        if frame.empty:
            raise ConfigError(f"{args.out / 'sweep.csv'}: no runs to plot")
        for path in write_plots(frame, args.out):
            print(f"wrote {path}")
        return 0
    policies = _flat(args.policies, DEFAULT_POLICIES)
    names = tuple(policies) + tuple(split_policy_label(p)[0] for p in policies)
    policy_params, replay_params = parse_assignments(args.assignments, names)
    spec = SweepSpec(policies=policies, skus=_flat(args.skus, DEFAULT_SKUS), jps=_flat(args.jps, DEFAULT_JPS),
                     seeds=_flat(args.seeds, DEFAULT_SEEDS), model=args.model, num_jobs=args.num_jobs,
                     trace=args.trace, policy_params=policy_params, replay_params=replay_params)
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    command = "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["sweep"] else \
        "gpubench sweep " + " ".join(shlex.quote(a) for a in _reconstruct(args))
    frame = run_sweep(spec, args.out, workers=args.workers, ray_address=args.ray, command=command,
                      progress=not args.no_progress, plots=not args.no_plots, fresh=args.fresh)
    if args.json:
        print(frame.to_json(orient="records"))
    else:
        _print_table(frame)
        print(f"wrote {args.out / 'sweep.csv'} ({len(frame)} runs)")
    from scheduling.experiments.sweep_report import pool_note

    note = pool_note(frame)
    if note:  # on stderr: --json's stdout stays JSON
        print(note, file=sys.stderr)
    return 0


def _reconstruct(args: argparse.Namespace) -> list[str]:
    """The options as a command line (when called through main(argv) rather than the console script)."""
    out = []
    for flag, val in (("--policies", args.policies), ("--skus", args.skus), ("--jps", args.jps), ("--seeds", args.seeds)):
        if val:
            out += [flag, ",".join(str(v) for v in _flat(val, ()))]
    out += ["--model", args.model, "--jobs", str(args.num_jobs)]
    if args.trace:
        out += ["--trace", args.trace]
    for a in args.assignments:
        out += ["--set", a]
    if args.ray:
        out += ["--ray", args.ray]
    elif args.workers:
        out += ["--workers", str(args.workers)]
    if args.fresh:
        out += ["--fresh"]
    return out + ["--out", str(args.out)]


def _print_table(frame) -> None:
    """JCT mean per SKU × policy at each JPS (seed mean), as a rich table."""
    from scheduling.experiments.sweep_report import metric_column

    col = metric_column(frame, "jct_mean")
    if col is None or frame.empty:
        return
    from rich.console import Console
    from rich.table import Table

    ok = frame[frame["error"] == ""] if "error" in frame.columns else frame
    pivot = ok.groupby(["sku", "policy", "jps"])[col].mean().unstack("jps")
    table = Table(title=f"{col} (mean over seeds)")
    table.add_column("sku")
    table.add_column("policy")
    for j in pivot.columns:
        table.add_column(f"{j:g} jps", justify="right")
    for (sku, policy), row in pivot.iterrows():
        table.add_row(sku, policy, *(f"{v:.1f}" if v == v else "-" for v in row))
    Console().print(table)
    errors = frame[frame.get("error", "") != ""] if "error" in frame.columns else frame.iloc[0:0]
    if len(errors):
        Console(stderr=True).print(f"[yellow]{len(errors)} run(s) failed; see the 'error' column[/]")
