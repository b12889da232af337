"""``gpubench compare-replay``: two replays of the same jobs side by side, with the reference's
other takes and the scored replay's other runs (:mod:`scheduling.experiments.compare`)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from common.clihelp import DefaultsHelpFormatter


def register(sub) -> None:
    c = sub.add_parser(
        "compare-replay", help="two replays of the same jobs side by side (e.g. the simulator vs live vLLM)",
        description="Match the turns of two replay directories on (job, turn) and print per-turn TTFT, TPOT, "
                    "JCT, prefix-hit tokens, preemptions and KV usage side by side, with the relative error of "
                    "the first against the second (the reference, e.g. `replay --engine vllm`).",
        formatter_class=DefaultsHelpFormatter)
    c.add_argument("replay", metavar="REPLAY", help="replay directory to score (e.g. the simulator's)")
    c.add_argument("reference", metavar="REFERENCE", help="reference replay directory (e.g. live vLLM)")
    c.add_argument("--repeat", metavar="TAKE", action="append", default=[],
                   help="another take of REFERENCE (same engine, settings and jobs; repeatable): every metric "
                        "gets the range and mean over the takes, REPLAY's error against that mean and whether it "
                        "lies within the range, and each take is scored against REFERENCE as REPLAY is (a live "
                        "engine does not repeat its step times, and under eviction pressure not its hits either)")
    c.add_argument("--run", metavar="RUN", action="append", default=[], dest="runs",
                   help="another run of REPLAY, the same settings but --jitter-seed (repeatable): every metric gets "
                        "the runs' mean and range and that mean's error against the takes' mean (with --repeat) or "
                        "REFERENCE; under a router that reads timing one simulated path is one of many, as a take is")
    c.add_argument("--out", default=None, help="also write comparison.json/.md, joined turns.csv/jobs.csv and a plot here")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    c.set_defaults(func=cmd_compare_replay)


def cmd_compare_replay(args: argparse.Namespace) -> int:
    from scheduling.experiments import compare

    _check_out(args)
    scored, reference = compare.load_replay(args.replay), compare.load_replay(args.reference)
    repeats = [compare.load_replay(r) for r in args.repeat]
    runs = [compare.load_replay(r) for r in args.runs]
    _check_commands(scored, reference, repeats, runs)
    result = compare.with_repeats(compare.compare(scored, reference), reference, repeats, scored)
    result = compare.with_runs(result, scored, reference, runs)
    if args.out:
        command = "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
        compare.write(result, args.out, command=command)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k not in compare.FRAMES}, indent=2))
    else:
        print(f"{result['a']['label']} ({args.replay}) vs {result['b']['label']} ({args.reference})")
        print(compare.to_markdown(result), end="")
        if args.out:
            print(f"wrote {args.out}/comparison.md, comparison.json, turns.csv, jobs.csv, comparison.png")
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """Two replays, not one twice; and ``--out`` gets joined tables named as a replay's own: it must not
    be one of the inputs."""
    from pathlib import Path

    from common.errors import ConfigError

    if Path(args.replay).resolve() == Path(args.reference).resolve():
        raise ConfigError(f"REPLAY and REFERENCE are both {args.reference}: a replay compared with itself has no error to show")
    if not args.out:
        return
    out = Path(args.out).resolve()
    for flag, path in (("REPLAY", args.replay), ("REFERENCE", args.reference), *(("--repeat", r) for r in args.repeat),
                       *(("--run", r) for r in args.runs)):
        if Path(path).resolve() == out:
            raise ConfigError(f"--out {args.out} is the {flag} directory: the comparison's turns.csv and jobs.csv "
                              "would overwrite the replay's own; give another --out")


# What fixes the jobs and their arrivals: two replays compared turn by turn must agree on these.
_WORKLOAD = ("trace", "num_jobs", "preset", "jps", "seed")
# What only shapes the output or draws another path of the same settings.
_NOT_SETTINGS = {"jitter_seed", "out", "trace_out", "no_progress", "json", "no_step_log"}


def _recorded_args(replay) -> dict | None:
    """The ``gpubench replay`` options a replay recorded, parsed (None for an older replay without them)."""
    from common.errors import ConfigError
    from scheduling.slo.check_replays import parse_replay_command, replay_args

    command = replay.summary.get("command")
    try:
        return vars(parse_replay_command(replay_args(command, replay.path))) if command else None
    except ConfigError:
        return None


def _check_commands(scored, reference, repeats: list, runs: list) -> None:
    """From the commands the replays recorded (summary.json's ``command``): REPLAY and REFERENCE replay
    the same jobs at the same arrival rate; a --repeat is REFERENCE's command again and a --run
    REPLAY's, but for --jitter-seed and the output. (summary.json's ``config`` holds the engine's
    settings, not the workload's, so this is where a --run at another --jps is caught.)"""
    from common.errors import ConfigError

    a, b = _recorded_args(scored), _recorded_args(reference)
    if a and b:
        for k in _WORKLOAD:
            if a.get(k) != b.get(k):
                raise ConfigError(f"{scored.path} and {reference.path} replay different jobs: {k} is {a.get(k)!r} "
                                  f"and {b.get(k)!r}; compare-replay matches the turns of one workload")
    for base, others, where, what in ((b, repeats, reference.path, "--repeat {} is not a take of the reference's settings"),
                                      (a, runs, scored.path, "--run {} is not a run of the scored replay's settings "
                                                             "(only --jitter-seed may differ)")):
        if not base:
            continue
        for other in others:
            got = _recorded_args(other)
            if got is None:
                continue
            differ = sorted(k for k in set(base) | set(got) if k not in _NOT_SETTINGS and base.get(k) != got.get(k))
            if differ:
                k = differ[0]
                raise ConfigError(f"{what.format(other.path)}: {k} is {got.get(k)!r} there and {base.get(k)!r} in {where}")
