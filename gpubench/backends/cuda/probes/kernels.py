"""CUDA kernels as a serving engine's step issues them: the floor of tiny real kernels (eager and in a
CUDA graph), and decode attention timed inside a graph (torch's SDPA over a grid of batch and context).

The launch probe times *empty* kernels: the interval between two kernels that do nothing. A step's
kernels do something, and a tiny one (a norm over one row, a one-row GEMV, a decode attention over
16 cached tokens) costs more than the interval: its own fixed time (the step model's
``t_gemm_fixed_s`` for GEMMs, ``t_attn_fixed_s`` and ``t_attn_seq_s`` for attention). This probe
measures those floors where a serving engine runs them, in a captured graph:

- ``floor``: ``count`` back-to-back launches of one tiny op (``add``: a one-element in-place add;
  ``gemv``: a 1 x 128 x 128 matmul; ``reduce``: a sum of 4,096 floats), ``eager`` (events around
  launches queued behind a device-side spin, so host enqueue never shows) and ``graph`` (events
  around one replay of a graph of ``count`` captures). Checked: the add count, the GEMV against
  float64, the sum exactly.
- ``attn_decode``: ``scaled_dot_product_attention`` of B decode queries (one token each, 32 query
  heads over 8 KV heads of 128, Llama-3.1-8B's heads, bf16, no mask: the flash path) over B x L
  cached keys, ``calls`` calls captured in one graph cycling through K/V copies that together
  exceed 2x L2 (every call reads its K/V from memory, as a step's layers do), per-call time =
  replay / calls. Bytes: K and V once plus Q and the output. Checked: one call against a float32
  softmax(QK^T/sqrt(d))V.

Needs a CUDA torch (the graphs and SDPA are torch's); skipped with the reason otherwise.
``predictor.calibrate_kernels`` fits the attention floor and per-sequence time from these rows.
"""
from __future__ import annotations

import math
from typing import Any

from gpubench.backends.base import Backend, MeasurementSpec, ProbeConfig
from gpubench.backends.cuda.extension import NUM_WARMUP
from gpubench.backends.cuda.probes.common import CudaProbe, probe_row
from gpubench.backends.probe_common import opt

FLOOR_OPS = ("add", "gemv", "reduce")
FLOOR_COUNT = 256
ATTN_HEADS = (32, 8, 128)  # query heads, KV heads, head dim: Llama-3.1-8B
ATTN_BATCHES, ATTN_CONTEXTS = (1, 4, 16, 64), (16, 256, 1024, 4096)
QUICK_ATTN_BATCHES, QUICK_ATTN_CONTEXTS = (1, 16, 64), (16, 1024, 4096)
MAX_KV_COPIES = 64


def cuda_torch_reason() -> str:
    """"" when torch sees a CUDA device, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (the kernels probe times torch's kernels in CUDA graphs)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU build, or no driver)"
    return ""


class KernelsProbe(CudaProbe):
    """Tiny real kernels' floor (eager and in a graph) and graph-timed decode attention (module docstring)."""

    name = "kernels"
    description = "tiny real kernels eager and in a CUDA graph; decode attention (SDPA) graph-timed over B x L"
    timer = "cuda_events"
    time_budget_s = 180.0

    def supported(self, backend: Backend) -> tuple[bool, str]:
        why = cuda_torch_reason()
        return not why, why

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        reps = max(10, opt(cfg, "kernels", "num_reps", cfg.num_reps))
        count = opt(cfg, "kernels", "floor_count", FLOOR_COUNT)
        specs = [MeasurementSpec(key=f"kernels_floor_{op}_{mode}", label=f"floor {op} {mode}",
                                 params={"kind": "floor", "op": op, "mode": mode, "count": count, "num_reps": reps})
                 for op in FLOOR_OPS for mode in ("eager", "graph")]
        batches = opt(cfg, "kernels", "batches", QUICK_ATTN_BATCHES if cfg.quick else ATTN_BATCHES)
        contexts = opt(cfg, "kernels", "contexts", QUICK_ATTN_CONTEXTS if cfg.quick else ATTN_CONTEXTS)
        specs += [MeasurementSpec(key=f"kernels_attn_decode_bf16_b{b}_l{L}", label=f"attention B={b} L={L}",
                                  params={"kind": "attn_decode", "batch": b, "context": L, "num_reps": reps})
                  for b in batches for L in contexts]
        return specs

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        l2 = int(self.backend.properties.get("l2_bytes", 0))
        clock_khz = float(self.backend.properties.get("clock_khz", 1.5e6))
        if p["kind"] == "floor":
            r = floor_times(self.backend.index, p["op"], p["mode"], p["count"], p["num_reps"], clock_khz)
            return probe_row(spec.key, r, "cuda_events", kind="floor", op=p["op"], mode=p["mode"], count=p["count"])
        r = attention_times(self.backend.index, p["batch"], p["context"], p["num_reps"], l2)
        hq, hkv, d = ATTN_HEADS
        return probe_row(spec.key, r, "cuda_events", kind="attn_decode", dtype="bf16", batch=p["batch"],
                         context=p["context"], num_heads=hq, num_kv_heads=hkv, head_dim=d, count=1,
                         bytes=r["bytes"], calls_per_graph=r["calls"], num_kv_copies=r["copies"])

    def derive(self, row: dict, summary: dict) -> dict[str, Any]:
        c = row.get("count") or 1
        return {"per_kernel_s_median": summary["t_median_s"] / c, "per_kernel_s_min": summary["t_min_s"] / c,
                "per_kernel_us_median": summary["t_median_s"] / c * 1e6}


def _floor_op(torch, op: str, dev):
    """(callable launching one kernel, check(num_calls) -> (valid, text)) of a tiny op."""
    if op == "add":
        x = torch.zeros(1, device=dev)

        def check_add(n):
            got = float(x.item())
            return got == float(n), f"one-element add: {got:.0f} after {n} adds"
        return (lambda: x.add_(1.0)), check_add
    if op == "gemv":
        g = torch.Generator(device=dev).manual_seed(0)
        a, b = torch.rand(1, 128, device=dev, generator=g), torch.rand(128, 128, device=dev, generator=g)
        c = torch.empty(1, 128, device=dev)

        def check_gemv(n):
            err = float((c.double() - a.double() @ b.double()).abs().max())
            return err <= 1e-3, f"1x128x128 matmul vs float64: max |err| {err:.2e} (tol 1e-3)"
        return (lambda: torch.mm(a, b, out=c)), check_gemv
    x, s = torch.ones(4096, device=dev), torch.empty((), device=dev)

    def check_sum(n):
        got = float(s.item())
        return got == 4096.0, f"sum of 4096 ones: {got:g}"
    return (lambda: torch.sum(x, dim=0, out=s)), check_sum


def floor_times(index: int, op: str, mode: str, count: int, num_reps: int, clock_khz: float) -> dict:
    """Seconds per repetition of ``count`` launches of a tiny op (eager behind a spin, or one replay)."""
    import torch

    dev = torch.device("cuda", index)
    stream = torch.cuda.current_stream(dev)
    launch, check = _floor_op(torch, op, dev)
    times: list[float] = []
    calls = 0
    with torch.cuda.device(dev):
        graph = None
        if mode == "graph":
            side = torch.cuda.Stream(dev)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                launch()
                calls += 1
            stream.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(count):
                    launch()
        for _ in range(NUM_WARMUP + num_reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if graph is None:
                torch.cuda._sleep(int(count * 8e-6 * clock_khz * 1e3))  # covers ~8 us of enqueue per launch
                e0.record(stream)
                for _ in range(count):
                    launch()
            else:
                e0.record(stream)
                graph.replay()
            e1.record(stream)
            stream.synchronize()
            calls += count
            times.append(e0.elapsed_time(e1) * 1e-3)
        valid, text = check(calls)
    return {"times_s": times[NUM_WARMUP:], "valid": valid, "check": text}


def attention_times(index: int, batch: int, context: int, num_reps: int, l2_bytes: int) -> dict:
    """Per-call seconds of decode SDPA, from replays of a graph of ``calls`` calls over K/V copies."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda", index)
    hq, hkv, d = ATTN_HEADS
    kv_bytes = 2 * batch * hkv * context * d * 2
    copies = int(min(MAX_KV_COPIES, max(1, math.ceil(2 * l2_bytes / kv_bytes))))
    calls = max(copies, 8)
    g = torch.Generator(device=dev).manual_seed(batch * 100003 + context)
    q = torch.randn(batch, hq, 1, d, device=dev, generator=g).to(torch.bfloat16)
    ks = [torch.randn(batch, hkv, context, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(copies)]
    vs = [torch.randn(batch, hkv, context, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(copies)]
    stream = torch.cuda.current_stream(dev)

    def call(i):  # the output stays where SDPA put it (the graph's pool): no copy kernel beside it
        return F.scaled_dot_product_attention(q, ks[i % copies], vs[i % copies], enable_gqa=True)

    times: list[float] = []
    with torch.cuda.device(dev):
        side = torch.cuda.Stream(dev)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for i in range(3):
                call(i)
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [call(i) for i in range(calls)]
        for _ in range(NUM_WARMUP + num_reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            graph.replay()
            e1.record(stream)
            stream.synchronize()
            times.append(e0.elapsed_time(e1) * 1e-3 / calls)
        last = (calls - 1) % copies
        qf = q.float().repeat_interleave(hq // hkv, dim=1)
        kf, vf = ks[last].float().repeat_interleave(hq // hkv, dim=1), vs[last].float().repeat_interleave(hq // hkv, dim=1)
        ref = torch.softmax(qf @ kf.transpose(-1, -2) / math.sqrt(d), dim=-1) @ vf
        err = float((outs[-1].float() - ref).abs().max())
    return {"times_s": times[NUM_WARMUP:], "valid": err <= 2e-2, "calls": calls, "copies": copies,
            "check": f"last call vs float32 softmax(QK^T/sqrt(d))V: max |err| {err:.2e} (tol 2e-2)",
            "bytes": kv_bytes + 2 * batch * hq * d * 2}
