"""What the bench commands print and write: `run`'s and `show`'s summary table, `compare`'s tables
and CSV, and the strict JSON of `run --json` and `compare --json` (NaN and infinities as null).

Apart from ``bench_cli`` (the parsers and what each command does) because this is only rendering:
it takes the summaries ``gpubench.report`` and ``gpubench.compare`` return and lays them out.
"""
from __future__ import annotations

import sys


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


def print_summary(s, console) -> None:
    from rich.table import Table

    console.print(f"[bold]{s.run_dir}[/bold]  sku={s.sku}  device={s.device}  created={s.created_utc}")
    c = s.contention or {}
    if c.get("contended"):
        console.print(f"CONTENDED: this run was taken under contention ({c['reason']}); {c['rows_flagged']} of "
                      f"{c['rows_judged']} judged rows got under {c['min_cpu_share']:.0%} of the CPU they asked for "
                      "(figures from them marked !): its figures measure the other work as much as this machine; "
                      "re-run it on a quiet machine", style="bold red", markup=False, highlight=False)
    t = Table(title="headline figures (best = min time; range over repetitions, first discarded)")
    for col in ("probe", "figure", "best", "median", "unit", "min..max", "CV", "n", "% of"):
        t.add_column(col, justify="left" if col in ("probe", "figure", "unit", "% of") else "right")
    for h in s.headlines:
        rng = f"{_fmt(h.lo)}..{_fmt(h.hi)}" if h.lo is not None else "-"
        pct = f"{h.pct:.1f} % of {h.pct_of}" if h.pct is not None else ""
        if h.note:
            pct = f"{pct}; {h.note}" if pct else h.note
        t.add_row(h.probe, h.label + (" !" if h.contended else ""), _fmt(h.value), _fmt(h.median), h.unit, rng,
                  f"{100 * h.cv:.1f} %" if h.cv is not None else "-", str(h.n or "-"), pct)
    console.print(t)
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


def print_compare(out: dict, args) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 140))
    for i, r in enumerate(out["runs"]):
        d = r["device"]
        con.print(f"{'run 0' if i == 0 else f'run {i}'}{' (baseline)' if i == 0 else ''} = {r['run_dir']}  "
                  f"({d['text']}; sku {d['sku']}, host {d['host']}) - {contention_text(r['contention'])}",
                  highlight=False, markup=False, soft_wrap=True)
    bad = [str(i) for i, r in enumerate(out["runs"]) if r["contention"]["contended"]]
    if bad:
        con.print(f"c: the ratio involves a run taken under contention (run {', '.join(bad)}): it measures the other "
                  "work on that machine as much as any change, so read no change from it; re-take that run on a "
                  "quiet machine", style="bold red", highlight=False, markup=False)
    con.print("speed ratio = run / baseline (> 1: faster; rates divide, times invert); flagged when |ratio - 1| > "
              "the larger (p80 - p20)/median spread of the two rows", highlight=False)
    rows = [f for f in out["figures"] if args.all or any(f["flagged"][1:])]
    tainted = sum(any(f["contended"][1:]) for f in rows)
    t = Table(title=f"{'all matched figures' if args.all else 'flagged figures'} ({len(rows)} of "
                    f"{len(out['figures'])} matched{f'; {tainted} involve a contended run, marked c' if tainted else ''})")
    t.add_column("figure")
    t.add_column("unit")
    t.add_column("baseline", justify="right")
    for i in range(1, len(out["runs"])):
        t.add_column(f"run {i}", justify="right")
        t.add_column("ratio", justify="right")
    for f in rows:
        cells = [f["label"], f["unit"], f"{f['values'][0]:.4g}"]
        for i in range(1, len(out["runs"])):
            v = f["values"][i]
            mark = (" *" if f["flagged"][i] else "") + (" c" if f["contended"][i] else "")
            cells += ["-" if v is None else f"{v:.4g}", "-" if v is None else f"{f['speed_ratio'][i]:.3f}{mark}"]
        t.add_row(*cells)
    con.print(t)
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
