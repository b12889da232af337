"""What the bench commands print and write: `run`'s and `show`'s summary table, `compare`'s tables
and CSV, and the strict JSON of `run --json` and `compare --json` (NaN and infinities as null).

Apart from ``bench_cli`` (the parsers and what each command does) because this is only rendering:
it takes the summaries ``gpubench.report`` and ``gpubench.compare`` return and lays them out.
"""
from __future__ import annotations

import sys

from common.termtable import Col, console, table


def finite_or_none(value):
    """``value`` with every NaN or infinite float (nested in dicts and lists) replaced by None."""
    import math

    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(v, nd=2) -> str:
    if v is None:
        return "-"
    return f"{v:,.{nd}f}" if abs(v) < 1e6 else f"{v:.3e}"


SUMMARY_COLUMNS = (Col("probe", keep=True), Col("figure", wrap=True), Col("best", "right"), Col("median", "right"),
                   Col("unit"), Col("min..max", "right", drop=2), Col("CV", "right", drop=3), Col("n", "right", drop=1),
                   Col("% of", wrap=True, drop=4))


def summary_rows(s) -> list[list[str]]:
    """The headline table's cells (SUMMARY_COLUMNS) of a run summary (gpubench.report.RunSummary)."""
    rows = []
    for h in s.headlines:
        rng = f"{_fmt(h.lo)}..{_fmt(h.hi)}" if h.lo is not None else "-"
        pct = f"{h.pct:.1f} % of {h.pct_of}" if h.pct is not None else ""
        if h.note:
            pct = f"{pct}; {h.note}" if pct else h.note
        rows.append([h.probe, h.label + (" !" if h.contended else ""), _fmt(h.value), _fmt(h.median), h.unit, rng,
                     f"{100 * h.cv:.1f} %" if h.cv is not None else "-", str(h.n or "-"), pct])
    return rows


def print_summary(s, console) -> None:
    """`run`'s and `show`'s output: the header, the headline table (fitted to ``console.width``),
    the probes' statuses, invalid rows and telemetry."""
    console.print(f"[bold]{s.run_dir}[/bold]  sku={s.sku}  device={s.device}  created={s.created_utc}")
    c = s.contention or {}
    if c.get("contended"):
        console.print(f"CONTENDED: this run was taken under contention ({c['reason']}); {c['rows_flagged']} of "
                      f"{c['rows_judged']} judged rows got under {c['min_cpu_share']:.0%} of the CPU they asked for "
                      "(figures from them marked !): its figures measure the other work as much as this machine; "
                      "re-run it on a quiet machine", style="bold red", markup=False, highlight=False)
    console.print(table(SUMMARY_COLUMNS, summary_rows(s), width=console.width,
                        title="headline figures (best = min time; range over repetitions, first discarded)"))
    if not c.get("contended") and any(h.contended for h in s.headlines):
        console.print(f"!: from a row that got under {c['min_cpu_share']:.0%} of the CPU it asked for (the run as a "
                      "whole was quiet)", markup=False, highlight=False)
    for name, p in s.probes.items():
        line = f"{name}: {p.get('status')}"
        if p.get("wall_s") is not None:
            line += f" in {p['wall_s']:.1f} s, {p.get('num_rows', 0)} rows"
        if p.get("reason"):
            line += f" - {p['reason']}"
        for note in p.get("notes", []) or []:
            line += f" [{note}]"
        console.print(line, markup=False, highlight=False)
    if s.invalid:
        console.print(f"[red]{len(s.invalid)} invalid rows (never reported as figures):[/red]")
        for line in s.invalid[:10]:
            console.print("  " + line, markup=False, highlight=False)
    tel = s.telemetry
    console.print(f"telemetry ({tel.get('source')}, {tel.get('samples')} samples): clock "
                  f"{_fmt(tel.get('clock_mhz_mean'), 0)} MHz mean, {_fmt(tel.get('clock_mhz_min'), 0)}.."
                  f"{_fmt(tel.get('clock_mhz_max'), 0)} over rows, low-clock share {_fmt(tel.get('low_clock_frac_mean'), 3)}, "
                  f"energy {_fmt(tel.get('energy_j_total'), 1)} J", markup=False, highlight=False)
    if tel.get("proc_cpu_util_median") is not None or tel.get("loadavg_at_start"):
        la = tel.get("loadavg_at_start") or []
        console.print(f"  contention: the measuring process used {_fmt(tel.get('proc_cpu_util_median'))} CPUs "
                      f"(median over rows); load average at start {', '.join(f'{x:.1f}' for x in la) or '-'}",
                      markup=False, highlight=False)
    if tel.get("droop_detail"):
        console.print("  clock droop under the M=16384 bf16 GEMM: "
                      f"{_fmt(100 * tel['droop'] if tel.get('droop') is not None else None, 1)} % "
                      f"({tel['droop_detail']})", markup=False, highlight=False)
    if tel.get("note"):
        console.print(f"  clock: {tel['note']}", markup=False, highlight=False)
    for f, why in (tel.get("null_reasons") or {}).items():
        console.print(f"  {f}: null - {why}", markup=False, highlight=False)


def write_compare_csv(out: dict, path: str) -> None:
    import csv
    import io

    from common.outdir import write_text_atomic

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["id", "probe", "label", "unit", "higher_is_better", "run_index", "run_dir", "device", "value",
                "speed_ratio", "regression_pct", "flagged", "spread", "contended"])
    for f in out["figures"]:
        for i, run in enumerate(out["runs"]):
            if f["values"][i] is None:
                continue
            w.writerow([f["id"], f["probe"], f["label"], f["unit"], f["higher_is_better"], i, run["run_dir"],
                        run["device"]["text"], f"{f['values'][i]:.6g}", f"{f['speed_ratio'][i]:.6g}",
                        f"{f['regression_pct'][i]:.4g}", f["flagged"][i], f"{f['spread'][i]:.4g}", f["contended"][i]])
    if path == "-":
        sys.stdout.write(buf.getvalue())
    else:
        write_text_atomic(path, buf.getvalue())


def contention_text(c: dict) -> str:
    """One run's contention in words, for `compare`'s run lines."""
    if c.get("contended"):
        return f"CONTENDED: taken under contention ({c['reason']})"
    if c.get("num_cpus") is None:
        return "contention not judged (not a CPU run)"
    load = "-" if c.get("load_1m_max") is None else f"{c['load_1m_max']:.1f}"
    share = "" if c.get("worst_cpu_share") is None else f", lowest probe CPU share {c['worst_cpu_share']:.0%}"
    return f"quiet (1-minute load up to {load} on {c['num_cpus']} CPUs{share})"


def compare_table(out: dict, show_all: bool, width: int):
    """`compare`'s table (flagged figures, or all with ``show_all``) for a ``width``-column output."""
    rows = [f for f in out["figures"] if show_all or any(f["flagged"][1:])]
    tainted = sum(any(f["contended"][1:]) for f in rows)
    cols = [Col("figure", wrap=True), Col("unit", drop=1), Col("baseline", "right")]
    for i in range(1, len(out["runs"])):
        cols += [Col(f"run {i}", "right"), Col("ratio", "right")]
    cells = []
    for f in rows:
        row = [f["label"], f["unit"], f"{f['values'][0]:.4g}"]
        for i in range(1, len(out["runs"])):
            v = f["values"][i]
            mark = (" *" if f["flagged"][i] else "") + (" c" if f["contended"][i] else "")
            row += ["-" if v is None else f"{v:.4g}", "-" if v is None else f"{f['speed_ratio'][i]:.3f}{mark}"]
        cells.append(row)
    title = (f"{'all matched figures' if show_all else 'flagged figures'} ({len(rows)} of {len(out['figures'])} "
             f"matched{f'; {tainted} involve a contended run, marked c' if tainted else ''})")
    return table(cols, cells, width=width, title=title)


def print_compare(out: dict, args, con=None) -> None:
    """`compare`'s output: each run's device and contention, the figures table, what is unmatched,
    the gate's verdict (on ``con``, default a console of the terminal's width)."""
    con = con or console()
    for i, r in enumerate(out["runs"]):
        d = r["device"]
        con.print(f"{'run 0' if i == 0 else f'run {i}'}{' (baseline)' if i == 0 else ''} = {r['run_dir']}  "
                  f"({d['text']}; sku {d['sku']}, host {d['host']}) - {contention_text(r['contention'])}",
                  highlight=False, markup=False)
    bad = [str(i) for i, r in enumerate(out["runs"]) if r["contention"]["contended"]]
    if bad:
        con.print(f"c: the ratio involves a run taken under contention (run {', '.join(bad)}): it measures the other "
                  "work on that machine as much as any change, so read no change from it; re-take that run on a "
                  "quiet machine", style="bold red", highlight=False, markup=False)
    con.print("speed ratio = run / baseline (> 1: faster; rates divide, times invert); flagged when |ratio - 1| > "
              "the larger (p80 - p20)/median spread of the two rows", highlight=False)
    con.print(compare_table(out, args.all, con.width))
    for u in out["unmatched"]:
        if u["num_unmatched"]:
            con.print(f"{u['run_dir']}: {u['num_unmatched']} of {u['num_figures']} figures have no match",
                      highlight=False, markup=False)
    if out["regressions"]:
        worst = sorted(out["regressions"], key=lambda r: -r["regression_pct"])
        con.print(f"FAIL: {len(worst)} figure(s) more than {out['fail_above_pct']:g} % worse than the baseline: "
                  + "; ".join(f"{r['label']} {r['regression_pct']:+.1f} % ({r['run_dir']}"
                              f"{', contended' if r.get('contended') else ''})" for r in worst[:5]),
                  highlight=False, markup=False)


SKU_COLUMNS = (Col("id", keep=True), Col("name", wrap=True, drop=5), Col("SMs", "right"), Col("clock MHz", "right"),
               Col("bf16 TF/s", "right"), Col("fp8 TF/s", "right", drop=3), Col("mem GB", "right"),
               Col("BW GB/s", "right"), Col("L2 MB", "right", drop=4), Col("s_floor ms", "right", drop=2),
               Col("droop", "right", drop=1))


def skus_table(entries, width: int):
    """`gpubench skus`' table of SKU entries (gpubench.skus.SKU) for a ``width``-column output."""
    rows = []
    for s in entries:
        bf16 = s.peak_flops("bf16") / 1e12 if "bf16" in s.fma_per_tc_per_clk else None
        fp8 = s.peak_flops("fp8") / 1e12 if "fp8" in s.fma_per_tc_per_clk else None
        if s.backend == "cpu":
            bf16 = s.peak_flops("fp32") / 1e12
        rows.append([s.id, s.name + (" [fp32 vector]" if s.backend == "cpu" else ""), str(s.sm_count),
                     f"{s.spec_clock_mhz:.0f}", _f(bf16, 1 if s.backend != "cpu" else 4), _f(fp8, 1),
                     f"{s.memory_gb:.0f}", _f(s.memory_bw_gbs, 0), f"{s.l2_mb:.0f}", _f(s.s_floor_ms, 2),
                     _f(s.clock_droop, 3)])
    return table(SKU_COLUMNS, rows, width=width,
                 title="gpubench SKU table (dense spec peaks; device properties are read at run time)")


def _f(v, nd):
    return "-" if v is None else f"{v:.{nd}f}"
