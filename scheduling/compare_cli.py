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

    scored, reference = compare.load_replay(args.replay), compare.load_replay(args.reference)
    repeats = [compare.load_replay(r) for r in args.repeat]
    runs = [compare.load_replay(r) for r in args.runs]
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
