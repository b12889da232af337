"""CUDA peak: FMA / MMA loops per dtype against the SKU's spec peak."""
from __future__ import annotations

import sys
from typing import Any

from gpubench.backends.base import MeasurementSpec, ProbeConfig
from gpubench.backends.cuda.extension import NUM_WARMUP
from gpubench.backends.cuda.probes.common import CudaProbe, device_props, fp8_mma_native, probe_row, spec_formula, spec_tflops
from gpubench.backends.probe_common import opt


class PeakProbe(CudaProbe):
    """Compute ceilings with operands in registers: tensor-core ``mma.sync`` per dtype, fp32 FMA.

    bf16 and fp16 (m16n8k16, fp32 accumulate), tf32 (m16n8k8), fp8 e4m3 (m16n8k32, where it is a
    native QMMA: compute capability 8.9 and 12.x; left out with a note elsewhere, emulated on 9.0
    and 10.x, absent before 8.9), fp32 FMA on CUDA cores; on compute
    capability 9.0 also ``wgmma`` bf16 (m64n128k16) and fp8 e4m3 (m64n128k32), B in shared memory:
    the only instructions that reach Hopper's tensor-core peak, and fp8's only native path there
    (needs a build with sm_90a code). About 20 ms per repetition.
    Every accumulator is checked exactly (csrc/cuda/peak.cu, wgmma.cu). ``spec_tflops`` is the SKU
    identity at its spec clock; compare with ``clock_mhz_mean`` for the share at the real clock.
    """

    name = "peak"
    description = "tensor-core mma.sync (bf16, fp16, tf32, fp8) and fp32 FMA ceilings"
    timer = "cuda_events"
    time_budget_s = 120.0
    DTYPES = ("bf16", "fp16", "tf32", "fp8", "fp32")
    MIN_CC = {"fp8": 89}

    def _cc(self, cfg: ProbeConfig) -> int:
        p = device_props(cfg)
        return int(p.get("cc_major", 0)) * 10 + int(p.get("cc_minor", 0))

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        reps = max(10, opt(cfg, "peak", "num_reps", cfg.num_reps))
        target_s = opt(cfg, "peak", "target_s", 0.02)
        cc = self._cc(cfg)
        specs = [MeasurementSpec(key=f"peak_{'fma' if d == 'fp32' else 'mma'}_{d}",
                                 params={"dtype": d, "num_reps": reps, "target_s": target_s, "instruction":
                                         "fma.rn.f32" if d == "fp32" else "mma.sync"}, label=d)
                 for d in self.DTYPES if cc >= self.MIN_CC.get(d, 0) and (d != "fp8" or fp8_mma_native(cc))]
        if cc == 90:  # last: a fault in the sm_90a-only kernels must not cost the other rows
            # fp8 e4m3 through wgmma: on Hopper its only native path (mma.sync e4m3 is emulated)
            specs += [MeasurementSpec(key=f"peak_wgmma_{d}", label=f"{d} wgmma", params={
                "dtype": d, "num_reps": reps, "target_s": target_s, "instruction": "wgmma"}) for d in ("bf16", "fp8")]
        return specs

    def notes(self, cfg: ProbeConfig) -> list[str]:
        cc = self._cc(cfg)
        notes = [f"{d} left out: needs compute capability {m // 10}.{m % 10}+ (device is {cc // 10}.{cc % 10})"
                 for d, m in self.MIN_CC.items() if cc < m]
        if cc >= self.MIN_CC["fp8"] and not fp8_mma_native(cc):
            notes.append(f"fp8 mma.sync left out: mma.sync e4m3 is emulated on compute capability {cc // 10}.{cc % 10} "
                         "(fp16 HMMA + FADD; native only on 8.9 and 12.x)"
                         + ("; fp8 measured through wgmma e4m3 instead" if cc == 90 else ""))
        return notes

    def measure(self, spec: MeasurementSpec) -> dict | list:
        p = spec.params
        instruction = p.get("instruction", "mma.sync")
        if instruction == "wgmma":
            r = self.ext.peak_wgmma(self.backend.index, p["num_reps"], NUM_WARMUP, p["target_s"], dtype=p["dtype"])
        else:
            r = self.ext.peak(self.backend.index, p["dtype"], p["num_reps"], NUM_WARMUP, p["target_s"])
        if not r.get("supported", 1):
            # The device has the dtype but this build has no code for it (e.g. built for sm_80 only and
            # run on an sm_90 part): skip the row, say why on stderr (the worker's log), keep going.
            print(f"gpubench: peak {p['dtype']} {instruction}: {r['check']}", file=sys.stderr)
            return []
        sku = self.backend.sku
        return probe_row(spec.key, r, "cuda_events", dtype=p["dtype"],
                    unit="cuda_core" if p["dtype"] == "fp32" else "tensor_core", flops=float(r["flops"]),
                    iters=int(r["iters"]), grid=int(r["grid"]), block=int(r["block"]),
                    spec_tflops=spec_tflops(sku, p["dtype"]),
                    spec_clock_mhz=(sku.max_boost_mhz if p["dtype"] == "fp32" else sku.spec_clock_mhz) if sku else None,
                    spec_formula=spec_formula(sku, p["dtype"]),
                    instruction=instruction)

    def derive(self, row: dict, summary: dict) -> dict[str, Any]:
        out = super().derive(row, summary)
        spec = row.get("spec_tflops")
        out["pct_of_spec"] = 100.0 * out["tflops_best"] / spec if spec else None
        return out
