#!/usr/bin/env bash
# Compile every csrc/cuda/*.cu for sm_80, sm_86, sm_89, sm_90 and the newest arch nvcc supports.
# Fails if any file does not compile.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
newest=$($NVCC --list-gpu-arch | sed -n 's/compute_\([0-9]*\).*/\1/p' | sort -n | tail -1)
archs="80 86 89 90 ${newest}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0
for cu in csrc/cuda/*.cu; do
  for a in $archs; do
    if ! $NVCC -c "$cu" -o "$out/$(basename "$cu").$a.o" -O3 -std=c++17 -Xcompiler -fPIC -Icsrc/cuda \
         -gencode "arch=compute_$a,code=sm_$a" 2>"$out/err.txt"; then
      echo "check_cuda_build: $cu failed for sm_$a:"; cat "$out/err.txt"; fail=1
    fi
  done
done
[ $fail -eq 0 ] && echo "check_cuda_build: $(ls csrc/cuda/*.cu | wc -l) .cu files compiled for sm_{${archs// /,}}"
exit $fail
