#!/usr/bin/env bash
# One-shot check of the CUDA half on a GPU machine with no network, in under 8 minutes:
#   1. build gpubench._cuda in place for this GPU's architecture only, with nvcc and the host
#      compiler alone (scripts/build_cuda_ext.sh: no setuptools, no pip)
#   2. count the tensor-core instructions of the compiled peak loops (scripts/check_sass.py)
#   3. run the GPU self-checks (pytest -m gpu)
#   4. gpubench run --device cuda:0 --quick (probes in the order stream, peak, launch, gemm, l2)
#   5. print % of spec per figure, with what published measurements lead one to expect
#   6. optional: steps of the graph engine (`gpubench profile --engine torch-graph --grid graph`: static
#      buffers, fused kernels, decode shapes replayed as CUDA graphs, a kernel breakdown at 4 points per
#      model) of the models in GRAPH_MODELS, then eager steps (`--grid gpu`) of those in STEP_MODELS, one
#      after another, each within what is left of DEADLINE_S (counted from the script's start)
# Between 3 and 4, 20 fresh processes each measure stream and l2 once (scripts/stress_probes.py): the
# first H200 machine lost both to a SIGSEGV at their first measurement, the second never did.
# Everything it leaves is six files (seven with GRAPH_MODELS or STEP_MODELS) directly in $OUT (a device tool returns
# only a handful of files, at most two folders deep):
#   env.txt           host, driver, GPU, clocks, MIG and compute mode, toolchain versions
#   device_check.log  every step's output
#   sass_summary.txt  tensor-core instruction counts per peak kernel for this architecture
#   spec_table.txt    the % of spec table (also printed)
#   run.tar.gz        the run directory (manifest.json + <probe>.jsonl), written by an EXIT trap,
#                     so a run cut short by a time limit still comes back
#   stress.txt        how each of the 20 stream+l2 processes ended (a crash: its backtrace under gdb)
#   steps.tar.gz      graph-<model>.parquet per model in GRAPH_MODELS, gpu-<model>.parquet per model in
#                     STEP_MODELS (a model cut short by the deadline leaves its rows so far in
#                     <file>.partial.jsonl)
# Usage: scripts/device_check.sh                 PYTHON=python3, OUT=./device_check_out by default
#        GRAPH_MODELS="llama-3.1-8b llama-3.2-1b qwen2.5-0.5b qwen2.5-7b mistral-7b" DEADLINE_S=450 \
#          scripts/device_check.sh               the graph engine's steps of these shipped configs too
#                                                 (what issue 39's device session runs)
#        STEP_MODELS="llama-3.1-8b llama-3.2-1b" DEADLINE_S=400 scripts/device_check.sh
#                                                 eager engine steps of these
#        DRY_RUN=1 scripts/device_check.sh       no GPU: skip build and GPU steps, rehearse the rest
#                                                 on a CPU run (the layout test uses this)
# pybind11 is needed to build: if `import pybind11` fails, prepare it where the machine can see it,
# e.g. `pip install --target .device/py pybind11` here and carry .device; it is picked up from there.
# Exit status: non-zero if the build, the self-checks or the run failed (the table still prints).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/device_check_out}
DRY_RUN=${DRY_RUN:-0}
STEP_MODELS=${STEP_MODELS:-}
GRAPH_MODELS=${GRAPH_MODELS:-}
DEADLINE_S=${DEADLINE_S:-0}   # 0: no deadline for the step profiles
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
: >"$LOG"
WORK=$(mktemp -d)
RESULTS="$WORK/results"
STEPS="$WORK/steps"
mkdir -p "$RESULTS" "$STEPS"
[ -d .device/py ] && export PYTHONPATH="$PWD/.device/py${PYTHONPATH:+:$PYTHONPATH}"
t_start=$SECONDS
status=0
say() { echo "[device_check +$((SECONDS - t_start))s] $*" | tee -a "$LOG"; }

# The run directory comes back whatever happens: archived on exit, even after a timeout or an error.
archive() {
  local run_dir
  run_dir=$(ls -dt "$RESULTS"/*/*/ 2>/dev/null | head -1)
  if [ -n "$run_dir" ]; then
    tar -czf "$OUT/run.tar.gz" --exclude=.gpubench.lock -C "$(dirname "$run_dir")" "$(basename "$run_dir")" 2>>"$LOG" \
      && say "run directory archived to $OUT/run.tar.gz ($(basename "$run_dir"))"
  else
    say "no run directory to archive"
  fi
  if [ -n "$(ls -A "$STEPS" 2>/dev/null)" ]; then
    tar -czf "$OUT/steps.tar.gz" -C "$STEPS" . 2>>"$LOG" && say "step rows archived to $OUT/steps.tar.gz"
  fi
  rm -rf "$WORK"
}
trap archive EXIT

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
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname)  kernel: $(uname -r)  cpus: $(nproc)"
  echo "python: $($PY -c 'import sys; print(sys.version.split()[0])' 2>&1)"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo 'not found')"
  echo "torch: $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
  echo "pybind11: $($PY -c 'import pybind11; print(pybind11.__version__)' 2>&1 | tail -1)"
  echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
  # the toolchain the extension is built and loaded with (the first H200 machine's build formatted
  # integers as nothing through iostreams: which compiler and libstdc++ matter)
  echo "c++: $(${CXX:-c++} --version 2>/dev/null | head -1 || echo 'not found')"
  echo "libstdc++: $($PY -c 'import ctypes.util; print(ctypes.util.find_library("stdc++"))' 2>&1) $(ldconfig -p 2>/dev/null | grep -m1 'libstdc++.so.6 ' | sed 's/.*=> //')"
  echo "python's libstdc++ mapping: $(ldd "$(command -v "$PY")" 2>/dev/null | grep -E 'stdc\+\+|libc\.so' | tr -s ' \t' ' ' | tr '\n' ';')"
  env | grep -E '^(LD_|CUDA_MODULE_LOADING|CUDA_VISIBLE)' | sed 's/^/env: /' || true
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,mig.mode.current,compute_mode \
      --format=csv 2>&1
  else
    echo "nvidia-smi: not found"
  fi
} >"$OUT/env.txt" 2>&1
say "environment written to $OUT/env.txt"
cat "$OUT/env.txt" >>"$LOG"

# --- 6. real engine steps: each model within what is left of DEADLINE_S
profile_models() {  # profile_models ENGINE PREFIX DEVICE GRID MODELS [EXTRA ARGS...]
  local engine=$1 prefix=$2 device=$3 grid=$4 models=$5; shift 5
  local model left
  for model in $models; do
    left=$(( DEADLINE_S > 0 ? DEADLINE_S - (SECONDS - t_start) - 10 : 900 ))
    if [ "$left" -lt 30 ]; then say "steps: $model ($engine) skipped, ${left} s left before DEADLINE_S"; continue; fi
    step "steps_${prefix}_$model" "$left" "$PY" -m gpubench profile --model "$model" --engine "$engine" \
      --device "$device" --grid "$grid" --out "$STEPS/$prefix-$model.parquet" "$@" || true
  done
}
profile_steps() {  # profile_steps DEVICE: the graph engine's models first (issue 39's rows), then the eager ones
  if [ "$1" = cpu ]; then
    profile_models torch-graph graph cpu quick "$GRAPH_MODELS" --max-points 2 --ops-subset 1
    profile_models torch gpu cpu quick "$STEP_MODELS" --max-points 2 --ops-subset 1
  else
    profile_models torch-graph graph "$1" graph "$GRAPH_MODELS" --ops-subset 4
    profile_models torch gpu "$1" gpu "$STEP_MODELS" --ops-subset 8
  fi
}

if [ "$DRY_RUN" = 1 ]; then
  say "DRY_RUN=1: no build, no GPU; rehearsing the outputs on a CPU run"
  echo "dry run: no SASS counted" >"$OUT/sass_summary.txt"
  step format 20 "$PY" -c 'from gpubench.backends.cuda.extension import load_extension; load_extension(); print("format self-test ok")' || true
  step stress 60 "$PY" scripts/stress_probes.py --runs 3 --dry-run --out "$OUT/stress.txt" || true
  step run 240 "$PY" -m gpubench run --device cpu --quick --probes stream --out "$RESULTS" || true
  run_dir=$(ls -dt "$RESULTS"/*/*/ 2>/dev/null | head -1)
  [ -n "$run_dir" ] && "$PY" -m gpubench show "$run_dir" >"$OUT/spec_table.txt" 2>&1
  profile_steps cpu
  say "done in $((SECONDS - t_start)) s; status $status (dry run)"
  exit $status
fi

arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
if [ -z "$arch" ]; then
  arch=$($PY -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(f"{a}{b}")' 2>/dev/null || echo 90)
fi
# Hopper: build sm_90a so the wgmma peak kernel (Hopper-only instructions) is in the binary.
[ "$arch" = 90 ] && arch=90a
say "building for sm_$arch"

# --- 1. build (no network, no setuptools: nvcc + c++ directly)
if ! step build 120 env PYTHON="$PY" bash scripts/build_cuda_ext.sh "$arch"; then
  say "no probes without the extension"; profile_steps cuda:0; exit 1
fi

ext=$(ls gpubench/_cuda*.so 2>/dev/null | head -1)
[ -n "$ext" ] && echo "extension's libstdc++: $(ldd "$ext" 2>/dev/null | grep -E 'stdc\+\+' | tr -s ' \t' ' ')" >>"$OUT/env.txt"
# the formatter every message uses, on fixed values, before any probe (a broken build stops here)
step format 20 "$PY" -c 'from gpubench.backends.cuda.extension import load_extension; load_extension(); print("format self-test ok")' || true

# --- 2. what the peak loops compiled to
step sass 30 "$PY" scripts/check_sass.py --archs "$arch" || true
grep -E '^sm_' "$LOG" | tail -n 20 >"$OUT/sass_summary.txt" || true

# --- 3. GPU self-checks
selfcheck_rc=0
step selfchecks 50 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/gpubench/test_cuda_backend.py || selfcheck_rc=$?
if [ "$selfcheck_rc" -eq 139 ] && command -v cuda-gdb >/dev/null; then
  # A crash (SIGSEGV) in the extension: its C++ backtrace, which Python's fault handler cannot give.
  # The first H200 session lost one this way (stream and l2 crashed on one machine, not on the next).
  say "selfchecks crashed: the backtrace under cuda-gdb follows"
  timeout 60 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt \
    --args "$PY" -m pytest -q -m gpu -p no:cacheprovider -p no:faulthandler tests/gpubench/test_cuda_backend.py \
    2>&1 | grep -v '^\[New Thread\|^\[Thread\|^\[Detaching\|cannot be found in library' | tail -40 >>"$LOG" || true
fi

# --- 3b. stream and l2 in 20 fresh processes: how each ended, a backtrace if one crashed
step stress 90 "$PY" scripts/stress_probes.py --runs 20 --out "$OUT/stress.txt" || true

# --- 4. the quick run (the probe order puts the long l2 sweep last)
step run 190 "$PY" -m gpubench run --device cuda:0 --quick --out "$RESULTS" || true
run_dir=$(ls -dt "$RESULTS"/*/*/ 2>/dev/null | head -1)
if [ -z "$run_dir" ]; then
  say "no run directory was written"; profile_steps cuda:0; exit 1
fi
say "run directory: $run_dir"

# --- 5. table
"$PY" - "$run_dir" <<'PYEOF' >"$OUT/spec_table.txt" 2>&1 || status=1
import sys
from gpubench import results
from gpubench.backends.cuda import check_table, format_table

run = results.load(sys.argv[1])
m = run.manifest
d = m["device"]
p = d["properties"]
print(f"{d['name']}  sku={m['sku']}  driver={d.get('driver')}  SMs={p.get('sm_count')}  "
      f"L2={p.get('l2_bytes', 0) / 2**20:.0f} MiB  MIG={d.get('mig_enabled')}  compute mode={d.get('compute_mode')}  "
      f"power from: {m.get('telemetry', {}).get('power_source')}")
print("probes: " + ", ".join(f"{k}={v['status']}" + (f" ({v['reason']})" if v.get("reason") else "")
                            for k, v in m["probes"].items()))
print(format_table(check_table(run)))
PYEOF
tee -a "$LOG" <"$OUT/spec_table.txt"
profile_steps cuda:0
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1 || true
say "done in $((SECONDS - t_start)) s; status $status"
exit $status
