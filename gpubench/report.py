"""What `gpubench show` prints: headline figures per probe, spread, telemetry.

Pure functions of loaded runs (``gpubench.results.Run``) returning dataclasses / dicts; the CLI
renders them. Rows with ``valid=false`` are never used as figures: they are counted and listed.
A run taken under contention says so (``contention``, gpubench.contention) and each headline from
a row that got under its share of the CPU is marked (``contended``).
Matching figures across runs (`gpubench compare`) is ``gpubench.compare``'s.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from gpubench.contention import judge_run
from gpubench.results import Run


@dataclass
class Headline:
    """One headline figure. ``value`` is in ``unit``; ``lo``..``hi`` is the range over repetitions."""

    probe: str
    label: str
    value: float
    unit: str
    key: str
    median: float | None = None
    lo: float | None = None
    hi: float | None = None
    cv: float | None = None
    n: int | None = None
    pct: float | None = None
    pct_of: str | None = None
    note: str | None = None
    contended: bool = False  # the row got under MIN_CPU_SHARE of its CPU (gpubench.contention)


@dataclass
class RunSummary:
    run_dir: str
    sku: str
    device: str
    created_utc: str | None
    headlines: list = field(default_factory=list)
    probes: dict = field(default_factory=dict)  # name -> {status, reason, num_rows, num_invalid, wall_s}
    invalid: list = field(default_factory=list)  # "probe/key: reason"
    telemetry: dict = field(default_factory=dict)
    contention: dict = field(default_factory=dict)  # gpubench.contention.Contention.to_dict()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headlines"] = [asdict(h) for h in self.headlines]
        return d


def valid_rows(df):
    """The rows a figure or a fit may use: those whose golden-value check passed (all rows when the
    frame has no ``valid`` column; a row with no value there never passed a check, so it is left out)."""
    if df is None or len(df) == 0 or "valid" not in df.columns:
        return df
    return df[df["valid"].fillna(False).astype(bool)]


def _rate(row, work_field: str, scale: float, unit: str, probe: str, label: str, **kw) -> Headline:
    """Headline from a row's work (bytes/flops) and its times: best = min time, range over reps."""
    work = float(row[work_field])
    return Headline(probe=probe, label=label, value=work / row["t_min_s"] / scale, unit=unit, key=row["key"],
                    median=work / row["t_median_s"] / scale, lo=work / row["t_max_s"] / scale,
                    hi=work / row["t_min_s"] / scale, cv=float(row["cv"]), n=int(row["n_reps"]), **kw)


def _stream(df) -> list[Headline]:
    out = []
    top = df["n_elements"].max()
    for kernel in ("copy", "scale", "add", "triad"):
        sel = df[(df["kernel"] == kernel) & (df["n_elements"] == top)]
        if len(sel):
            r = sel.iloc[0]
            out.append(_rate(r, "bytes", 1e9, "GB/s", "stream", f"{kernel} (best; {r['array_bytes'] / 2**20:.0f} MiB arrays)"))
    return out


def _l2(df) -> list[Headline]:
    out = []
    for mode in ("warm", "cold"):
        sel = df[df["mode"] == mode]
        if not len(sel):
            continue
        best = sel.loc[sel["gbps_best"].idxmax()]
        out.append(_rate(best, "bytes", 1e9, "GB/s", "l2", f"{mode} max (at {size_text(best['working_set_bytes'])})"))
        last = sel.loc[sel["working_set_bytes"].idxmax()]
        out.append(_rate(last, "bytes", 1e9, "GB/s", "l2", f"{mode} at {size_text(last['working_set_bytes'])}"))
    return out


def _launch(df) -> list[Headline]:
    out = []
    for kind in df["kind"].drop_duplicates():
        sel = df[df["kind"] == kind]
        r = sel.loc[sel["count"].idxmax()]
        c = float(r["count"])
        out.append(Headline(probe="launch", label=f"{kind} (median, x{int(c)})", value=r["t_median_s"] / c * 1e6,
                            unit="us", key=r["key"], median=r["t_median_s"] / c * 1e6, lo=r["t_min_s"] / c * 1e6,
                            hi=r["t_max_s"] / c * 1e6, cv=float(r["cv"]), n=int(r["n_reps"])))
    return out


def _peak(df) -> list[Headline]:
    out = []
    for _, r in df.iterrows():
        if r.get("unit") == "dependent_add":
            out.append(Headline(probe="peak", label="core clock (dependent adds, best)", value=r["clock_mhz_measured"],
                                unit="MHz", key=r["key"], median=r.get("clock_mhz_median"), cv=float(r["cv"]),
                                n=int(r["n_reps"]), pct=100 * r["clock_mhz_measured"] / r["clock_mhz_reported"],
                                pct_of=f"reported {r['clock_mhz_reported']:.0f} MHz"))
            continue
        spec = _num(r.get("spec_tflops"))
        formula = r.get("spec_formula") if isinstance(r.get("spec_formula"), str) else None
        pct_of = None
        if spec:
            pct_of = f"spec {spec * 1e3:,.1f} GFLOP/s" + (f" = {formula}" if formula else "")
        h = _rate(r, "flops", 1e9, "GFLOP/s", "peak", f"{r.get('unit', 'peak')} {r['dtype']} (best)",
                  pct=100 * r["tflops_best"] / spec if spec else None, pct_of=pct_of)
        if _num(r.get("pct_of_measured_clock_peak")) is not None:
            h.note = (f"{r['pct_of_measured_clock_peak']:.1f} % of the peak at the measured clock "
                      f"{r['clock_mhz_measured']:.0f} MHz")
            if _num(r.get("thread_sum_tflops_best")) is not None:
                h.note += (f" (per-thread best, summed: {r['thread_sum_tflops_best'] * 1e3:,.1f} GFLOP/s = "
                           f"{100 * r['thread_sum_tflops_best'] / r['measured_clock_tflops']:.1f} %)")
        out.append(h)
    return out


def _num(v) -> float | None:
    """A finite float, or None for missing/NaN (pandas fills absent fields with NaN)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _gemm(df, peaks: dict) -> list[Headline]:
    out = []
    shape = df["shape"] if "shape" in df else df.get("shape_source", "")
    for dtype in df["dtype"].drop_duplicates():
        sel = df[df["dtype"] == dtype]
        best = sel.loc[sel["tflops_best"].idxmax()]
        pk, what = peaks.get(dtype, (None, None))
        out.append(_rate(best, "flops", 1e9, "GFLOP/s", "gemm",
                         f"{dtype} best ({best.get('shape', best.get('shape_source', '?'))} M={best['m']})",
                         pct=100 * best["tflops_best"] * 1e3 / pk if pk else None, pct_of=what))
        dec = sel[(shape[sel.index] != "square") & (sel["m"] == sel["m"].min())]
        if len(dec) and "bytes" in dec:
            r = dec.loc[dec["bytes"].idxmax()]
            out.append(_rate(r, "bytes", 1e9, "GB/s", "gemm",
                             f"{dtype} decode {r.get('shape', '')} M={r['m']} (weights streamed)"))
    return out


def _torch_ops(df) -> list[Headline]:
    """torch_ops: the streaming rate of a decode-shaped linear (M = 1, largest weight), the decode
    attention of the largest cache, and one cold RMSNorm row (the fixed cost small ops pay in a step)."""
    out = []
    lin = df[(df["family"] == "linear") & (df["m"] == df.loc[df["family"] == "linear", "m"].min())] if "m" in df else df[:0]
    if len(lin):
        r = lin.loc[lin["weight_bytes"].idxmax()]
        out.append(_rate(r, "bytes", 1e9, "GB/s", "torch_ops",
                         f"linear M={int(r['m'])} N={int(r['n'])} K={int(r['k'])} (weights streamed, torch)"))
    dec = df[df["family"] == "attn_decode"]
    if len(dec):
        r = dec.loc[dec["bytes"].idxmax()]
        out.append(_rate(r, "bytes", 1e9, "GB/s", "torch_ops",
                         f"decode SDPA B={int(r['batch'])} L={int(r['context'])} H={int(r['heads'])}/{int(r['kv_heads'])} (KV read)"))
    seg = df[(df["family"] == "segment") & (df.get("segment") == "rmsnorm") & (df.get("rows") == 1)] if "segment" in df else df[:0]
    if len(seg):
        r = seg.loc[seg["context_elements"].idxmax()] if "context_elements" in seg else seg.iloc[0]
        out.append(Headline(probe="torch_ops", label=f"RMSNorm of 1 row x {int(r['width'])}, after a streaming GEMV",
                            value=r["t_median_s"] * 1e6, unit="us", key=r["key"], median=r["t_median_s"] * 1e6,
                            lo=r["t_min_s"] * 1e6, hi=r["t_max_s"] * 1e6, cv=float(r["cv"]), n=int(r["n_reps"])))
    return out


def _vllm_ops(df) -> list[Headline]:
    """vllm_ops: vLLM's oneDNN linear streaming a decode-shaped weight (M = 1, largest weight), and
    what 4 rows cost against 1 on that weight (the ratio that sets vLLM's decode batches apart)."""
    lin = df[df["family"] == "linear"] if "family" in df else df[:0]
    if not len(lin):
        return []
    big = lin[lin["weight_bytes"] == lin["weight_bytes"].max()]
    one = big[big["m"] == big["m"].min()]
    r = one.iloc[0]
    out = [_rate(r, "bytes", 1e9, "GB/s", "vllm_ops",
                 f"linear M={int(r['m'])} N={int(r['n'])} K={int(r['k'])} (weights streamed, vLLM oneDNN)")]
    four = big[big["m"] == 4]
    if len(four) and int(r["m"]) == 1:
        ratio = float(four["t_median_s"].iloc[0] / r["t_median_s"])
        out.append(Headline(probe="vllm_ops", label=f"M=4 / M=1 time, N={int(r['n'])} K={int(r['k'])}",
                            value=ratio, unit="x", key=four["key"].iloc[0], median=ratio))
    return out


def summarize_run(run: Run) -> RunSummary:
    m = run.manifest
    s = RunSummary(run_dir=str(run.run_dir), sku=m["sku"], device=m.get("device", {}).get("name", "?"),
                   created_utc=m.get("created_utc"))
    for name, entry in m["probes"].items():
        s.probes[name] = {k: entry.get(k) for k in ("status", "reason", "num_rows", "num_invalid", "wall_s", "notes")
                          if entry.get(k) is not None}
    peaks = {}  # dtype -> (GFLOP/s, what it is): the FMA peak at the measured clock, else the spec
    if "peak" in run.frames:
        pk = valid_rows(run.frames["peak"])
        for _, r in pk.iterrows():
            ref = _num(r.get("measured_clock_tflops"))
            if ref:
                peaks[r["dtype"]] = (ref * 1e3, f"fma peak at the measured clock {r['clock_mhz_measured']:.0f} MHz")
            elif _num(r.get("spec_tflops")):
                peaks[r["dtype"]] = (r["spec_tflops"] * 1e3, "spec peak")
    for probe, df in run.frames.items():
        if "valid" in df:
            for _, r in df[~df["valid"].astype(bool)].iterrows():
                s.invalid.append(f"{probe}/{r['key']}: {r.get('invalid_reason', 'invalid')}")
        good = valid_rows(df)
        if not len(good) or "t_min_s" not in good:
            continue
        fn = {"stream": _stream, "l2": _l2, "launch": _launch, "peak": _peak, "torch_ops": _torch_ops,
              "vllm_ops": _vllm_ops}.get(probe)
        if fn:
            s.headlines += fn(good)
        elif probe == "gemm":
            s.headlines += _gemm(good, peaks)
    s.telemetry = telemetry_summary(run)
    judged = judge_run(run)
    s.contention = judged.to_dict()
    for h in s.headlines:
        h.contended = judged.is_flagged(h.probe, h.key)
    return s


def telemetry_summary(run: Run) -> dict:
    """Clock range, low-clock share, energy and null reasons over every row of the run."""
    clocks: list[float] = []
    lows: list[float] = []
    energy: list[float] = []
    utils: list[float] = []
    samples = 0
    for df in run.frames.values():
        for col, acc in (("clock_mhz_mean", clocks), ("low_clock_frac", lows), ("energy_j", energy),
                         ("proc_cpu_util", utils)):
            if col in df:
                acc += [float(v) for v in df[col] if v is not None and not (isinstance(v, float) and math.isnan(v))]
        if "telemetry_samples" in df:
            samples += int(df["telemetry_samples"].fillna(0).sum())
    t = run.manifest.get("telemetry", {})
    droop = None
    if run.backend == "cuda" and "gemm" in run.frames:
        from gpubench.telemetry_nvml import clock_droop

        droop = clock_droop(run.frames["gemm"])
    return {
        "droop": None if droop is None else droop.droop,
        "droop_detail": None if droop is None else (
            droop.reason or f"1 - {droop.mean_clock_mhz:.0f} / {droop.max_clock_mhz:.0f} MHz over {droop.num_rows} GEMM rows"),
        "source": t.get("source"),
        "clock_source": t.get("clock_source"),
        "clock_mhz_mean": float(np.mean(clocks)) if clocks else None,
        "clock_mhz_min": float(np.min(clocks)) if clocks else None,
        "clock_mhz_max": float(np.max(clocks)) if clocks else None,
        "low_clock_frac_mean": float(np.mean(lows)) if lows else None,
        "energy_j_total": float(np.sum(energy)) if energy else None,
        "samples": samples,
        "proc_cpu_util_median": float(np.median(utils)) if utils else None,
        "loadavg_at_start": t.get("loadavg_at_start"),
        "null_reasons": t.get("null_reasons", {}),
        "note": t.get("clock_note"),
    }


_KIB, _MIB = 1024, 1024 * 1024


def size_text(b: float) -> str:
    """A byte count in KiB, or in MiB from 1 MiB up (4 significant digits)."""
    return f"{b / _MIB:.4g} MiB" if b >= _MIB else f"{b / _KIB:.4g} KiB"
