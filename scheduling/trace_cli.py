"""``gpubench trace``: look at a workload before replaying it, and write SWE-smith-format files.

``gpubench trace stats``  statistics of a trace file or a synthetic preset, next to the public
                          SWE-smith targets the default agent is calibrated to (table, JSON, plot)
``gpubench trace swesmith`` write N trajectories in the SWE-smith layout (parquet or JSONL)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import argtypes
from common.clihelp import DefaultsHelpFormatter
from common.errors import ConfigError

# Rows of the statistics table: (trace_stats key, label, format).
STAT_ROWS = (
    ("num_jobs", "jobs", "{:.0f}"),
    ("turns_median", "turns per job, median", "{:.0f}"),
    ("job_prompt_tokens_median", "prompt tokens summed per job, median", "{:,.0f}"),
    ("job_output_tokens_median", "output tokens per job, median", "{:,.0f}"),
    ("job_input_to_output_median", "input : output per job, median", "{:.0f} : 1"),
    ("final_context_median", "final context per job, median", "{:,.0f}"),
    ("final_context_max", "final context per job, max", "{:,.0f}"),
    ("obs_tokens_median", "observation tokens, median", "{:.0f}"),
    ("out_tokens_median", "output tokens per turn, median", "{:.0f}"),
    ("tool_s_median", "tool call (s), median", "{:.2f}"),
    ("tool_s_mean", "tool call (s), mean", "{:.2f}"),
    ("tool_s_p99", "tool call (s), p99", "{:.1f}"),
    ("tool_time_share_ge_60s", "share of tool time in calls >= 60 s", "{:.0%}"),
    ("job_tool_s_mean", "tool time per job (s), mean", "{:.0f}"),
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``trace`` sub-command and its two actions."""
    p = sub.add_parser("trace", help="workload statistics vs the public SWE-smith targets; write SWE-smith-format files",
                       description="Inspect agent workloads and write SWE-smith-format trajectory files.",
                       formatter_class=DefaultsHelpFormatter)
    actions = p.add_subparsers(dest="trace_action", metavar="ACTION")
    s = actions.add_parser("stats", help="statistics of a trace or preset next to the SWE-smith targets",
                           description="Per-job and per-turn statistics of a trace file (our JSONL, or SWE-smith "
                                       "parquet/JSONL) or of a synthetic preset, next to the public SWE-smith "
                                       "statistics the default agent is calibrated to.",
                           formatter_class=DefaultsHelpFormatter)
    s.add_argument("trace", nargs="?", type=Path, default=None, help="a trace file (default: a synthetic preset)")
    s.add_argument("--preset", default="swe", choices=("swe", "swe-long", "scaled-cpu"), help="synthetic agent")
    s.add_argument("--jobs", type=int, default=1000, help="synthetic jobs to draw")
    s.add_argument("--seed", type=argtypes.seed, default=0, help="seed of the synthetic jobs (and of SWE-smith tool times)")
    s.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="draw the distributions, with the targets marked, into this PNG")
    s.add_argument("--json", action="store_true", help="print the statistics as JSON")
    s.set_defaults(func=cmd_stats)
    w = actions.add_parser("swesmith", help="write N synthetic trajectories in the SWE-smith layout",
                           description="Render N jobs of a synthetic preset as SWE-smith conversations (tool, ticks "
                                       "and xml layouts in turn; string and list-of-parts content); message "
                                       "lengths follow the preset, the text is filler. `gpubench replay --trace "
                                       "FILE` reads the result.",
                           formatter_class=DefaultsHelpFormatter)
    w.add_argument("--jobs", type=int, default=400, help="trajectories to write")
    w.add_argument("--seed", type=argtypes.seed, default=0, help="seed")
    w.add_argument("--preset", default="swe", choices=("swe", "swe-long", "scaled-cpu"), help="synthetic agent")
    w.add_argument("--out", type=Path, required=True, help="output file (.parquet, or .jsonl)")
    w.add_argument("--json", action="store_true", help="print what was written (file, jobs, bytes, preset, seed) as JSON")
    w.set_defaults(func=cmd_swesmith)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _check_jobs(num_jobs: int) -> None:
    if num_jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {num_jobs}")


def load_stats(args: argparse.Namespace) -> tuple[str, list]:
    from scheduling.workload import trace_files, trace_synth

    if args.trace is not None:
        return str(args.trace), trace_files.load_trace(args.trace, seed=args.seed)
    _check_jobs(args.jobs)
    return (f"synthetic {args.preset}, {args.jobs} jobs, seed {args.seed}",
            trace_synth.synthetic_jobs(args.jobs, args.seed, trace_synth.PRESETS[args.preset]()))


def stats_table(stats: dict, targets: dict) -> str:
    """Markdown table: statistic, this workload, the SWE-smith target range."""
    from common.mdtable import markdown_table

    rows = []
    for key, label, fmt in STAT_ROWS:
        target = targets.get(key)
        rows.append([label, fmt.format(stats[key]), "" if target is None else f"{fmt.format(target[0])} – {fmt.format(target[1])}"])
    return markdown_table(["statistic", "this workload", "public SWE-smith target"], rows)


def cmd_stats(args: argparse.Namespace) -> int:
    from scheduling.workload.trace_synth import SWE_SMITH_TARGETS, trace_stats

    label, jobs = load_stats(args)
    stats = trace_stats(jobs)
    if args.json:
        print(json.dumps({"workload": label, "stats": stats, "targets": SWE_SMITH_TARGETS}, indent=2))
    else:
        print(f"{label}\n")
        print(stats_table(stats, SWE_SMITH_TARGETS))
    if args.plot is not None:
        plot_stats(jobs, label, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def plot_stats(jobs, label: str, path: Path) -> Path:
    """Four panels: turns, summed prompt and output per job (histograms), tool-call CDF; the
    targets as vertical lines / shaded ranges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from common.plotaxes import plain_log_ticks
    from scheduling.workload.trace_synth import SWE_SMITH_TARGETS

    turns = np.array([j.num_turns for j in jobs])
    prompt = np.array([sum(j.prompt_tokens(k) for k in range(j.num_turns)) for j in jobs]) / 1e3
    output = np.array([sum(t.output_tokens for t in j.turns) for j in jobs]) / 1e3
    tools = np.sort([t.tool_s for j in jobs for t in j.turns if t.tool is not None])
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = ((axes[0], turns, "turns per job", "turns_median", 1.0),
              (axes[1], prompt, "prompt tokens summed per job (K)", "job_prompt_tokens_median", 1e3),
              (axes[2], output, "output tokens per job (K)", "job_output_tokens_median", 1e3))
    for ax, values, title, key, scale in panels:
        ax.hist(values, bins=40, color="#4c72b0", alpha=0.8)
        low, high = SWE_SMITH_TARGETS[key]
        ax.axvspan(low / scale, high / scale, color="#dd8452", alpha=0.3, label="SWE-smith median (target)")
        ax.axvline(float(np.median(values)), color="k", lw=1.2, label="this workload's median")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("jobs")
    axes[0].legend(fontsize=8)
    ax = axes[3]
    if len(tools):
        ax.plot(tools, np.arange(1, len(tools) + 1) / len(tools), color="#4c72b0")
        ax.set_xscale("log")
        plain_log_ticks(ax.xaxis)  # 1, 10, 100 s, not 10^0
    low, high = SWE_SMITH_TARGETS["tool_s_median"]
    ax.axvspan(low, high, color="#dd8452", alpha=0.3)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_title("tool-call duration CDF (s)", fontsize=10)
    ax.set_ylabel("share of calls")
    fig.suptitle(label, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_swesmith(args: argparse.Namespace) -> int:
    from scheduling.workload import swesmith_gen, trace_synth

    _check_jobs(args.jobs)
    if args.out.suffix not in (".parquet", ".jsonl"):
        raise ConfigError(f"--out must end in .parquet or .jsonl, got {args.out}")
    if args.out.exists() and args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a directory")
    rows = swesmith_gen.generate_trajectories(args.jobs, args.seed, trace_synth.PRESETS[args.preset]())
    swesmith_gen.write_trajectories(args.out, rows)
    size_bytes = args.out.stat().st_size
    if args.json:
        print(json.dumps({"out": str(args.out), "jobs": args.jobs, "bytes": size_bytes, "preset": args.preset,
                          "seed": args.seed}, indent=2))
    else:
        print(f"wrote {args.jobs} trajectories ({size_bytes / 1e6:.1f} MB) to {args.out}")
    return 0


__all__ = ["register", "stats_table", "plot_stats", "STAT_ROWS"]
