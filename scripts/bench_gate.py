#!/usr/bin/env python3
"""Compare a saved pytest-benchmark run with committed baselines; exit 1 past a threshold.

    python scripts/bench_gate.py --baseline results/predictor/bench.json --current run.json --fail mean:10%

Benchmarks are matched by their full name (``benchmarks/test_x.py::test_y[param]``); each
``--fail`` takes pytest-benchmark's ``--benchmark-compare-fail`` syntax (``mean:10%``, ``min:5%``,
``median:0.001`` seconds) and is checked with pytest-benchmark's own regression check, so a pair of
saved JSON files is judged exactly as ``pytest --benchmark-compare-fail`` judges a live run, without
timing anything. Exit 0: no regression; 1: a regression (each printed); 2: bad input (one line).
Several baselines may hold the same benchmark (one per machine kind): the one timed on the
current run's machine (CPU model, core count, Python) is used, else the one given last, and a
warning on stderr says when a benchmark's baseline comes from another machine: the ratios then
compare machines, not commits.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class InputError(Exception):
    """Bad input: printed as one line, exit 2."""


def load_run(path: str) -> tuple[dict, dict[str, dict]]:
    """``(machine_info, {fullname: stats})`` of a pytest-benchmark JSON file."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not JSON ({err})") from None
    benches = doc.get("benchmarks") if isinstance(doc, dict) else None
    if not isinstance(benches, list) or not all(isinstance(b, dict) and "fullname" in b and isinstance(b.get("stats"), dict)
                                                 for b in benches):
        raise InputError(f"{path}: not a pytest-benchmark JSON file (no 'benchmarks' list with fullname and stats)")
    return doc.get("machine_info") or {}, {b["fullname"]: b["stats"] for b in benches}


def machine(info: dict) -> str:
    cpu = info.get("cpu") or {}
    return (f"{cpu.get('brand_raw', '?')} x{cpu.get('count', '?')}, "
            f"{info.get('python_implementation', '?')} {info.get('python_version', '?')}")


def parse_checks(specs: list[str]):
    try:
        from pytest_benchmark.utils import parse_compare_fail
    except ImportError:
        raise InputError("needs pytest-benchmark (a dev extra: pip install -e '.[dev]')") from None

    checks = []
    for spec in specs:
        try:
            checks.append(parse_compare_fail(spec))
        except argparse.ArgumentTypeError:
            raise InputError(f"--fail {spec!r}: expected FIELD:PCT% or FIELD:SECONDS with FIELD one of "
                             f"min, max, mean, median, stddev, iqr (e.g. mean:10%)") from None
    return checks


def pick_baselines(candidates: dict[str, dict[str, dict]], current_machine: str) -> tuple[dict[str, dict], dict[str, str]]:
    """Per benchmark, the baseline timed on the current run's machine when there is one, else the
    one given last: ``({name: stats}, {name: machine})``. A timing is a fact about its machine, so a
    same-machine baseline is the only one whose ratio compares commits."""
    baseline, baseline_machine = {}, {}
    for name, by_machine in candidates.items():
        chosen = current_machine if current_machine in by_machine else list(by_machine)[-1]
        baseline[name], baseline_machine[name] = by_machine[chosen], chosen
    return baseline, baseline_machine


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    p = OneLineParser(prog="bench_gate", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", action="append", required=True, metavar="JSON",
                   help="committed pytest-benchmark JSON (repeatable: one per benchmark file)")
    p.add_argument("--current", required=True, metavar="JSON", help="the run to judge (pytest --benchmark-json=...)")
    p.add_argument("--fail", action="append", metavar="FIELD:THRESHOLD",
                   help="regression check in --benchmark-compare-fail syntax (repeatable; default mean:10%%)")
    args = p.parse_args(argv)
    try:
        checks = parse_checks(args.fail or ["mean:10%"])
        # every baseline of each benchmark, by machine: the baselines may come from different machines
        candidates: dict[str, dict[str, dict]] = {}
        for path in args.baseline:
            info, stats = load_run(path)
            for name, stat in stats.items():
                candidates.setdefault(name, {})[machine(info)] = stat
        current_info, current = load_run(args.current)
    except InputError as err:
        print(f"bench_gate: error: {err}", file=sys.stderr)
        return 2
    baseline, baseline_machine = pick_baselines(candidates, machine(current_info))
    matched = [name for name in current if name in baseline]
    if not matched:
        print(f"bench_gate: error: no benchmark of {args.current} is in the baseline (names differ)", file=sys.stderr)
        return 2
    elsewhere = [name for name in matched if baseline_machine[name] != machine(current_info)]
    if elsewhere:
        machines = sorted({baseline_machine[name] for name in elsewhere})
        print(f"bench_gate: warning: the baseline was timed on {' / '.join(machines)} for {len(elsewhere)} of "
              f"{len(matched)} benchmark(s), this run on {machine(current_info)}: their ratios compare machines, "
              f"not only commits", file=sys.stderr)
    regressions = []
    width = max(len(name) for name in matched)
    print(f"{'benchmark':<{width}} {'baseline mean':>14} {'current mean':>14} {'change':>8}")
    for name in matched:
        old, new = baseline[name], current[name]
        change = (new["mean"] / old["mean"] - 1) * 100 if old.get("mean") else float("inf")
        fails = [msg for check in checks if (msg := check.fails(new, old))]
        print(f"{name:<{width}} {old['mean']:>12.6g} s {new['mean']:>12.6g} s {change:>+7.1f}%{'  REGRESSION' if fails else ''}")
        regressions += [f"{name}: {msg}" for msg in fails]
    only_new = sorted(set(current) - set(baseline))
    if only_new:
        print(f"not in the baseline (not judged): {', '.join(only_new)}")
    if regressions:
        print(f"{len(regressions)} regression(s) against the baseline:", file=sys.stderr)
        for line in regressions:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"{len(matched)} benchmark(s) within {', '.join(args.fail or ['mean:10%'])} of the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
