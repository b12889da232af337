"""Step rows: real engine steps of a model built from a config, timed over a grid (the ground truth).

One engine step = input preparation (Python lists -> tensors) + forward + greedy sampling +
synchronize, timed on the host clock (``time.perf_counter``) around all four, as a serving
engine's step loop would see it (``wall_s``, the ground truth). The calling thread's CPU time
(``time.thread_time``) is kept too (``thread_cpu_s``): with one torch thread on a shared host it
is the step's cost without the time the OS gave other processes, so a reader can tell contention
from the step itself (``loadavg_1m_*`` is recorded for the same reason). Each grid point runs ``num_warmup`` untimed steps, then
``num_repeats`` timed ones; every repetition is kept and the row's headline is the median. The KV
cache is allocated and filled once before the grid (never timed) and only re-viewed per point.

For a subset of points the step is also run under ``torch.profiler``: op time is attributed to
the top-level aten op that issued it and grouped by kind (``linear``, ``attention``, ...). The sum
of those per-kind medians is the Vidur-style baseline (op time only, no host gaps between ops).

Rows are appended to a JSONL sidecar (``<out>.partial.jsonl``) and fsynced one at a time; an
interrupted run resumes by skipping keys already in the sidecar or in ``<out>``; at the end all
rows go to ``<out>`` as zstd-compressed parquet and the sidecar is removed. The grid and a row's
batch descriptors are predictor.profile_grid; the row files and keys predictor.profile_rows.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from common.errors import ConfigError, GpubenchError, NoDeviceError
from common.model_config import ModelConfig
from predictor.profile_grid import GRIDS, GridPoint, build_grid, point_features
from predictor.profile_ops import kernels_in, op_times_by_kind, quiet_stderr
from predictor.profile_rows import SCHEMA_VERSION, append_jsonl, read_rows, row_key, sidecar_path, wall_fields, write_parquet


# ----------------------------------------------------------------------------- running
@dataclass
class ProfileConfig:
    """What ``gpubench profile`` runs (one model on one device)."""
    model: str
    device: str = "cpu"
    dtype: str | None = None  # fp32 on CPU, bf16 on CUDA
    grid: str = "default"
    ops_subset: int = 16
    num_op_repeats: int = 3
    num_threads: int | None = None
    max_points: int | None = None
    seed: int = 0
    engine: str = "torch"      # torch: the eager loop; torch-graph: predictor.graph_model
    kernels: str = "auto"      # torch-graph: its fused kernels (auto, triton, torch)
    attention: str = "auto"    # torch-graph: its attention (auto, flash-varlen, sdpa)
    command: list[str] = field(default_factory=list)


def _resolve_device(device: str):
    import torch

    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise NoDeviceError(f"--device {device}: torch sees no CUDA device on this machine")
        dev = torch.device(device)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise NoDeviceError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
        return dev
    raise ConfigError(f"--device '{device}': use cpu, cuda or cuda:N")


def _device_name(dev) -> str:
    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return cpu_model_name()


def cpu_model_name() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), or what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


@dataclass
class _Session:
    """Model, cache and token ids for one profile run."""
    cfg: ModelConfig
    # torch objects (torch is imported lazily): the TorchModel, its KV cache and the torch.device
    model: Any
    cache: Any
    device: Any
    rng: np.random.Generator


def time_step(sess: _Session, point: GridPoint, *, num_warmup: int, num_repeats: int,
              min_time_s: float = 0.0, max_repeats: int | None = None) -> dict:
    """Warm up, then time engine steps of ``point``; every repetition is kept.

    At least ``num_repeats`` steps, more until ``min_time_s`` was timed (at most ``max_repeats``),
    so that millisecond steps on a noisy shared host get a median over many samples.
    """
    from predictor.torch_model import synchronize

    n_seq = len(point.batch)
    sess.cache.layout(n_seq, max(n + c for n, c in point.batch))
    sess.model.reserve(max(n + c for n, c in point.batch) + 1)
    # Token ids are drawn outside the timed region: an engine already holds them as Python ints.
    ids = [sess.rng.integers(0, sess.cfg.vocab_size, size=n).tolist() for n, _ in point.batch]
    cached = [c for _, c in point.batch]
    prep: list[float] = []
    fwd: list[float] = []
    samp: list[float] = []
    wall: list[float] = []
    cpu: list[float] = []
    max_repeats = max(num_repeats, max_repeats or num_repeats)
    rep = 0
    while rep < num_warmup + num_repeats or (sum(wall) < min_time_s and len(wall) < max_repeats):
        rep += 1
        c0 = time.thread_time()
        t0 = time.perf_counter()
        inp = sess.model.prepare(ids, cached)
        t1 = time.perf_counter()
        hidden = sess.model.forward(inp, sess.cache)
        synchronize(sess.device)
        t2 = time.perf_counter()
        nxt = sess.model.sample(hidden, inp.order)
        synchronize(sess.device)
        t3 = time.perf_counter()
        c3 = time.thread_time()
        if nxt.shape[0] != n_seq:  # a wrong-shaped step must never be reported as a timing
            raise GpubenchError(f"step returned {nxt.shape[0]} tokens for {n_seq} sequences")
        if rep > num_warmup:
            prep.append(t1 - t0)
            fwd.append(t2 - t1)
            samp.append(t3 - t2)
            wall.append(t3 - t0)
            cpu.append(c3 - c0)
    return {
        **wall_fields(wall), "prep_s": float(np.median(prep)), "forward_s": float(np.median(fwd)),
        "sampling_s": float(np.median(samp)), "forward_times_s": fwd, "sampling_times_s": samp,
        "thread_cpu_s": float(np.median(cpu)), "thread_cpu_times_s": cpu,
    }


def profile_ops(sess: _Session, point: GridPoint, *, num_repeats: int) -> dict:
    """Per-op-kind medians (s) of ``num_repeats`` profiled steps, and their sum (Vidur-style)."""
    import torch.profiler as tp

    from predictor.torch_model import synchronize

    ids = [sess.rng.integers(0, sess.cfg.vocab_size, size=n).tolist() for n, _ in point.batch]
    cached = [c for _, c in point.batch]
    acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if sess.device.type == "cuda" else [])
    per_rep: list[dict[str, float]] = []
    counts: list[int] = []
    cpu_over_wall = []
    for _ in range(num_repeats):
        with quiet_stderr(), tp.profile(activities=acts) as prof:
            c0, t0 = time.thread_time(), time.perf_counter()
            inp = sess.model.prepare(ids, cached)
            sess.model.sample(sess.model.forward(inp, sess.cache), inp.order)
            synchronize(sess.device)
            cpu_over_wall.append((time.thread_time() - c0) / (time.perf_counter() - t0))
        per_rep.append(op_times_by_kind(prof.events(), device_type=sess.device.type))
        counts.append(kernels_in(prof.events(), device_type=sess.device.type))
    kinds = sorted({k for r in per_rep for k in r})
    med = {k: float(np.median([r.get(k, 0.0) for r in per_rep])) for k in kinds}
    op_sum_s = float(sum(med.values()))
    # NOTE: profiler op times are host-clock intervals, so on a shared CPU they include time the OS
    # gave other processes. Scaling by the profiled steps' CPU/wall ratio puts them on the same
    # footing as ``thread_cpu_s`` (preemption lands on ops and gaps in proportion to their time).
    ratio = float(np.median(cpu_over_wall)) if sess.device.type == "cpu" else float("nan")
    return {"ops_profiled": True, "ops_json": json.dumps(med), "op_sum_s": op_sum_s,
            "op_sum_cpu_s": op_sum_s * ratio, "op_profile_cpu_over_wall": ratio, "num_op_repeats": num_repeats,
            "kernels_per_step": float(np.median(counts))}


def _ops_indices(num_points: int, k: int) -> set[int]:
    """K point indices spread evenly over the grid (all when k >= num_points, none when k <= 0)."""
    if k <= 0 or num_points == 0:
        return set()
    if k >= num_points:
        return set(range(num_points))
    return {int(round(i)) for i in np.linspace(0, num_points - 1, k)}


def reference_gemv_s(dtype: str, pool_elements: int | None) -> float:
    """The median (first repetition discarded) of the cold reference GEMV every probe row times
    beside itself, drawn from a pool of ``pool_elements``, timed right before a grid point's steps:
    the machine phase the row was taken in. NaN without a pool (not on the CPU)."""
    if pool_elements is None:
        return float("nan")
    from gpubench.backends.cpu.probes.torch_ops_measure import reference_times

    return float(np.median(reference_times(dtype, pool_elements)[1:]))


def reference_pool_elements(device_type: str) -> int | None:
    """The reference GEMV's pool on the CPU (the probes' cold pool, in 4-byte elements); None elsewhere."""
    if device_type != "cpu":
        return None
    from gpubench.backends.probe_common import cold_pool_bytes
    from gpubench.hostinfo import host_cpu

    return cold_pool_bytes(host_cpu().llc_bytes) // 4


def run_profile(cfg: ModelConfig, pc: ProfileConfig, out: Path, *,
                progress: Callable[[int, int, str], None] | None = None) -> list[dict]:
    """Time every point of the grid for ``cfg``; append rows; resume; write parquet. Returns all rows."""
    import torch

    from predictor.torch_model import DTYPES

    if pc.grid not in GRIDS:
        raise ConfigError(f"--grid '{pc.grid}': use one of {', '.join(GRIDS)}")
    if pc.engine not in ENGINES:
        raise ConfigError(f"--engine '{pc.engine}': use one of {', '.join(ENGINES)}")
    dev = _resolve_device(pc.device)
    dtype = pc.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype '{dtype}': use one of {', '.join(DTYPES)}")
    if pc.num_threads:
        torch.set_num_threads(pc.num_threads)
    spec = GRIDS[pc.grid]
    points = build_grid(spec, cfg, dtype_bytes=DTYPES[dtype].itemsize)[: pc.max_points]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    side = sidecar_path(out)
    old = read_rows(out) + read_rows(side)
    other = sorted({str(r.get("engine") or "torch") for r in old} - {pc.engine})
    if other:
        raise ConfigError(f"{out} holds rows of the {', '.join(other)} engine; write --engine {pc.engine} rows to "
                          f"another file")
    done = {r["key"] for r in old}
    dev_label = str(dev)
    todo = [(i, p) for i, p in enumerate(points) if row_key(cfg.name, dev_label, dtype, p, pc.engine) not in done]
    ops_idx = _ops_indices(len(points), pc.ops_subset)
    if todo:
        sess, static = _open_session(cfg, pc, dev, dtype, [p for _, p in todo])
        static |= {"schema_version": SCHEMA_VERSION, "model": cfg.name, "device": dev_label, "device_type": dev.type,
                   "device_name": _device_name(dev), "host": platform.node(), "dtype": dtype, "grid": spec.name,
                   "num_threads": torch.get_num_threads(), "torch_version": torch.__version__,
                   "command": " ".join(pc.command)}
        ref_pool = reference_pool_elements(dev.type)
        for j, (i, p) in enumerate(todo):
            if progress:
                progress(j, len(todo), p.key)
            load_before = os.getloadavg()[0]
            row = {"key": row_key(cfg.name, dev_label, dtype, p, pc.engine), **static, "phase": p.phase,
                   **point_features(cfg, p, DTYPES[dtype].itemsize), "ref_gemv_s": reference_gemv_s(dtype, ref_pool)}
            row |= _measure_point(sess, pc, spec, p, profile_ops_here=i in ops_idx)
            row |= {"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
                    "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            append_jsonl(side, row)
            old.append(row)
        if progress:
            progress(len(todo), len(todo), "done")
    write_parquet(old, out)
    if side.exists():
        side.unlink()
    return old


ENGINES = ("torch", "torch-graph")
_NOT_PROFILED = {"ops_profiled": False, "ops_json": "{}", "op_sum_s": float("nan"), "op_sum_cpu_s": float("nan"),
                 "op_profile_cpu_over_wall": float("nan"), "num_op_repeats": 0, "kernels_per_step": float("nan")}


def _open_session(cfg: ModelConfig, pc: ProfileConfig, dev, dtype: str, points: list[GridPoint]) -> tuple[_Session, dict]:
    """The engine the rows time, sized for ``points``, and the fields every row of it carries."""
    from predictor.torch_model import DTYPES, KVCache, TorchCausalLM

    rng = np.random.default_rng(pc.seed)
    if pc.engine == "torch-graph":
        from predictor.profile_graph import build_engine, engine_fields

        engine = build_engine(cfg, points, dtype=dtype, device=str(dev), seed=pc.seed, kernels=pc.kernels,
                              attention=pc.attention)
        return _Session(cfg, engine, None, dev, rng), engine_fields(engine)
    cap = max(p.kv_tokens for p in points)
    sess = _Session(cfg, TorchCausalLM(cfg, dtype=dtype, device=str(dev), seed=pc.seed),
                    KVCache(cfg, capacity_tokens=cap, dtype=DTYPES[dtype], device=str(dev), seed=pc.seed), dev, rng)
    return sess, {"engine": "torch", "timer": "perf_counter", "cuda_graphs": False, "attention_backend": "sdpa",
                  "attention_fallback": "", "kernels": "torch", "kernels_fallback": ""}


def _measure_point(sess: _Session, pc: ProfileConfig, spec, p: GridPoint, *, profile_ops_here: bool) -> dict:
    """A grid point's timing fields and, at the op-profiled points, its op (or kernel) breakdown."""
    if pc.engine == "torch-graph":
        from predictor.profile_graph import profile_graph_kernels, time_graph_step

        ids = [sess.rng.integers(0, sess.cfg.vocab_size, size=n).tolist() for n, _ in p.batch]
        row = time_graph_step(sess.model, p, ids, num_warmup=spec.num_warmup, num_repeats=spec.num_repeats,
                              min_time_s=spec.min_time_s, max_repeats=spec.max_repeats)
        return row | (profile_graph_kernels(sess.model, p, ids, num_repeats=pc.num_op_repeats) if profile_ops_here
                      else _NOT_PROFILED)
    row = time_step(sess, p, num_warmup=spec.num_warmup, num_repeats=spec.num_repeats, min_time_s=spec.min_time_s,
                    max_repeats=spec.max_repeats)
    row |= {"host_step_s": row["wall_s"], "device_step_s": float("nan"), "device_step_times_s": []}
    return row | (profile_ops(sess, p, num_repeats=pc.num_op_repeats) if profile_ops_here else _NOT_PROFILED)
