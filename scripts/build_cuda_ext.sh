#!/usr/bin/env bash
# Build gpubench._cuda in place with nvcc and the host compiler alone: no setuptools, no pip (a
# bare GPU image may lack setuptools >= 77, which this project's PEP 639 license field needs).
# Same sources, flags and link line as setup.py: csrc/cuda/*.cu through nvcc, csrc/cuda/*.cpp
# (the pybind11 bindings) through c++, linked against cudart_static.
# Usage: scripts/build_cuda_ext.sh [ARCH ...]     (default: GPUBENCH_CUDA_ARCHS or "80 86 89 90a 100 120")
# Environment: PYTHON (python3), NVCC (nvcc; CUDA_HOME/bin/nvcc when CUDA_HOME is set), CXX (c++),
# PYBIND11_INCLUDE (pybind11's include dir when `import pybind11` fails), JOBS (parallel compiles).
# Writes gpubench/_cuda<EXT_SUFFIX> (or $BUILD_OUT); prints the path. Exit status non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${CUDA_HOME:-}" ]; then NVCC=${NVCC:-$CUDA_HOME/bin/nvcc}; else NVCC=${NVCC:-nvcc}; fi
CXX=${CXX:-c++}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
command -v "$NVCC" >/dev/null || { echo "build_cuda_ext: $NVCC not found (set NVCC or CUDA_HOME)" >&2; exit 2; }
home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")}
[ -f "$home/include/cuda_runtime.h" ] || home=/usr/local/cuda
[ -f "$home/include/cuda_runtime.h" ] || { echo "build_cuda_ext: no CUDA headers under $home (set CUDA_HOME)" >&2; exit 2; }

if [ $# -gt 0 ]; then archs=("$@"); else read -r -a archs <<<"${GPUBENCH_CUDA_ARCHS:-80 86 89 90a 100 120}"; fi
archs=("${archs[@]//;/ }")
if [ $# -eq 0 ] && [ -z "${GPUBENCH_CUDA_ARCHS:-}" ] && supported=$("$NVCC" --list-gpu-arch 2>/dev/null); then
  # the default list less what this nvcc cannot build (sm_100/sm_120 need CUDA 12.8), as setup.py does
  kept=()
  for a in ${archs[@]}; do n=${a%a}; n=${n%f}; grep -qx "compute_$n" <<<"$supported" && kept+=("$a"); done
  [ "${#kept[@]}" -lt "${#archs[@]}" ] && echo "build_cuda_ext: $NVCC builds sm_{${kept[*]// /,}} of the default list" >&2
  archs=("${kept[@]}")
fi
gencode=()
oldest=
for a in ${archs[@]}; do
  gencode+=(-gencode "arch=compute_$a,code=sm_$a")
  n=${a%a}; n=${n%f}
  if [ -z "$oldest" ] || [ "$n" -lt "$oldest" ]; then oldest=$n; fi
done
gencode+=(-gencode "arch=compute_$oldest,code=compute_$oldest")   # PTX of the oldest: JIT for newer GPUs

pyinc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
pbinc=${PYBIND11_INCLUDE:-$("$PY" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null || true)}
[ -n "$pbinc" ] && [ -f "$pbinc/pybind11/pybind11.h" ] || {
  echo "build_cuda_ext: pybind11 headers not found (pip install pybind11, or set PYBIND11_INCLUDE)" >&2; exit 2; }
version=$(sed -n 's/^VERSION = "\(.*\)"/\1/p' setup.py)

build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
t0=$SECONDS
compile_cu() {  # compile_cu FILE: one object per .cu
  "$NVCC" -c "$1" -o "$build/$(basename "$1").o" -O3 -std=c++17 -Xcompiler -fPIC -Icsrc/cuda "${gencode[@]}"
}
export -f compile_cu; export NVCC build; export GENCODE="${gencode[*]}"
printf '%s\n' csrc/cuda/*.cu | xargs -P "$JOBS" -I{} bash -c 'set -e; read -r -a gencode <<<"$GENCODE"; compile_cu "$0"' {}
for cpp in csrc/cuda/*.cpp; do
  "$CXX" -c "$cpp" -o "$build/$(basename "$cpp").o" -O3 -std=c++17 -fPIC -fvisibility=hidden \
    -Icsrc/cuda -I"$home/include" -I"$pyinc" -I"$pbinc" -DGPUBENCH_VERSION="\"$version\""
done
out=${BUILD_OUT:-gpubench/_cuda$suffix}
libdir=
for d in "$home/lib64" "$home/lib" "$home/targets/x86_64-linux/lib" "$home/targets/sbsa-linux/lib"; do
  [ -f "$d/libcudart_static.a" ] && { libdir=$d; break; }
done
[ -n "$libdir" ] || { echo "build_cuda_ext: libcudart_static.a not found under $home" >&2; exit 2; }
"$CXX" -shared -o "$out.tmp" "$build"/*.o -L"$libdir" -lcudart_static -ldl -lrt -lpthread -Wl,--exclude-libs,ALL
mv "$out.tmp" "$out"
echo "build_cuda_ext: wrote $out for sm_{${archs[*]// /,}} + compute_$oldest PTX in $((SECONDS - t0)) s"
