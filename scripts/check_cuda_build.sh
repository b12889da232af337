#!/usr/bin/env bash
# Compile every csrc/cuda/*.cu for sm_80, sm_86, sm_89, sm_90, sm_90a (Hopper-only wgmma code),
# sm_100 (B200), sm_120 (RTX 5090) and the newest arch nvcc supports.
# Fails if any file does not compile, or if ptxas reports register spills (any spill store or load
# of more than 0 bytes) in the bandwidth probes (stream.cu, l2.cu): a spill there adds local-memory
# traffic that the probe would count as bandwidth.
# Usage: scripts/check_cuda_build.sh [FILE.cu ...]   (default: every csrc/cuda/*.cu)
# Environment: NVCC (default nvcc); CHECK_ARCHS (default "80 86 89 90 90a 100 120 <newest>"); SPILL_CHECKED
# (basenames checked for spills, default "stream.cu l2.cu"); NVCC_EXTRA_FLAGS (added to every
# compile); CHECK_JOBS (parallel compiles, default: the number of CPUs); KEEP_OBJECTS (a directory to
# keep the objects in, FILE.ARCH.o, for scripts/check_sass.py --objects).
set -euo pipefail
cd "$(dirname "$0")/.."
export NVCC=${NVCC:-nvcc}
export SPILL_CHECKED=${SPILL_CHECKED:-"stream.cu l2.cu"}
export NVCC_EXTRA_FLAGS=${NVCC_EXTRA_FLAGS:-}
newest=$($NVCC --list-gpu-arch | sed -n 's/compute_\([0-9]*\).*/\1/p' | sort -n | tail -1)
archs=${CHECK_ARCHS:-$(printf '%s\n' 80 86 89 90 90a 100 120 "$newest" | awk '!seen[$0]++' | tr '\n' ' ')}
jobs=${CHECK_JOBS:-$(nproc 2>/dev/null || echo 2)}
export OUT_DIR=$(mktemp -d)
trap 'rm -rf "$OUT_DIR"' EXIT
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(csrc/cuda/*.cu)

# check_one FILE ARCH: compile; on a compile error or a spill write why to $OUT_DIR/*.fail, exit 1.
check_one() {
  local cu=$1 a=$2 name log fail
  name=$(basename "$cu")
  log="$OUT_DIR/$name.$a.log"
  fail="$OUT_DIR/$name.$a.fail"
  local verbose=()
  [[ " $SPILL_CHECKED " == *" $name "* ]] && verbose=(-Xptxas -v)
  local extra=()
  read -r -a extra <<<"$NVCC_EXTRA_FLAGS"
  if ! $NVCC -c "$cu" -o "$OUT_DIR/$name.$a.o" -O3 -std=c++17 -Xcompiler -fPIC -Icsrc/cuda \
       -gencode "arch=compute_$a,code=sm_$a" ${verbose[@]+"${verbose[@]}"} ${extra[@]+"${extra[@]}"} >"$log" 2>&1; then
    { echo "check_cuda_build: $cu failed for sm_$a:"; cat "$log"; } >"$fail"
    return 1
  fi
  if [ ${#verbose[@]} -gt 0 ]; then
    if grep -Eq '[1-9][0-9]* bytes spill (stores|loads)' "$log"; then
      { echo "check_cuda_build: $cu spills registers for sm_$a:"
        grep -E -B2 '[1-9][0-9]* bytes spill (stores|loads)' "$log"; } >"$fail"
      return 1
    elif ! grep -q 'bytes spill stores' "$log"; then
      echo "check_cuda_build: $cu: no ptxas -v report for sm_$a (cannot check spills)" >"$fail"
      return 1
    fi
  fi
}
export -f check_one

t0=$SECONDS
fail=0
for cu in "${files[@]}"; do for a in $archs; do printf '%s\0%s\0' "$cu" "$a"; done; done \
  | xargs -0 -n 2 -P "$jobs" bash -c 'check_one "$0" "$1"' || fail=1
for f in "$OUT_DIR"/*.fail; do [ -e "$f" ] && cat "$f"; done
if [ $fail -eq 0 ] && [ -n "${KEEP_OBJECTS:-}" ]; then
  mkdir -p "$KEEP_OBJECTS" && cp "$OUT_DIR"/*.o "$KEEP_OBJECTS"/
fi
if [ $fail -eq 0 ]; then
  echo "check_cuda_build: ${#files[@]} .cu files compiled for sm_{${archs// /,}} in $((SECONDS - t0)) s" \
       "($jobs parallel); no spills in: $SPILL_CHECKED"
fi
exit $fail
