"""What `gpubench compare` matches: every figure of a run identified by what was measured (probe,
kernel, dtype, size relative to the cache), and the figures of N runs against the first.

Apart from ``gpubench.report`` (one run's headlines) because matching is its own rule set: figure
ids that hold across machines, the device a run measured on, speed ratios and the spread that
flags a change. Pure functions of loaded runs, like the report; the CLI renders them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gpubench.contention import judge_run
from gpubench.report import size_text, valid_rows
from gpubench.results import Run


def cache_bytes(device: dict) -> tuple[int | None, str]:
    """The last-level cache the sweeps are sized from, and its name: the CPU's LLC, a GPU's L2."""
    props = device.get("properties") or {}
    if props.get("llc_bytes"):
        return int(props["llc_bytes"]), "LLC"
    if props.get("l2_bytes"):
        return int(props["l2_bytes"]), "L2"
    return None, "LLC"


def describe_device(manifest: dict) -> dict:
    """What a run measured on: name, backend, cores (CPU cores or GPU SMs) and caches, as a dict
    with a one-line ``text``."""
    dev = manifest.get("device") or {}
    props = dev.get("properties") or {}
    backend = dev.get("backend")
    if backend == "cpu":
        model = props.get("model_name") or dev.get("name")
        cores = props.get("num_physical_cores") or props.get("num_cpus")
        caches = {f"L{c['level']}{'d' if c.get('kind') == 'Data' else 'i' if c.get('kind') == 'Instruction' else ''}":
                  int(c["size_bytes"]) for c in props.get("caches") or [] if c.get("size_bytes")}
        cores_text = f"{cores} cores ({props.get('num_cpus')} CPUs)" if cores else "cores unknown"
    else:
        model = dev.get("name")
        cores = props.get("sm_count")
        caches = {"L2": int(props["l2_bytes"])} if props.get("l2_bytes") else {}
        cores_text = f"{cores} SMs" if cores else "SMs unknown"
    cache_text = ", ".join(f"{k} {size_text(v)}" for k, v in caches.items()) or "caches unknown"
    return {"backend": backend, "name": model, "cores": cores, "caches": caches, "sku": manifest.get("sku"),
            "host": manifest.get("host"), "created_utc": manifest.get("created_utc"),
            "text": f"{model}, {cores_text}, {cache_text}"}


@dataclass
class Figure:
    """One measured figure of a row, identified by what was measured (not by its raw key)."""

    id: str
    probe: str
    label: str
    value: float
    unit: str
    higher_is_better: bool
    spread: float  # (p80 - p20) / median of the row's repetitions


def _spread(r) -> float:
    return float((r["t_p80_s"] - r["t_p20_s"]) / r["t_median_s"]) if r["t_median_s"] > 0 else 0.0


def _rel(b: float, cache: int | None, name: str) -> tuple[str, str]:
    """(id part, label part) of a size relative to the cache: '4x LLC'."""
    if not cache:
        return f"{int(b)}B", size_text(b)
    rel = b / cache
    return f"{round(math.log2(rel), 1):+.1f}", f"{rel:.3g}x {name}"


def row_figures(probe: str, df, device: dict) -> list[Figure]:
    """The figures of a probe's valid rows: rates at the median time (GB/s, TFLOP/s) or times.

    STREAM rows are matched by kernel, dtype and array size relative to the cache the sweep is
    sized from (their byte sizes derive from each machine's cache); l2 rows by mode and working set
    (the sweep's sizes are absolute); gemm by dtype, shape and M x N x K; launch by kind and count;
    peak by dtype and unit; other probes by key.
    """
    cache, cname = cache_bytes(device)
    out = []
    for _, r in valid_rows(df).iterrows():
        if "t_median_s" not in r or not (r["t_median_s"] > 0):
            continue
        t, spread = float(r["t_median_s"]), _spread(r)
        key = str(r["key"])
        if probe == "stream" and "array_bytes" in r:
            rid, rlab = _rel(float(r["array_bytes"]), cache, cname)
            out.append(Figure(f"stream/{r['kernel']}/{r['dtype']}/{rid}", probe,
                              f"STREAM {r['kernel']} {r['dtype']} at {rlab}", float(r["bytes"]) / t / 1e9, "GB/s",
                              True, spread))
        elif probe == "l2" and key.startswith("l2_"):
            mode, dtype, ws = key.split("_")[1:4]
            out.append(Figure(f"l2/{mode}/{dtype}/{ws}", probe, f"l2 {mode} {dtype} {size_text(int(ws))}",
                              float(r["bytes"]) / t / 1e9, "GB/s", True, spread))
        elif probe == "gemm" and {"m", "n", "k", "flops"} <= set(r.index):
            mnk = f"{int(r['m'])}x{int(r['n'])}x{int(r['k'])}"
            out.append(Figure(f"gemm/{r['dtype']}/{r.get('shape', '')}/{mnk}", probe,
                              f"GEMM {r['dtype']} {r.get('shape', '')} {mnk}", float(r["flops"]) / t / 1e12,
                              "TFLOP/s", True, spread))
        elif probe == "launch" and "count" in r:
            out.append(Figure(f"launch/{r['kind']}/{int(r['count'])}", probe,
                              f"launch {r['kind']} x{int(r['count'])} (per launch)", t / int(r["count"]) * 1e6, "us",
                              False, spread))
        elif probe == "peak" and "flops" in r:
            out.append(Figure(f"peak/{r['dtype']}/{r.get('unit', '')}", probe, f"peak {r['dtype']} {r.get('unit', '')}",
                              float(r["flops"]) / t / 1e12, "TFLOP/s", True, spread))
        else:
            out.append(Figure(f"{probe}/{key}", probe, key, t * 1e6, "us", False, spread))
    return [f for f in out if math.isfinite(f.value) and f.value > 0]


def run_figures(run: Run) -> dict:
    """id -> Figure over every probe of a run (the first row of an id wins)."""
    out: dict[str, Figure] = {}
    for probe in sorted(run.frames):
        for f in row_figures(probe, run.frames[probe], run.manifest.get("device") or {}):
            out.setdefault(f.id, f)
    return out


def regression_pct(base: float, value: float, higher_is_better: bool) -> float:
    """How much worse ``value`` is than ``base``, in % of ``base`` (negative: better)."""
    return 100.0 * ((base - value) if higher_is_better else (value - base)) / base


def compare_runs(runs: list) -> dict:
    """Every figure of the first run (the baseline) matched in the others by what was measured.

    Per figure and run: the value, ``speed_ratio`` (> 1: faster than the baseline; value / base for
    rates, base / value for times), ``regression_pct`` (how much worse, in % of the baseline) and
    ``flagged`` (|ratio - 1| larger than either row's (p80 - p20) / median spread). Invalid rows
    are left out; figures the baseline lacks or no other run has are counted, not compared.
    Each run says whether it was taken under contention (``contention``, gpubench.contention), and
    each figure's ``contended`` says, per run, whether its ratio involves a contended run (that run
    or the baseline): such a ratio measures the other work on the machine as much as a change.
    """
    figs = [run_figures(r) for r in runs]
    devices = [describe_device(r.manifest) for r in runs]
    judged = [judge_run(r) for r in runs]
    involves = [judged[0].contended or j.contended for j in judged]
    ident = [(d["backend"], d["name"], d["cores"], tuple(sorted(d["caches"].items()))) for d in devices]
    base = figs[0]
    figures = []
    for fid, f0 in base.items():
        others = [fs.get(fid) for fs in figs[1:]]
        if not any(others):
            continue
        entry = {"id": fid, "probe": f0.probe, "label": f0.label, "unit": f0.unit,
                 "higher_is_better": f0.higher_is_better, "values": [f0.value], "speed_ratio": [1.0],
                 "regression_pct": [0.0], "flagged": [False], "spread": [f0.spread], "contended": [involves[0]]}
        for i, f in enumerate(others, start=1):
            entry["contended"].append(involves[i])
            if f is None:
                for k in ("values", "speed_ratio", "regression_pct", "flagged", "spread"):
                    entry[k].append(None)
                continue
            ratio = (f.value / f0.value) if f0.higher_is_better else (f0.value / f.value)
            entry["values"].append(f.value)
            entry["speed_ratio"].append(ratio)
            entry["regression_pct"].append(regression_pct(f0.value, f.value, f0.higher_is_better))
            entry["flagged"].append(abs(ratio - 1) > max(f0.spread, f.spread))
            entry["spread"].append(f.spread)
        figures.append(entry)
    matched = {f["id"] for f in figures}
    return {
        "baseline": str(runs[0].run_dir),
        "runs": [{"run_dir": str(r.run_dir), "device": d, "contention": j.to_dict()}
                 for r, d, j in zip(runs, devices, judged)],
        "same_device": len(set(ident)) == 1,
        "any_contended": any(j.contended for j in judged),
        "figures": figures,
        "unmatched": [{"run_dir": str(r.run_dir), "num_figures": len(fs), "num_unmatched": len(set(fs) - matched)}
                      for r, fs in zip(runs, figs)],
    }
