"""The ops an eager PyTorch engine step runs on the CPU, timed where a step runs them (cold caches).

Why this probe exists: a CPU decode step spends its time in torch's GEMMs (MKL/oneDNN, whose
speed is not monotone in the row count M), in scaled-dot-product attention (whose cost on the
CPU follows the query heads, not the KV heads, under grouped-query attention) and in dozens of
small ops that cost 10-150 us each inside a step (after a weight-streaming GEMV has evicted the
caches) against 1-2 us in a hot loop. numpy's BLAS and hot-loop dispatch figures do not predict
that; these rows do, and ``gpubench fit`` turns them into the calibration's ``cpu_ops`` tables.

Families (``family`` field; every time is the calling thread's CPU time, ``time.thread_time``,
so a busy neighbour's share of the core is not counted; ``num_threads`` torch threads, 1 unless
``--set torch_ops.num_threads=N``):

- ``linear``: ``F.linear(x[M,K], W[N,K])`` as a model's projection issues it, over a dense M grid
  (1..16 each, then ~1.25x steps to 1024) and (N, K) pairs of 64..16384. W is a view into a
  rotating pool larger than 2x the last-level cache, so each repetition streams a weight no
  earlier repetition left in cache, as a step does. FLOPs 2MNK; bytes (MK + NK + MN) x itemsize.
- ``attn_decode``: one query per sequence against B cached sequences of L keys, ``q[B,H,1,d]`` on
  ``K/V[B,Hkv,L,d]`` with ``enable_gqa``, as an engine's decode group issues it (output buffer,
  SDPA, copy back), K/V cold (rotating pool).
- ``attn_prefill``: ``n`` new tokens of one sequence with ``c`` cached: causal when ``c == 0``,
  a boolean mask over the ``c + n`` keys otherwise.
- ``segment``: the non-GEMM pieces of a Llama-style layer at T rows of width W, each timed right
  after an untimed weight-streaming GEMV (the context a step runs them in): ``rmsnorm`` (fp32
  variance, as transformers' LlamaRMSNorm), ``residual_add``, ``silu_mul``, ``rope``
  (x*cos + rotate_half(x)*sin on heads of 64), ``kv_write`` (K and V rows scattered into a
  [T, heads, 16, 64] cache view), ``embed`` (row gather from a 32000 x W table), ``argmax``
  (greedy sampling over W logits).

Validation: linear outputs are sampled against a float64 product (K*eps*|A||B| bound); attention
outputs are checked against a float64 softmax(QK^T/sqrt(d))V on one sequence and head; segments
against their definition on a sample. Requires torch; without it the probe is skipped with the reason.
"""
from __future__ import annotations

import math
import time
import zlib
from typing import Any

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.probes.common import cold_pool_bytes, dtypes_option, llc_bytes, opt, torch_unavailable_reason

# M grid: every M to 16 (MKL's kernel choice changes between neighbours there), then ~1.25x steps.
LINEAR_M = tuple(range(1, 17)) + (20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256, 320,
                                  384, 512, 640, 768, 1024)
QUICK_LINEAR_M = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512)
LINEAR_K = (256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_LINEAR_K = (512, 2048, 8192)
LINEAR_N = (64, 256, 1024, 4096, 16384)
QUICK_LINEAR_N = (256, 1024, 4096)
MAX_WEIGHT_ELEMENTS = 1 << 24     # 64 MiB of fp32 per weight: larger ones stream at the same rate
MAX_CALL_FLOPS = 4e9              # ~50 ms on one core: longer calls add nothing the tables need
# (query heads, KV heads, head_dim): groups of 1, 3, 4, 7 query heads per KV head, head_dim 64 and 128.
ATTN_HEADS = ((8, 8, 64), (12, 4, 64), (16, 4, 64), (28, 4, 64), (32, 8, 128))
QUICK_ATTN_HEADS = ((12, 4, 64), (32, 8, 128))
DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXT = (32, 128, 512, 2048, 8192)
QUICK_DECODE_BATCH = (1, 4, 16, 64)
QUICK_DECODE_CONTEXT = (64, 512, 4096)
MAX_DECODE_KV_TOKENS = 1 << 16    # B x L
PREFILL_NEW = (16, 64, 256, 1024)
PREFILL_CACHED = (0, 512, 2048)
QUICK_PREFILL_NEW = (16, 128, 1024)
QUICK_PREFILL_CACHED = (0, 1024)
SEGMENTS = ("rmsnorm", "residual_add", "silu_mul", "rope", "kv_write", "embed", "argmax")
SEGMENT_T = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
QUICK_SEGMENT_T = (1, 4, 16, 64, 256, 1024, 4096)
SEGMENT_W = (512, 2048, 8192)
KV_WRITE_W = (128, 512, 2048)     # K/V widths (KV heads x head_dim) of real models
KV_WRITE_SLOTS = 16               # positions per cache row: the write scatters, the row length does not matter
ARGMAX_W = (8192, 32768, 131072)  # vocabularies
EMBED_ROWS = 32000
HEAD_DIM = 64                     # rope and kv_write heads
DTYPES = ("fp32", "bf16")
MIN_TIMED_S = 0.05                # keep repeating until this much was timed ...
MIN_REPS, MAX_REPS = 5, 40        # ... within these bounds (the first repetition is the warm-up)
FLUSH_ELEMENTS = 1 << 22          # 16 MiB GEMV before each segment repetition
# Segments at T = 1 after context GEMVs of these sizes (elements): what a step's preceding projection
# evicts decides a small op's fixed cost (38 us hot, ~150 us after a 16 MiB GEMV, for an RMSNorm here).
SEGMENT_CONTEXTS = (0, 1 << 17, 1 << 19, 1 << 20, 1 << 22)
QUICK_SEGMENT_CONTEXTS = (0, 1 << 18, 1 << 22)
REFERENCE_SHAPE = (1024, 1024)    # (N, K) of the reference GEMV timed next to every streaming row
REFERENCE_REPS = 7


def linear_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def linear_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    return (m * k + n * k + m * n) * itemsize


class _Pool:
    """One rotating buffer per dtype, > 2x the last-level cache, filled once with uniform(-1, 1).

    ``take(numel)`` returns the next ``numel`` elements after the previous take (wrapping), so
    consecutive repetitions read memory the cache does not hold. Kept per worker process: filling
    hundreds of MB per measurement would cost more than the measurements.
    """

    def __init__(self):
        self.buffers: dict = {}
        self.cursor: dict = {}

    def take(self, dtype_name: str, numel: int, pool_elements: int):
        import torch

        buf = self.buffers.get(dtype_name)
        if buf is None or buf.numel() < max(pool_elements, 2 * numel):
            size = max(pool_elements, 2 * numel)
            buf = torch.empty(size, dtype=torch.float32).uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
            buf = buf.to(_torch_dtype(dtype_name))
            self.buffers[dtype_name], self.cursor[dtype_name] = buf, 0
        start = self.cursor[dtype_name]
        if start + numel > buf.numel():
            start = 0
        self.cursor[dtype_name] = start + numel
        return buf[start:start + numel]


_POOL = _Pool()


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _eps(name: str) -> float:
    return {"fp32": 2.0**-23, "bf16": 2.0**-7}[name]


class TorchOpsProbe(Probe):
    name = "torch_ops"
    description = "torch CPU ops as a step runs them: linear over a dense M grid, SDPA decode/prefill, cold layer segments"
    timer = "thread_cpu"
    time_budget_s = 1500.0

    def supported(self, backend) -> tuple[bool, str]:
        reason = torch_unavailable_reason()
        return (reason is None), (reason or "")

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        q = cfg.quick
        dtypes = dtypes_option(cfg, "torch_ops", DTYPES)
        families = tuple(f for f in str(opt(cfg, "torch_ops", "families", "linear,attn_decode,attn_prefill,segment")).split(",") if f)
        threads = opt(cfg, "torch_ops", "num_threads", 1)
        scale = opt(cfg, "torch_ops", "size_scale", 1.0)  # tests shrink every size
        max_m = opt(cfg, "torch_ops", "max_m", 1 << 30)
        max_rows = opt(cfg, "torch_ops", "max_rows", 1 << 30)  # segment T cap (tests)
        pool = cold_pool_bytes(llc_bytes(cfg.device)) // 4  # elements of 4 bytes
        pool = int(pool * min(1.0, scale * 4)) if scale < 1 else pool
        common = {"num_threads": threads, "pool_elements": pool}

        def sz(v: int, floor: int = 1) -> int:
            return max(floor, int(v * scale))

        specs: list[MeasurementSpec] = []
        for dt in dtypes:
            if "linear" in families:
                for k in (QUICK_LINEAR_K if q else LINEAR_K):
                    for n in (QUICK_LINEAR_N if q else LINEAR_N):
                        kk, nn = sz(k, 8), sz(n, 8)
                        if nn * kk > MAX_WEIGHT_ELEMENTS:
                            continue
                        for m in (QUICK_LINEAR_M if q else LINEAR_M):
                            if m > max_m or linear_flops(m, nn, kk) > MAX_CALL_FLOPS:
                                continue
                            specs.append(MeasurementSpec(
                                key=f"torch_linear_{dt}_n{n}_k{k}_m{m}",
                                params={**common, "family": "linear", "dtype": dt, "m": m, "n": nn, "k": kk},
                                label=f"linear {dt} M={m} N={nn} K={kk}"))
            for h, hkv, d in (QUICK_ATTN_HEADS if q else ATTN_HEADS):
                if "attn_decode" in families:
                    for b in (QUICK_DECODE_BATCH if q else DECODE_BATCH):
                        for ctx in (QUICK_DECODE_CONTEXT if q else DECODE_CONTEXT):
                            if b * ctx > MAX_DECODE_KV_TOKENS:
                                continue
                            specs.append(MeasurementSpec(
                                key=f"torch_attn_decode_{dt}_h{h}_kv{hkv}_d{d}_b{b}_l{ctx}",
                                params={**common, "family": "attn_decode", "dtype": dt, "heads": h,
                                        "kv_heads": hkv, "head_dim": d, "batch": b, "context": sz(ctx, 4)},
                                label=f"attn decode {dt} H={h}/{hkv} B={b} L={ctx}"))
                if "attn_prefill" in families:
                    for n_new in (QUICK_PREFILL_NEW if q else PREFILL_NEW):
                        for cached in (QUICK_PREFILL_CACHED if q else PREFILL_CACHED):
                            specs.append(MeasurementSpec(
                                key=f"torch_attn_prefill_{dt}_h{h}_kv{hkv}_d{d}_n{n_new}_c{cached}",
                                params={**common, "family": "attn_prefill", "dtype": dt, "heads": h,
                                        "kv_heads": hkv, "head_dim": d, "new_tokens": sz(n_new, 2),
                                        "cached_tokens": sz(cached, 0) if cached else 0},
                                label=f"attn prefill {dt} H={h}/{hkv} n={n_new} c={cached}"))
            if "segment" in families:
                for seg in SEGMENTS:
                    for w in {"argmax": ARGMAX_W, "kv_write": KV_WRITE_W}.get(seg, SEGMENT_W):
                        for t in (QUICK_SEGMENT_T if q else SEGMENT_T):
                            if (seg == "argmax" and t > 256) or t > max_rows:
                                continue  # argmax: one row per sequence, batches not token counts
                            specs.append(MeasurementSpec(
                                key=f"torch_segment_{seg}_{dt}_t{t}_w{w}",
                                params={**common, "family": "segment", "segment": seg, "dtype": dt,
                                        "rows": t, "width": max(HEAD_DIM, sz(w, HEAD_DIM) // HEAD_DIM * HEAD_DIM),
                                        "context_elements": sz(FLUSH_ELEMENTS, 1024)},
                                label=f"segment {seg} {dt} T={t} W={w}"))
                        for ctx in (QUICK_SEGMENT_CONTEXTS if q else SEGMENT_CONTEXTS):
                            if ctx == FLUSH_ELEMENTS:
                                continue  # the main grid's T = 1 row
                            specs.append(MeasurementSpec(
                                key=f"torch_segment_ctx_{seg}_{dt}_w{w}_c{ctx}",
                                params={**common, "family": "segment", "segment": seg, "dtype": dt, "rows": 1,
                                        "width": max(HEAD_DIM, sz(w, HEAD_DIM) // HEAD_DIM * HEAD_DIM),
                                        "context_elements": sz(ctx, 0) if ctx else 0},
                                label=f"segment {seg} {dt} T=1 W={w} after {ctx * 4 >> 10} KiB"))
        return _distinct(specs)

    def measure(self, spec: MeasurementSpec) -> dict:
        import torch

        p = spec.params
        torch.set_num_threads(int(p["num_threads"]))
        with torch.inference_mode():
            fields = {"linear": _measure_linear, "attn_decode": _measure_decode,
                      "attn_prefill": _measure_prefill, "segment": _measure_segment}[p["family"]](spec)
        base = {k: v for k, v in p.items() if k != "pool_elements"}
        return {**base, "torch_version": str(torch.__version__), **fields}


def _distinct(specs: list[MeasurementSpec]) -> list[MeasurementSpec]:
    """The first spec of each distinct measurement (a shrunk grid, ``size_scale`` < 1, maps several
    nominal sizes onto one: measure it once, so no table has two rows for one point)."""
    seen, out = set(), []
    for spec in specs:
        ident = tuple(sorted(spec.params.items()))
        if ident not in seen:
            seen.add(ident)
            out.append(spec)
    return out


def _repeat(run, *, before=None) -> list[float]:
    """Thread-CPU seconds of ``run()`` per repetition (first = warm-up, kept: the stats discard it).

    ``before()`` runs untimed ahead of each repetition (the cold context).
    """
    times: list[float] = []
    total = 0.0
    while len(times) < MIN_REPS or (total < MIN_TIMED_S and len(times) < MAX_REPS):
        if before is not None:
            before()
        t0 = time.thread_time()
        run()
        dt = time.thread_time() - t0
        times.append(dt)
        if len(times) > 1:
            total += dt
    return times


def _rng(spec: MeasurementSpec):
    import torch

    return torch.Generator().manual_seed(zlib.crc32(spec.key.encode()))


def reference_times(dtype_name: str, pool_elements: int) -> list[float]:
    """Thread-CPU seconds of REFERENCE_REPS cold M = 1 GEMVs of REFERENCE_SHAPE (see module docstring)."""
    import torch
    import torch.nn.functional as F

    n, k = REFERENCE_SHAPE
    x = torch.ones(1, k, dtype=_torch_dtype(dtype_name))
    times = []
    for _ in range(REFERENCE_REPS):
        w = _POOL.take(dtype_name, n * k, pool_elements).view(n, k)
        t0 = time.thread_time()
        F.linear(x, w)
        times.append(time.thread_time() - t0)
    return times


def _measure_linear(spec: MeasurementSpec) -> dict:
    import torch
    import torch.nn.functional as F

    p = spec.params
    m, n, k, dt = p["m"], p["n"], p["k"], p["dtype"]
    dtype = _torch_dtype(dt)
    x = (torch.rand(m, k, generator=_rng(spec)) * 2 - 1).to(dtype)
    state = {}
    ref_times = reference_times(dt, p["pool_elements"])

    def before():
        state["w"] = _POOL.take(dt, n * k, p["pool_elements"]).view(n, k)

    def run():
        state["y"] = F.linear(x, state["w"])

    times = _repeat(run, before=before)
    y, w = state["y"], state["w"]
    rows = torch.arange(0, m, max(1, m // 4))[:4]
    cols = torch.arange(0, n, max(1, n // 16))[:16]
    ref = x[rows].double() @ w[cols].double().T
    err = (y[rows][:, cols].double() - ref).abs()
    bound = k * _eps(dt) * (x[rows].double().abs() @ w[cols].double().abs().T) + 1e-30
    ok = bool((err <= bound).all())
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = {"times_s": times, "ref_times_s": ref_times, "valid": ok, "flops": linear_flops(m, n, k),
           "bytes": linear_bytes(m, n, k, itemsize),
           "weight_bytes": n * k * itemsize, "max_abs_err": float(err.max())}
    if not ok:
        out["invalid_reason"] = f"max |y - y_ref| = {float(err.max()):.3e} exceeds the K*eps*|x||W| bound"
    return out


def _check_attention(q, k, v, o, mask_row=None) -> tuple[bool, float]:
    """Sequence 0, head 0 against float64 softmax(q k^T / sqrt(d)) v (k/v of head 0's KV head)."""
    d = q.shape[-1]
    q0, k0, v0 = q[0, 0].double(), k[0, 0].double(), v[0, 0].double()
    s = q0 @ k0.T / math.sqrt(d)
    if mask_row is not None:
        s = s.masked_fill(~mask_row, float("-inf"))
    ref = s.softmax(-1) @ v0
    err = float((o[0, 0].double() - ref).abs().max())
    return err <= 1e-4 if q.dtype.is_floating_point and q.element_size() == 4 else err <= 5e-2, err


def _measure_decode(spec: MeasurementSpec) -> dict:
    import torch
    import torch.nn.functional as F

    p = spec.params
    b, h, hkv, d, ctx, dt = p["batch"], p["heads"], p["kv_heads"], p["head_dim"], p["context"], p["dtype"]
    dtype = _torch_dtype(dt)
    q = (torch.rand(b, h, d, generator=_rng(spec)) * 2 - 1).to(dtype)
    numel = b * hkv * ctx * d
    state = {}
    ref_times = reference_times(dt, p["pool_elements"])

    def before():
        state["k"] = _POOL.take(dt, numel, p["pool_elements"]).view(b, hkv, ctx, d)
        state["v"] = _POOL.take(dt, numel, p["pool_elements"]).view(b, hkv, ctx, d)

    def run():
        out = torch.empty(b, h, d, dtype=dtype)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), state["k"], state["v"], enable_gqa=True)
        out[:] = o.squeeze(2)
        state["o"] = out

    times = _repeat(run, before=before)
    ok, err = _check_attention(q.unsqueeze(2), state["k"], state["v"], state["o"].unsqueeze(2))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = {"times_s": times, "ref_times_s": ref_times, "valid": ok, "max_abs_err": err,
           "flops": 4 * b * h * ctx * d, "bytes": 2 * numel * itemsize + 2 * b * h * d * itemsize}
    if not ok:
        out["invalid_reason"] = f"attention output off by {err:.3e} from the float64 reference"
    return out


def _measure_prefill(spec: MeasurementSpec) -> dict:
    import torch
    import torch.nn.functional as F

    p = spec.params
    h, hkv, d, n, c, dt = p["heads"], p["kv_heads"], p["head_dim"], p["new_tokens"], p["cached_tokens"], p["dtype"]
    dtype = _torch_dtype(dt)
    kv_len = c + n
    q = (torch.rand(1, h, n, d, generator=_rng(spec)) * 2 - 1).to(dtype)
    mask = None
    if c > 0:
        mask = torch.arange(kv_len)[None, :] <= torch.arange(c, kv_len)[:, None]
    numel = hkv * kv_len * d
    state = {}

    def before():
        state["k"] = _POOL.take(dt, numel, p["pool_elements"]).view(1, hkv, kv_len, d)
        state["v"] = _POOL.take(dt, numel, p["pool_elements"]).view(1, hkv, kv_len, d)

    def run():
        state["o"] = F.scaled_dot_product_attention(q, state["k"], state["v"], attn_mask=mask,
                                                    is_causal=mask is None, enable_gqa=True)

    times = _repeat(run, before=before)
    row0 = torch.arange(kv_len)[None, :] <= (torch.arange(n)[:, None] + c)
    ok, err = _check_attention(q, state["k"], state["v"], state["o"], row0)
    pairs = n * c + n * (n + 1) // 2
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = {"times_s": times, "valid": ok, "max_abs_err": err, "pairs": pairs, "masked": mask is not None,
           "flops": 4 * h * d * pairs, "bytes": (2 * numel + 2 * h * n * d) * itemsize}
    if not ok:
        out["invalid_reason"] = f"attention output off by {err:.3e} from the float64 reference"
    return out


def _rmsnorm(x, w, eps: float = 1e-5):
    import torch

    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _measure_segment(spec: MeasurementSpec) -> dict:
    """One layer segment at T rows of width W, each repetition after an untimed streaming GEMV."""
    import torch
    import torch.nn.functional as F

    p = spec.params
    seg, t, w, dt = p["segment"], p["rows"], p["width"], p["dtype"]
    dtype = _torch_dtype(dt)
    gen = _rng(spec)
    rand = lambda *shape: (torch.rand(*shape, generator=gen) * 2 - 1).to(dtype)  # noqa: E731
    flush_k = 1024
    flush_x = rand(min(t, 64), flush_k)
    context = int(p["context_elements"]) // flush_k * flush_k

    def before():
        if context:
            F.linear(flush_x, _POOL.take(dt, context, p["pool_elements"]).view(-1, flush_k))

    state: dict[str, Any] = {}
    itemsize = torch.empty(0, dtype=dtype).element_size()
    heads = w // HEAD_DIM
    if seg == "rmsnorm":
        x, g = rand(t, w), rand(w)
        run = lambda: state.__setitem__("y", _rmsnorm(x, g))  # noqa: E731
        nbytes = (2 * t * w + w) * itemsize
        check = lambda: torch.allclose(  # noqa: E731
            state["y"].double(), (g.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()), rtol=1e-2, atol=1e-2)
    elif seg == "residual_add":
        x, y = rand(t, w), rand(t, w)
        run = lambda: state.__setitem__("y", x + y)  # noqa: E731
        nbytes = 3 * t * w * itemsize
        check = lambda: torch.equal(state["y"], x + y)  # noqa: E731
    elif seg == "silu_mul":
        g, u = rand(t, w), rand(t, w)
        run = lambda: state.__setitem__("y", F.silu(g) * u)  # noqa: E731
        nbytes = 3 * t * w * itemsize
        check = lambda: torch.allclose(state["y"].double(), torch.nn.functional.silu(g.double()) * u.double(), rtol=1e-2, atol=1e-2)  # noqa: E731
    elif seg == "rope":
        x = rand(t, heads, HEAD_DIM)
        half_angles = torch.rand(t, 1, HEAD_DIM // 2, generator=gen) * 6.28
        ang = torch.cat((half_angles, half_angles), dim=-1)  # a rotation: dims i and i + d/2 share an angle
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        run = lambda: state.__setitem__("y", _rotate(x, cos, sin))  # noqa: E731
        nbytes = (2 * t * w + 2 * t * HEAD_DIM) * itemsize
        check = lambda: torch.allclose(state["y"].double().norm(dim=-1), x.double().norm(dim=-1), rtol=2e-2, atol=1e-3)  # noqa: E731
    elif seg == "kv_write":
        cache_k = rand(t, heads, KV_WRITE_SLOTS, HEAD_DIM)
        cache_v = rand(t, heads, KV_WRITE_SLOTS, HEAD_DIM)
        k, v = rand(t, heads, HEAD_DIM), rand(t, heads, HEAD_DIM)
        rows = torch.arange(t)
        pos = torch.randint(0, KV_WRITE_SLOTS, (t,), generator=gen)

        def run():
            cache_k[rows, :, pos] = k
            cache_v[rows, :, pos] = v

        nbytes = 4 * t * w * itemsize
        check = lambda: torch.equal(cache_k[rows, :, pos], k) and torch.equal(cache_v[rows, :, pos], v)  # noqa: E731
    elif seg == "embed":
        # Cold, real values; at most a quarter of the pool (a gather reads T rows, whatever the table).
        num_rows = max(t, min(EMBED_ROWS, p["pool_elements"] // (4 * w)))
        table = _POOL.take(dt, num_rows * w, p["pool_elements"]).view(num_rows, w)
        ids = torch.randint(0, num_rows, (t,), generator=gen)
        run = lambda: state.__setitem__("y", table[ids])  # noqa: E731
        nbytes = 2 * t * w * itemsize + 8 * t
        check = lambda: torch.equal(state["y"][0], table[ids[0]])  # noqa: E731
    elif seg == "argmax":
        logits = rand(t, w)
        run = lambda: state.__setitem__("y", torch.argmax(logits, dim=-1))  # noqa: E731
        nbytes = t * w * itemsize + 8 * t
        check = lambda: int(state["y"][0]) == int(logits[0].float().argmax()) or float(logits[0, state["y"][0]]) == float(logits[0].max())  # noqa: E731
    else:
        raise ValueError(f"unknown segment '{seg}'")
    times = _repeat(run, before=before)
    ok = bool(check())
    out = {"times_s": times, "valid": ok, "bytes": nbytes}
    if not ok:
        out["invalid_reason"] = f"{seg} output differs from its definition"
    return out
