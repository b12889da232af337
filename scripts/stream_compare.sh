#!/usr/bin/env bash
# Side-by-side STREAM triad: `gpubench run --device cpu --probes stream` vs a reference STREAM.
#
# The reference is NOT McCalpin's stream.c (it cannot be downloaded here and no Debian package
# ships it). It is a FAITHFUL MINIMAL REIMPLEMENTATION of stream.c's method, written for this
# script and labelled as such in its output: three static fp64 arrays of STREAM_ARRAY_SIZE
# elements, initialized by `#pragma omp parallel for` loops (first touch), a = 2a once, then
# NTIMES=10 iterations of copy/scale/add/triad, each a plain `#pragma omp parallel for` loop timed
# with gettimeofday (stream.c's mysecond); best rate = 3 x 8 x N bytes / min time over iterations
# 2..NTIMES; the arrays are checked against the scalar replay as stream.c does. Compiled with
# gcc -O3 -fopenmp, run with the same OMP_NUM_THREADS as gpubench.
#
# Both are run interleaved ROUNDS times (the machine may be shared and noisy) on the same array
# size (default: 4x the last-level cache per array, stream.c's rule); the medians are compared.
#
# Usage: scripts/stream_compare.sh [ROUNDS] [ARRAY_ELEMENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
PY=${PYTHON:-.venv/bin/python}
GPUBENCH=${GPUBENCH:-.venv/bin/gpubench}
LLC=$($PY -c "from gpubench.hostinfo import host_cpu; print(host_cpu().llc_bytes)")
N=${2:-$(( 4 * LLC / 8 ))}
THREADS=${OMP_NUM_THREADS:-$($PY -c "from gpubench import _cpu; print(_cpu.max_threads())")}
export OMP_NUM_THREADS=$THREADS
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

cat > "$WORK/stream_ref.c" <<'CEOF'
/* Minimal reimplementation of McCalpin's STREAM timing loop (NOT the original stream.c). */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <sys/time.h>
#include <omp.h>
#ifndef STREAM_ARRAY_SIZE
#define STREAM_ARRAY_SIZE 16777216
#endif
#define NTIMES 10
static double a[STREAM_ARRAY_SIZE], b[STREAM_ARRAY_SIZE], c[STREAM_ARRAY_SIZE];
static double mysecond(void) { struct timeval tp; gettimeofday(&tp, NULL); return tp.tv_sec + tp.tv_usec * 1.e-6; }
int main(void) {
    const long n = STREAM_ARRAY_SIZE;
    double times[4][NTIMES], scalar = 3.0;
#pragma omp parallel for
    for (long j = 0; j < n; j++) { a[j] = 1.0; b[j] = 2.0; c[j] = 0.0; }
#pragma omp parallel for
    for (long j = 0; j < n; j++) a[j] = 2.0E0 * a[j];
    for (int k = 0; k < NTIMES; k++) {
        times[0][k] = mysecond();
#pragma omp parallel for
        for (long j = 0; j < n; j++) c[j] = a[j];
        times[0][k] = mysecond() - times[0][k];
        times[1][k] = mysecond();
#pragma omp parallel for
        for (long j = 0; j < n; j++) b[j] = scalar * c[j];
        times[1][k] = mysecond() - times[1][k];
        times[2][k] = mysecond();
#pragma omp parallel for
        for (long j = 0; j < n; j++) c[j] = a[j] + b[j];
        times[2][k] = mysecond() - times[2][k];
        times[3][k] = mysecond();
#pragma omp parallel for
        for (long j = 0; j < n; j++) a[j] = b[j] + scalar * c[j];
        times[3][k] = mysecond() - times[3][k];
    }
    double mintime[4] = {FLT_MAX, FLT_MAX, FLT_MAX, FLT_MAX};
    for (int k = 1; k < NTIMES; k++)
        for (int i = 0; i < 4; i++) if (times[i][k] < mintime[i]) mintime[i] = times[i][k];
    double aj = 2.0, bj = 2.0, cj = 0.0, ea = 0, eb = 0, ec = 0;
    for (int k = 0; k < NTIMES; k++) { cj = aj; bj = scalar * cj; cj = aj + bj; aj = bj + scalar * cj; }
    for (long j = 0; j < n; j++) { ea += fabs(a[j] - aj); eb += fabs(b[j] - bj); ec += fabs(c[j] - cj); }
    int ok = fabs(ea / n / aj) <= 1e-13 && fabs(eb / n / bj) <= 1e-13 && fabs(ec / n / cj) <= 1e-13;
    double bytes[4] = {2.0 * 8 * n, 2.0 * 8 * n, 3.0 * 8 * n, 3.0 * 8 * n};
    printf("threads %d n %ld copy %.1f scale %.1f add %.1f triad %.1f MB/s valid %d\n", omp_get_max_threads(), n,
           1e-6 * bytes[0] / mintime[0], 1e-6 * bytes[1] / mintime[1], 1e-6 * bytes[2] / mintime[2],
           1e-6 * bytes[3] / mintime[3], ok);
    return ok ? 0 : 1;
}
CEOF
gcc -O3 -fopenmp -DSTREAM_ARRAY_SIZE="$N" -o "$WORK/stream_ref" "$WORK/stream_ref.c"

BYTES=$(( N * 8 ))
echo "# stream_compare: N=$N elements per array ($((BYTES / 1048576)) MiB; LLC $((LLC / 1048576)) MiB), OMP_NUM_THREADS=$THREADS, $ROUNDS interleaved rounds"
echo "# reference = minimal reimplementation of McCalpin's stream.c timing loop (gcc -O3 -fopenmp), NOT the original"
printf "%-6s %14s %14s %8s\n" round ref_triad_GBs gpubench_GBs ratio
REFS=(); GBS=()
run_ref() {
    "$WORK/stream_ref" | awk '{for (i = 1; i <= NF; i++) if ($i == "triad") print $(i + 1) / 1000}'
}
run_gpubench() {
    "$GPUBENCH" run --device cpu --probes stream --out "$WORK/runs" \
        --set stream.min_array_bytes="$BYTES" --set stream.max_array_bytes="$BYTES" >/dev/null 2>&1
    local dir
    dir=$(ls -d "$WORK"/runs/cpu/* | tail -1)
    $PY -c "
import sys; from gpubench.results import load
df = load(sys.argv[1])['stream']; r = df[df.kernel == 'triad'].iloc[-1]
assert r.valid, 'gpubench stream row invalid'; print(r.gbps_best)" "$dir"
    rm -rf "$WORK/runs"
}
for r in $(seq 1 "$ROUNDS"); do
    # Alternate which goes first, so a drift in the machine's load does not favour one side.
    if (( r % 2 )); then ref=$(run_ref); gb=$(run_gpubench); else gb=$(run_gpubench); ref=$(run_ref); fi
    printf "%-6s %14.2f %14.2f %8.3f\n" "$r" "$ref" "$gb" "$($PY -c "print($gb / $ref)")"
    REFS+=("$ref"); GBS+=("$gb")
done
$PY - "${REFS[*]}" "${GBS[*]}" <<'PYEOF'
import statistics, sys
ref = [float(x) for x in sys.argv[1].split()]
gb = [float(x) for x in sys.argv[2].split()]
mr, mg = statistics.median(ref), statistics.median(gb)
pair = statistics.median(g / r for g, r in zip(gb, ref))
print(f"median  {mr:14.2f} {mg:14.2f} {mg / mr:8.3f}")
print(f"best    {max(ref):14.2f} {max(gb):14.2f} {max(gb) / max(ref):8.3f}")
print(f"# gpubench / reference: {mg / mr:.3f} (medians), {pair:.3f} (median of per-round ratios), "
      f"{max(gb) / max(ref):.3f} (best of rounds) -> {'within' if abs(mg / mr - 1) <= 0.05 else 'NOT within'} 5 % (medians)")
PYEOF
