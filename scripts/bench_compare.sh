#!/usr/bin/env bash
# Compare benchmarks/ now with the committed baselines; exit 1 when a mean is more than PCT % slower.
#
# The baselines are the pytest-benchmark JSON files committed next to the figures they back
# (results/predictor/bench.json, results/scheduling/bench/bench.json,
# results/kvcomm/toolkit/toolkit_bench.json), plus one file per machine kind holding every benchmark
# (results/bench-baselines/*.json); BENCH_BASELINES overrides the list. A baseline is a timing of the
# machine it was taken on: each benchmark is judged against the baseline from this run's machine when
# one exists; otherwise the script warns, and the ratios then compare machines as much as commits.
#
# Usage:
#   scripts/bench_compare.sh [PCT]                 time the benchmark files the baselines cover (minutes),
#                                                  then compare (default PCT 10)
#   scripts/bench_compare.sh PCT CURRENT.json      compare a run saved earlier with
#                                                  `pytest benchmarks/... --benchmark-only --benchmark-json=CURRENT.json`
#                                                  (no timing run)
# BENCH_SELECT: a pytest -k expression that times only the benchmarks it selects (CI leaves out the
# kvcomm prefill benchmarks, which load SmolLM2 and take four of the run's five minutes).
# The check is pytest-benchmark's own --benchmark-compare-fail=mean:PCT% (scripts/bench_gate.py).
# Exit 0: within PCT; 1: a regression (or a benchmark that failed its own assertion); 2: bad input.
set -euo pipefail
cd "$(dirname "$0")/.."
# Started from a pytest-xdist worker (the test suite runs in parallel), pytest-benchmark would take
# itself for a worker too and disable every benchmark: these runs are never part of a pool.
unset PYTEST_XDIST_WORKER PYTEST_XDIST_WORKER_COUNT PYTEST_XDIST_TESTRUNUID
# The repository's virtual environment when there is one (pytest-benchmark is a dev extra), else python3.
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PY=$PYTHON
PCT=${1:-10}
CURRENT=${2:-}
if [ -n "${BENCH_BASELINES:-}" ]; then
  read -r -a BASELINES <<< "$BENCH_BASELINES"
else
  # The figures' own baselines, then one full baseline per machine kind (results/bench-baselines/):
  # bench_gate judges each benchmark against the one timed on this run's machine when there is one.
  shopt -s nullglob
  BASELINES=(results/predictor/bench.json results/scheduling/bench/bench.json results/kvcomm/toolkit/toolkit_bench.json
             results/bench-baselines/*.json)
  shopt -u nullglob
fi

if ! [[ "$PCT" =~ ^[0-9]+$ ]]; then
  echo "bench_compare: error: PCT must be a whole number of percent (pytest-benchmark's mean:PCT%), got '$PCT'" >&2
  exit 2
fi
if [ $# -gt 2 ]; then
  echo "bench_compare: error: expected [PCT] [CURRENT.json], got $# arguments" >&2
  exit 2
fi
BASELINE_ARGS=()
for b in "${BASELINES[@]}"; do
  if [ ! -f "$b" ]; then
    echo "bench_compare: error: baseline $b is missing" >&2
    exit 2
  fi
  BASELINE_ARGS+=(--baseline "$b")
done

BENCH_STATUS=0
if [ -z "$CURRENT" ]; then
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  CURRENT="$TMP/current.json"
  # The benchmark files the baselines name (benchmarks/test_x.py::test_y -> benchmarks/test_x.py).
  mapfile -t FILES < <("$PY" -c 'import json, sys
files = {b["fullname"].split("::")[0] for p in sys.argv[1:] for b in json.load(open(p))["benchmarks"]}
print("\n".join(sorted(files)))' "${BASELINES[@]}")
  echo "bench_compare: timing ${FILES[*]} (the machine should be otherwise idle)" >&2
  SELECT=()
  if [ -n "${BENCH_SELECT:-}" ]; then SELECT=(-k "$BENCH_SELECT"); fi
  "$PY" -m pytest -q "${FILES[@]}" "${SELECT[@]}" --benchmark-only --benchmark-json="$CURRENT" || BENCH_STATUS=$?
  if [ ! -s "$CURRENT" ]; then
    echo "bench_compare: error: the benchmark run wrote no $CURRENT (pytest exit $BENCH_STATUS)" >&2
    exit 2
  fi
fi
GATE_STATUS=0
"$PY" scripts/bench_gate.py "${BASELINE_ARGS[@]}" --current "$CURRENT" --fail "mean:${PCT}%" || GATE_STATUS=$?
if [ "$GATE_STATUS" -eq 0 ] && [ "$BENCH_STATUS" -ne 0 ]; then
  echo "bench_compare: the timings are within ${PCT} % but a benchmark failed its own check (pytest exit $BENCH_STATUS)" >&2
  exit 1
fi
exit "$GATE_STATUS"
