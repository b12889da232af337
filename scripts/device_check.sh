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
say "host $(hostname), python $($PY -c 'import sys; print(sys.version.split()[0])'), $(nvcc --version | tail -1)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
    --format=csv | tee -a "$LOG"
fi
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
if [ -z "$arch" ]; then
  arch=$($PY -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(f"{a}{b}")' 2>/dev/null || echo 90)
fi
say "building for sm_$arch"

# --- 1. build (no network: no pip install; in place)
if ! step build 300 env GPUBENCH_ONLY=cuda GPUBENCH_CUDA=1 GPUBENCH_CUDA_ARCHS="$arch" "$PY" setup.py -q build_ext --inplace; then
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
from gpubench import results, skus
from gpubench.telemetry_nvml import clock_droop, decode_throttle

run = results.load(sys.argv[1])
m = run.manifest
try:
    sku = skus.get(m["sku"])
except Exception:
    sku = None
print(f"\n{m['device']['name']}  sku={m['sku']}  driver={m['device'].get('driver')}  "
      f"SMs={m['device']['properties'].get('sm_count')}  L2={m['device']['properties'].get('l2_bytes', 0) / 2**20:.0f} MiB")
print(f"probes: " + ", ".join(f"{k}={v['status']}" + (f" ({v.get('reason')})" if v.get("reason") else "")
                              for k, v in m["probes"].items()))
lines = []
def pct(x, ref):
    return f"{100 * x / ref:5.1f} %" if (x is not None and ref) else "    -  "
if "stream" in run:
    st = run["stream"][run["stream"].valid]
    top = st["n_elements"].max()
    for k in ("copy", "triad"):
        r = st[(st.kernel == k) & (st.n_elements == top)]
        if len(r):
            r = r.iloc[0]
            lines.append((f"stream {k} {r.array_bytes / 2**20:.0f} MiB", f"{r.gbps_best:8.0f} GB/s",
                          pct(r.gbps_best, sku.memory_bw_gbs if sku else None), f"median {r.gbps_median:.0f}, cv {r.cv:.3f}"))
if "l2" in run:
    l2 = run["l2"][run["l2"].valid]
    for mode in ("warm", "cold"):
        r = l2[l2["mode"] == mode]
        if len(r):
            best = r.loc[r.gbps_median.idxmax()]
            big = r.loc[r.working_set_bytes.idxmax()]
            lines.append((f"l2 {mode} max / at {big.working_set_bytes / 2**20:.0f} MiB",
                          f"{best.gbps_median:8.0f} GB/s", pct(big.gbps_median, sku.memory_bw_gbs if sku else None),
                          f"max at {best.working_set_bytes / 2**20:.2f} MiB; largest set {big.gbps_median:.0f} GB/s"))
if "peak" in run:
    for _, r in run["peak"].iterrows():
        f_clk = (r.clock_mhz_mean / r.spec_clock_mhz) if (r.get("clock_mhz_mean") and r.get("spec_clock_mhz")) else None
        note = f"{pct(r.tflops_median, r.spec_tflops * f_clk)} of spec x f_clk ({f_clk:.3f})" if (f_clk and r.spec_tflops) else ""
        lines.append((f"peak {r['dtype']} ({r.unit})", f"{r.tflops_median:8.1f} TF/s", pct(r.tflops_median, r.spec_tflops),
                      note + ("" if r.valid else " INVALID")))
if "launch" in run:
    la = run["launch"]
    for kind in ("host_enqueue", "device_interval", "launch_sync", "graph_node"):
        r = la[la.kind == kind]
        if len(r):
            r = r.loc[r["count"].idxmax()]
            c = r["count"]
            lines.append((f"launch {kind} (x{c})", f"{r.per_launch_s_median * 1e6:8.2f} us", "",
                          f"p20-p80 {r.t_p20_s / c * 1e6:.2f}-{r.t_p80_s / c * 1e6:.2f} us"))
if "gemm" in run:
    g = run["gemm"][run["gemm"].valid]
    for dt in ("bf16", "fp16", "tf32"):
        r = g[g.dtype == dt]
        if len(r):
            b = r.loc[r.tflops_median.idxmax()]
            lines.append((f"gemm {dt} best {b.m}x{b.n}x{b.k}", f"{b.tflops_median:8.1f} TF/s", pct(b.tflops_median, b.spec_tflops),
                          f"{len(r)} valid of {int((run['gemm'].dtype == dt).sum())}"))
    d = clock_droop(run["gemm"])
    lines.append(("clock droop (bf16 GEMM M=16384)", f"{100 * d.droop:8.1f} %" if d.droop is not None else "       -",
                  "", f"mean {d.mean_clock_mhz:.0f} / max {d.max_clock_mhz:.0f} MHz over {d.num_rows} rows"
                  if d.droop is not None else d.reason))
    bits = 0
    for v in run["gemm"].get("throttle_bits", []):
        if v == v and v is not None:
            bits |= int(v)
    lines.append(("clock-event reasons during gemm", "", "", ", ".join(decode_throttle(bits)) or "none"))
w = max(len(a) for a, *_ in lines) if lines else 10
print(f"\n{'figure':<{w}}  {'value':>13}  {'% spec':>7}  notes")
for a, b, c, d in lines:
    print(f"{a:<{w}}  {b:>13}  {c:>7}  {d}")
PYEOF

# --- 5. copy the run directory (flat: manifest.json + <probe>.jsonl) next to the log
mkdir -p "$OUT/run"
cp "$run_dir"/manifest.json "$run_dir"/*.jsonl "$OUT/run/" 2>/dev/null || true
echo "$run_dir" >"$OUT/run/RUN_DIR"
say "done in $((SECONDS - t_start)) s; status $status; run copied to $OUT/run"
exit $status
