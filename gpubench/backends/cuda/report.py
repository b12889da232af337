"""The device-check table of a CUDA run (scripts/device_check.sh): figures against spec and published
expectations."""
from __future__ import annotations

import math

from common import errors
from gpubench import skus
from gpubench.backends.cuda.probes.common import MiB
from gpubench.backends.cuda.probes.gemm import GEMM_DTYPES
from gpubench.backends.cuda.probes.launch import LaunchProbe
from gpubench.report import valid_rows

# What published measurements lead one to expect, per SKU and figure prefix of check_table, so that
# the first run on a card can be judged at a glance. H200: STREAM triad 75-90 % of the 4.8 TB/s
# spec (3.5 TB/s measured, 74 %; an L2-sweep DRAM plateau 3.9 TB/s), an L2 plateau near 10 TB/s up
# to ~40 MB, back-to-back launches ~2.5 us eager / ~1.3 us in a graph, bf16 dense GEMM ~790 TFLOP/s
# (80 % of spec, as on the H100).
EXPECTED: dict[str, dict[str, str]] = {
    "h200": {"stream triad": "expect 75-90 % of 4.8 TB/s", "l2 warm max": "expect ~10 TB/s up to ~40 MB",
             "launch device_interval": "expect ~2.5 us (eager)", "launch graph_node": "expect ~1.3 us (graph)",
             "gemm bf16 best": "expect ~790 TF/s", "peak bf16 wgmma": "expect 80-90 % of spec x f_clk"},
    "h100-sxm": {"gemm bf16 best": "expect ~795 TF/s (80 %)"},
    "a100-80": {"stream triad": "expect ~86 % of 2.04 TB/s", "gemm bf16 best": "expect ~270 TF/s (87 %)",
                "launch device_interval": "expect ~2.6 us (eager)", "launch graph_node": "expect ~1.4 us (graph)"},
}


def expected_note(sku_id: str | None, figure: str) -> str:
    """The published expectation for a check_table figure on this SKU ('' when none)."""
    for prefix, note in EXPECTED.get(sku_id or "", {}).items():
        if figure.startswith(prefix):
            return note
    return ""


def check_table(run) -> list[tuple[str, str, str, str]]:
    """(figure, value, % of spec, notes) lines of a CUDA run for scripts/device_check.sh.

    Stream/l2 bandwidth and peak/gemm TFLOP/s as % of the SKU's spec (peak also as % of
    spec x f_clk, f_clk = mean SM clock / spec clock), launch costs in us with p20-p80, clock droop
    and the clock-event reasons seen during the GEMMs. Invalid rows are never used as figures.
    """
    from gpubench.telemetry_nvml import clock_droop, decode_throttle

    try:
        sku = skus.get(run.manifest["sku"])
    except errors.GpubenchError:
        sku = None
    spec_bw = sku.memory_bw_gbs if sku else None

    def pct(x, ref):
        return f"{100 * x / ref:5.1f} %" if (x is not None and ref) else ""

    lines: list[tuple[str, str, str, str | None]] = []
    if "stream" in run:
        st = valid_rows(run["stream"])
        if len(st):
            top = st[st["n_elements"] == st["n_elements"].max()]
            for kernel in ("copy", "triad"):
                for _, r in top[top["kernel"] == kernel].iterrows():
                    lines.append((f"stream {kernel} {r['array_bytes'] / MiB:.0f} MiB", f"{r['gbps_best']:.0f} GB/s",
                                  pct(r["gbps_best"], spec_bw), f"median {r['gbps_median']:.0f}, cv {r['cv']:.3f}"))
    if "l2" in run:
        l2 = valid_rows(run["l2"])
        for mode in ("warm", "cold"):
            sel = l2[l2["mode"] == mode]
            if len(sel):
                best = sel.loc[sel["gbps_median"].idxmax()]
                big = sel.loc[sel["working_set_bytes"].idxmax()]
                lines.append((f"l2 {mode} max (at {best['working_set_bytes'] / MiB:.2f} MiB)",
                              f"{best['gbps_median']:.0f} GB/s", "",
                              f"{big['gbps_median']:.0f} GB/s ({pct(big['gbps_median'], spec_bw).strip() or '-'} of spec) "
                              f"at {big['working_set_bytes'] / MiB:.0f} MiB"))
    if "peak" in run:
        for _, r in valid_rows(run["peak"]).iterrows():
            clock, spec_clock = r.get("clock_mhz_mean"), r.get("spec_clock_mhz")
            note = ""
            if _present(clock) and _present(spec_clock) and _present(r.get("spec_tflops")):
                f_clk = clock / spec_clock
                note = f"{pct(r['tflops_median'], r['spec_tflops'] * f_clk).strip()} of spec x f_clk ({f_clk:.3f})"
            lines.append((f"peak {r['dtype']} {r.get('instruction', r['unit'])}", f"{r['tflops_median']:.1f} TF/s",
                          pct(r["tflops_median"], r.get("spec_tflops") if _present(r.get("spec_tflops")) else None), note))
    if "launch" in run:
        la = valid_rows(run["launch"])
        for kind in LaunchProbe.TIMERS:
            sel = la[la["kind"] == kind]
            if len(sel):
                r = sel.loc[sel["count"].idxmax()]
                c = r["count"]
                lines.append((f"launch {kind} (x{c})", f"{r['t_median_s'] / c * 1e6:.2f} us", "",
                              f"p20-p80 {r['t_p20_s'] / c * 1e6:.2f}-{r['t_p80_s'] / c * 1e6:.2f} us"))
    if "gemm" in run:
        g = valid_rows(run["gemm"])
        for dtype in GEMM_DTYPES:
            sel = g[g["dtype"] == dtype]
            if len(sel):
                b = sel.loc[sel["tflops_median"].idxmax()]
                lines.append((f"gemm {dtype} best {b['m']}x{b['n']}x{b['k']}", f"{b['tflops_median']:.1f} TF/s",
                              pct(b["tflops_median"], b.get("spec_tflops") if _present(b.get("spec_tflops")) else None),
                              f"{len(sel)} valid of {int((run['gemm']['dtype'] == dtype).sum())}"))
        d = clock_droop(run["gemm"])
        lines.append(("clock droop (bf16 GEMM, M=16384)", f"{100 * d.droop:.1f} %" if d.droop is not None else "-", "",
                      f"mean {d.mean_clock_mhz:.0f} / max {d.max_clock_mhz:.0f} MHz over {d.num_rows} rows"
                      if d.droop is not None else d.reason))
        bits = 0
        for v in run["gemm"].get("throttle_bits", []):
            if _present(v):
                bits |= int(v)
        lines.append(("clock-event reasons during gemm", "", "", ", ".join(decode_throttle(bits)) or "none"))
    sku_id = sku.id if sku else None
    return [(a, b, c, "; ".join(x for x in (d, expected_note(sku_id, a)) if x)) for a, b, c, d in lines]


def format_table(lines: list[tuple[str, str, str, str]]) -> str:
    """The check_table lines as aligned text."""
    w = max([len(a) for a, *_ in lines] + [6])
    out = [f"{'figure':<{w}}  {'value':>12}  {'% spec':>7}  notes"]
    out += [f"{a:<{w}}  {b:>12}  {c:>7}  {d}" for a, b, c, d in lines]
    return "\n".join(out)


def _present(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))
