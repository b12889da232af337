"""`gpubench show RUN --plots`: PNG plots of a run's sweeps (matplotlib, imported here only).

One file per plot that the run has rows for, each written atomically:

- ``bandwidth.png``: GB/s at the median repetition vs working set, STREAM kernels (3 arrays, or 2
  for copy/scale) and the l2 warm/cold sweep, with the cache sizes of the device marked;
- ``gemm.png``: TFLOP/s vs M, one line per GEMM shape and dtype;
- ``launch.png``: seconds per launch vs the number of launches, one line per kind;
- ``torch_linear.png``: the torch_ops probe's streaming linear GB/s vs M, one line per (N, K).
"""
from __future__ import annotations

import io
from pathlib import Path

from common.outdir import write_bytes_atomic
from gpubench.compare import describe_device
from gpubench.report import valid_rows
from gpubench.results import Run

STREAM_ARRAYS = {"copy": 2, "scale": 2, "add": 3, "triad": 3}


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    return plt, fig, ax


def _save(plt, fig, ax, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return write_bytes_atomic(path, buf.getvalue())


def _bandwidth(run: Run, out: Path, title: str):
    stream, l2 = run.frames.get("stream"), run.frames.get("l2")
    stream = valid_rows(stream) if stream is not None else None
    l2 = valid_rows(l2) if l2 is not None else None
    if (stream is None or not len(stream)) and (l2 is None or not len(l2)):
        return None
    plt, fig, ax = _figure()
    if stream is not None and len(stream):
        for kernel, g in stream.groupby("kernel", sort=False):
            g = g.sort_values("array_bytes")
            ws = g["array_bytes"] * STREAM_ARRAYS.get(kernel, 3)
            ax.plot(ws, g["bytes"] / g["t_median_s"] / 1e9, marker="o", label=f"STREAM {kernel}")
    if l2 is not None and len(l2):
        for mode, g in l2.groupby("mode", sort=False):
            ws = g["key"].str.rsplit("_", n=1).str[-1].astype(float)
            order = ws.argsort()
            ax.plot(ws.iloc[order], (g["bytes"] / g["t_median_s"] / 1e9).iloc[order], marker=".", linestyle="--",
                    label=f"l2 {mode}")
    dev = describe_device(run.manifest)
    for name, size in dev["caches"].items():
        if not name.endswith("i"):
            ax.axvline(size, color="grey", linewidth=0.8, linestyle=":")
            ax.text(size, ax.get_ylim()[1], f" {name}", fontsize=7, va="top", color="grey")
    ax.set_xscale("log", base=2)
    return _save(plt, fig, ax, out / "bandwidth.png", f"bandwidth vs working set\n{title}", "working set (bytes)",
                 "GB/s (median repetition)")


def _gemm(run: Run, out: Path, title: str):
    df = run.frames.get("gemm")
    if df is None:
        return None
    df = valid_rows(df)
    if not len(df) or "m" not in df:
        return None
    plt, fig, ax = _figure()
    shape = df["shape"] if "shape" in df else df["n"].astype(int).astype(str)
    # a square shape grows N and K with M: one line per dtype; other shapes: one per (N, K)
    square = shape == "square"
    nk = (df["n"].astype(int).astype(str) + "x" + df["k"].astype(int).astype(str)).where(~square, "M")
    styles: dict[str, str] = {}
    for (sh, dt, dims), g in df.assign(_shape=shape, _nk=nk).groupby(["_shape", "dtype", "_nk"], sort=False):
        g = g.sort_values("m")
        label = f"{sh} {dt} (M=N=K)" if dims == "M" else f"{sh} {dt} NxK={dims}"
        ax.plot(g["m"], g["flops"] / g["t_median_s"] / 1e12, marker="o", label=label,
                linestyle=styles.setdefault(dt, ("-", "--", ":", "-.")[len(styles) % 4]))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    return _save(plt, fig, ax, out / "gemm.png", f"GEMM throughput vs M\n{title}", "M (rows)",
                 "TFLOP/s (median repetition)")


def _launch(run: Run, out: Path, title: str):
    df = run.frames.get("launch")
    if df is None:
        return None
    df = valid_rows(df)
    if not len(df) or "count" not in df:
        return None
    plt, fig, ax = _figure()
    for kind, g in df.groupby("kind", sort=False):
        g = g.sort_values("count")
        ax.plot(g["count"], g["t_median_s"] / g["count"] * 1e6, marker="o", label=str(kind))
    ax.set_xscale("log")
    ax.set_yscale("log")
    return _save(plt, fig, ax, out / "launch.png", f"launch / dispatch cost\n{title}", "launches per repetition",
                 "us per launch (median repetition)")


def _torch_linear(run: Run, out: Path, title: str):
    df = run.frames.get("torch_ops")
    if df is None or "family" not in df:
        return None
    df = valid_rows(df)
    df = df[df["family"] == "linear"]
    if not len(df):
        return None
    plt, fig, ax = _figure()
    for (dt, n, k), g in df.groupby(["dtype", "n", "k"], sort=False):
        # a cell timed in several passes is drawn at its median pass, as the fit takes it
        gbps = (g["bytes"] / g["t_median_s"] / 1e9).groupby(g["m"]).median().sort_index()
        ax.plot(gbps.index, gbps.to_numpy(), marker=".", label=f"{dt} N={int(n)} K={int(k)}")
    ax.set_xscale("log", base=2)
    return _save(plt, fig, ax, out / "torch_linear.png", f"torch linear (streaming) GB/s vs M\n{title}", "M (rows)",
                 "GB/s (median repetition)")


def write_plots(run: Run, out_dir: str | Path | None = None) -> list[Path]:
    """Write every plot the run has rows for into ``out_dir`` (default: the run directory)."""
    out = Path(out_dir) if out_dir is not None else Path(run.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = describe_device(run.manifest)
    title = dev["text"]
    written = []
    for fn in (_bandwidth, _gemm, _launch, _torch_linear):
        path = fn(run, out, title)
        if path is not None:
            written.append(path)
    return written
