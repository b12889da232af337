"""Sub-commands of the bench stage: skus (run, show and compare are registered here too)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("skus", help="list the SKU table (spec peaks, bandwidth, sources)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--sources", action="store_true", help="also print the source of every figure")
    p.set_defaults(func=cmd_skus)


def cmd_skus(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from gpubench import skus

    entries = [skus.get(i) for i in skus.all_ids()]
    if args.json:
        out = []
        for s in entries:
            d = {k: getattr(s, k) for k in ("id", "name", "arch", "backend", "sm_count", "spec_clock_mhz",
                                            "max_boost_mhz", "memory_gb", "memory_bw_gbs", "l2_mb", "tdp_w",
                                            "host_link_gbs", "s_floor_ms", "clock_droop")}
            d["peak_tflops"] = {dt: s.peak_flops(dt) / 1e12 for dt in s.fma_per_tc_per_clk}
            d["aliases"] = list(s.aliases)
            d["source"] = s.source
            out.append(d)
        print(json.dumps(out, indent=2))
        return 0
    t = Table(title="gpubench SKU table (dense spec peaks; device properties are read at run time)")
    for col in ("id", "name", "SMs", "clock MHz", "bf16 TF/s", "fp8 TF/s", "mem GB", "BW GB/s", "L2 MB", "s_floor ms", "droop"):
        t.add_column(col, justify="right" if col not in ("id", "name") else "left")
    for s in entries:
        bf16 = s.peak_flops("bf16") / 1e12 if "bf16" in s.fma_per_tc_per_clk else None
        fp8 = s.peak_flops("fp8") / 1e12 if "fp8" in s.fma_per_tc_per_clk else None
        if s.backend == "cpu":
            bf16 = s.peak_flops("fp32") / 1e12
        t.add_row(s.id, s.name + (" [fp32 vector]" if s.backend == "cpu" else ""), str(s.sm_count),
                  f"{s.spec_clock_mhz:.0f}", _f(bf16, 1 if s.backend != "cpu" else 4), _f(fp8, 1),
                  f"{s.memory_gb:.0f}", _f(s.memory_bw_gbs, 0), f"{s.l2_mb:.0f}", _f(s.s_floor_ms, 2), _f(s.clock_droop, 3))
    Console().print(t)
    if args.sources:
        for s in entries:
            print(f"{s.id}:")
            for k, v in s.source.items():
                print(f"  {k}: {v}")
    return 0


def _f(v, nd):
    return "-" if v is None else f"{v:.{nd}f}"
