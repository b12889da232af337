#!/usr/bin/env bash
# One-shot check of the CUDA half on a GPU machine with no network (issue 3), in under 8 minutes:
#   1. build gpubench._cuda in place, for this GPU's architecture only (the CPU extension is not needed)
#   2. run the GPU self-checks (pytest -m gpu)
#   3. gpubench run --device cuda:0 --quick into $OUT/results (or ./results when OUT is unset)
#   4. print a short table: bandwidth and TFLOP/s as % of spec, launch us, clock droop
#   5. copy the run directory to $OUT/run/ (manifest.json + <probe>.jsonl) and the log to $OUT/
# Usage: scripts/device_check.sh            (PYTHON=python3 by default; OUT=./device_check_out if unset)
# Exit status: non-zero if the build, the self-checks or the run failed (the table still prints).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/device_check_out}
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
: >"$LOG"
t_start=$SECONDS
status=0
say() { echo "[device_check +$((SECONDS - t_start))s] $*" | tee -a "$LOG"; }
step() {  # step NAME TIMEOUT_S CMD...: run with a time limit, log everything, remember failure
  local name=$1 limit=$2; shift 2
  say "$name: $*"
  local t0=$SECONDS rc=0
  timeout --signal=INT --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    say "$name FAILED (exit $rc after $((SECONDS - t0)) s); last lines:"; tail -n 25 "$LOG"; status=1
  else
    say "$name ok ($((SECONDS - t0)) s)"
  fi
  return $rc
}

# --- 0. what is here
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=$PATH:/usr/local/cuda/bin; fi
say "host $(hostname), python $($PY -c 'import sys; print(sys.version.split()[0])'), $(nvcc --version | tail -1)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
    --format=csv | tee -a "$LOG"
fi
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
if [ -z "$arch" ]; then
  arch=$($PY -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(f"{a}{b}")' 2>/dev/null || echo 90)
fi
# Hopper: build sm_90a so the wgmma peak kernel (Hopper-only instructions) is in the binary.
[ "$arch" = 90 ] && arch=90a
say "building for sm_$arch"

# --- 1. build (no network: no pip install; in place)
if ! step build 300 env GPUBENCH_ONLY=cuda GPUBENCH_CUDA=1 GPUBENCH_CUBLAS=0 GPUBENCH_CUDA_ARCHS="$arch" "$PY" setup.py -q build_ext --inplace; then
  say "cannot go on without the extension"; exit 1
fi

# --- 2. GPU self-checks
step selfchecks 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/gpubench/test_cuda_backend.py || true

# --- 3. the quick run
mkdir -p "$OUT/results"
step run 330 "$PY" -m gpubench run --device cuda:0 --quick --out "$OUT/results" || true
run_dir=$(ls -dt "$OUT"/results/*/*/ 2>/dev/null | head -1 || true)
if [ -z "$run_dir" ]; then
  say "no run directory was written"; exit 1
fi
say "run directory: $run_dir"

# --- 4. table
"$PY" - "$run_dir" <<'PYEOF' 2>&1 | tee -a "$LOG" || status=1
import sys
from gpubench import results
from gpubench.backends.cuda import check_table, format_table

run = results.load(sys.argv[1])
m = run.manifest
p = m["device"]["properties"]
print(f"\n{m['device']['name']}  sku={m['sku']}  driver={m['device'].get('driver')}  SMs={p.get('sm_count')}  "
      f"L2={p.get('l2_bytes', 0) / 2**20:.0f} MiB  power from: {m.get('telemetry', {}).get('power_source')}")
print("probes: " + ", ".join(f"{k}={v['status']}" + (f" ({v['reason']})" if v.get("reason") else "")
                            for k, v in m["probes"].items()))
print(format_table(check_table(run)))
PYEOF

# --- 5. copy the run directory (flat: manifest.json + <probe>.jsonl) next to the log
mkdir -p "$OUT/run"
cp "$run_dir"/manifest.json "$run_dir"/*.jsonl "$OUT/run/" 2>/dev/null || true
echo "$run_dir" >"$OUT/run/RUN_DIR"
say "done in $((SECONDS - t_start)) s; status $status; run copied to $OUT/run"
exit $status
