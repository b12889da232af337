#!/usr/bin/env bash
# Take a machine's pytest-benchmark baseline for scripts/bench_compare.sh: time every benchmark file
# the committed baselines cover TAKES times (default 3) and keep the take whose geometric mean of the
# benchmarks' means is the median of the takes (every benchmark weighs the same), written atomically to OUT.
#
# Why the median take: on a shared 2-vCPU VM the same benchmarks, same commit, run minutes apart
# differ by 20-35 % in mean (whole-machine phases, not per-benchmark noise), so one take may be a
# slow or a fast phase; a baseline from either would hide or invent regressions. The take is kept
# whole (never a mix of takes), so the file is one real pytest-benchmark run.
#
# Usage:   scripts/bench_baseline.sh OUT.json [TAKES]
# Example: scripts/bench_baseline.sh results/bench-baselines/amd-epyc-x2.json 3
# BENCH_FILES (space-separated) overrides the benchmark files timed; BENCH_SELECT, a pytest -k
# expression, times only the benchmarks it selects (as in scripts/bench_compare.sh).
# Exit 0: written; 1: a benchmark failed; 2: bad input. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# Started from a pytest-xdist worker (the test suite runs in parallel), pytest-benchmark would take
# itself for a worker too and disable every benchmark: these runs are never part of a pool.
unset PYTEST_XDIST_WORKER PYTEST_XDIST_WORKER_COUNT PYTEST_XDIST_TESTRUNUID
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${1:-}
TAKES=${2:-3}
if [ -z "$OUT" ] || [ $# -gt 2 ]; then
  echo "bench_baseline: error: expected OUT.json [TAKES], got $# arguments" >&2
  exit 2
fi
if ! [[ "$TAKES" =~ ^[1-9][0-9]*$ ]]; then
  echo "bench_baseline: error: TAKES must be a positive whole number, got '$TAKES'" >&2
  exit 2
fi
if [ ! -d "$(dirname "$OUT")" ]; then
  echo "bench_baseline: error: the folder of $OUT does not exist" >&2
  exit 2
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
read -r -a FILES <<< "${BENCH_FILES:-benchmarks/test_kvcomm_bench.py benchmarks/test_predictor_bench.py benchmarks/test_scheduling_bench.py}"
SELECT=()
if [ -n "${BENCH_SELECT:-}" ]; then SELECT=(-k "$BENCH_SELECT"); fi
for take in $(seq 1 "$TAKES"); do
  echo "bench_baseline: take $take of $TAKES ($(cut -d' ' -f1-3 /proc/loadavg) load)" >&2
  "$PYTHON" -m pytest -q "${FILES[@]}" "${SELECT[@]}" --benchmark-only --benchmark-json="$TMP/take$take.json" >&2 || exit 1
done
"$PYTHON" - "$OUT" "$TMP"/take*.json <<'EOF'
import json, math, os, sys
out, takes = sys.argv[1], sys.argv[2:]

def geomean(path):
    means = [b["stats"]["mean"] for b in json.load(open(path))["benchmarks"]]
    return math.exp(sum(map(math.log, means)) / len(means))

totals = sorted((geomean(p), p) for p in takes)
total, chosen = totals[(len(totals) - 1) // 2]
tmp = out + ".tmp"
with open(chosen) as src, open(tmp, "w") as dst:
    dst.write(src.read())
    dst.flush()
    os.fsync(dst.fileno())
os.replace(tmp, out)
print(f"bench_baseline: the takes' geometric-mean means {', '.join(f'{t * 1e3:.3f} ms' for t, _ in totals)}; "
      f"kept the median take ({total * 1e3:.3f} ms) in {out}", file=sys.stderr)
EOF
