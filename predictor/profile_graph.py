"""Step rows of the graph engine (``gpubench profile --engine torch-graph``): building it for a grid,
timing its steps, and the kernels one step launches.

A step here is what a serving engine's loop does per step: copy the host-built inputs into the
static buffers, replay the step's CUDA graph (decode shapes; mixed and prefill steps run eagerly),
and read the sampled tokens back. Two clocks per repetition:

- ``host_step_s`` (= ``wall_s``, the row's headline): ``time.perf_counter`` around all three, the
  step as the engine's host sees it;
- ``device_step_s``: CUDA events recorded around the replay (or the eager forward), the device's
  own time for the step's kernels and the gaps between them; NaN on the CPU, which has no device
  clock apart from the host's.

The first repetition of a decode shape captures its graph; warm-up repetitions absorb that, and no
capture is ever timed. ``kernels_per_step`` counts the device kernels of one profiled step (CUDA),
or the top-level aten ops of one profiled eager step (CPU), with their time per kind.
"""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from predictor.profile_grid import GridPoint
from predictor.profile_rows import wall_fields

KERNEL_KINDS = (  # device kernel name fragments -> kind (first match wins)
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("linear", ("gemm", "xmma", "cutlass", "gemv", "cublas", "sm90_", "sm80_", "ampere_", "nvjet")),
    ("triton", ("triton",)),
    ("sampling", ("argmax", "reduce_kernel")),
    ("copy", ("memcpy", "memset", "copy", "index")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise"


def build_engine(cfg, points: list[GridPoint], *, dtype: str, device: str, seed: int, kernels: str = "auto",
                 attention: str = "auto", block_size: int = 16):
    """A GraphCausalLM whose cache and buffers hold every point of ``points`` (its largest step)."""
    from predictor.graph_model import GraphCausalLM, PagedKVCache
    from predictor.torch_model import DTYPES, TorchCausalLM

    eager = TorchCausalLM(cfg, dtype=dtype, device=device, seed=seed)
    blocks = max(len(p.batch) * -(-max(n + c for n, c in p.batch) // block_size) for p in points)
    cache = PagedKVCache(cfg, num_blocks=blocks, block_size=block_size, dtype=DTYPES[dtype], device=device, seed=seed)
    return GraphCausalLM(eager, cache, max_tokens=max(sum(n for n, _ in p.batch) for p in points),
                         max_seqs=max(len(p.batch) for p in points),
                         max_positions=max(n + c for p in points for n, c in p.batch) + 1, kernels=kernels,
                         attention=attention, free_unfused=True)


def engine_fields(engine) -> dict:
    """What every row of this engine says about how it ran."""
    cuda = engine.device.type == "cuda"
    return {"engine": "torch-graph", "timer": "cuda-event+perf_counter" if cuda else "perf_counter",
            "cuda_graphs": engine.use_graphs, "attention_backend": engine.attention.name,
            "attention_fallback": engine.attention.fallback_reason, "kernels": engine.kernels.name,
            "kernels_fallback": engine.kernels.fallback_reason}


def time_graph_step(engine, point: GridPoint, ids: list[list[int]], *, num_warmup: int, num_repeats: int,
                    min_time_s: float = 0.0, max_repeats: int | None = None) -> dict:
    """Warm up (capturing the shape's graph), then time steps; every repetition kept."""
    import torch

    cached = [c for _, c in point.batch]
    engine.layout(len(point.batch), max(n + c for n, c in point.batch))
    cuda = engine.device.type == "cuda"
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    host: list[float] = []
    device: list[float] = []
    prep: list[float] = []
    cpu: list[float] = []
    max_repeats = max(num_repeats, max_repeats or num_repeats)
    rep = 0
    while rep < num_warmup + num_repeats or (sum(host) < min_time_s and len(host) < max_repeats):
        rep += 1
        c0, t0 = time.thread_time(), time.perf_counter()
        shape, _ = engine.prepare(ids, cached)
        t1 = time.perf_counter()
        if start is not None:
            start.record()
        nxt = engine.run(shape)
        if end is not None:
            end.record()
        tokens = nxt.tolist()  # the sampled tokens back on the host: the step's one synchronization
        t2, c2 = time.perf_counter(), time.thread_time()
        if len(tokens) != len(point.batch):
            from common.errors import GpubenchError

            raise GpubenchError(f"step returned {len(tokens)} tokens for {len(point.batch)} sequences")
        if rep > num_warmup:
            host.append(t2 - t0)
            prep.append(t1 - t0)
            cpu.append(c2 - c0)
            device.append(start.elapsed_time(end) * 1e-3 if start is not None and end is not None else float("nan"))
    return {**wall_fields(host), "host_step_s": float(np.median(host)), "device_step_s": float(np.median(device)),
            "device_step_times_s": device, "prep_s": float(np.median(prep)), "forward_s": float("nan"),
            "sampling_s": float("nan"), "forward_times_s": [], "sampling_times_s": [],
            "thread_cpu_s": float(np.median(cpu)), "thread_cpu_times_s": cpu}


def profile_graph_kernels(engine, point: GridPoint, ids: list[list[int]], *, num_repeats: int) -> dict:
    """One step under torch.profiler per repetition: kernels (or CPU ops) per step and time per kind."""
    import torch.profiler as tp

    from predictor.profile_ops import kernels_in, op_times_by_kind, quiet_stderr

    cached = [c for _, c in point.batch]
    cuda = engine.device.type == "cuda"
    acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
    counts, per_rep = [], []
    for _ in range(num_repeats):
        shape, _ = engine.prepare(ids, cached)
        engine.run(shape).tolist()  # the graph exists before the profiled step
        with quiet_stderr(), tp.profile(activities=acts) as prof:
            shape, _ = engine.prepare(ids, cached)
            engine.run(shape).tolist()
        events = prof.events()
        if cuda:
            by_kind: dict[str, float] = {}
            for e in events:
                if e.device_type == tp.DeviceType.CUDA and "memcpy" not in e.name.lower():
                    by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + e.device_time_total * 1e-6
        else:
            by_kind = op_times_by_kind(events, device_type="cpu")
        counts.append(kernels_in(events, device_type=engine.device.type))
        per_rep.append(by_kind)
    kinds = sorted({k for r in per_rep for k in r})
    med = {k: float(np.median([r.get(k, 0.0) for r in per_rep])) for k in kinds}
    out: dict[str, Any] = {"ops_profiled": True, "ops_json": json.dumps(med), "op_sum_s": float(sum(med.values())),
                           "op_sum_cpu_s": float("nan"), "op_profile_cpu_over_wall": float("nan"),
                           "num_op_repeats": num_repeats, "kernels_per_step": float(np.median(counts))}
    return out
