"""torch_ops' measurements: one function per family (linear, attn_decode, attn_prefill, segment),
each timing its op cold and checking its output against a float64 or by-definition reference.

Kept apart from the probe's plan (``torch_ops``) because this is the code that touches torch: the
rotating cold pool, the thread-CPU repetition loop, and the reference GEMV (REFERENCE_REPS cold
M = 1 GEMVs of REFERENCE_SHAPE) timed next to every streaming row, which the predictor's profile
also calls so that its step rows carry the same yardstick.
"""
from __future__ import annotations

import math
import zlib
from typing import Any

from gpubench.backends.base import MeasurementSpec
from gpubench.backends.cpu.probes.torch_ops_grid import (
    EMBED_ROWS,
    HEAD_DIM,
    KV_WRITE_SLOTS,
    MAX_REPS,
    MIN_REPS,
    MIN_TIMED_S,
    REFERENCE_REPS,
    REFERENCE_SHAPE,
    linear_bytes,
    linear_flops,
)
from vllmref import thread_clock


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


def _repeat(run, *, before=None, max_reps: int = MAX_REPS) -> tuple[list[float], int]:
    """Thread-CPU seconds of ``run()`` per repetition (first = warm-up, kept: the stats discard it)
    and how many zero readings of the thread clock were retaken (``vllmref.thread_clock`` says why).

    ``before()`` runs untimed ahead of each repetition (the cold context).
    """
    return thread_clock.repeat(run, min_reps=MIN_REPS, max_reps=max_reps, min_timed_s=MIN_TIMED_S, before=before)


def _rng(spec: MeasurementSpec):
    import torch

    return torch.Generator().manual_seed(zlib.crc32(spec.key.encode()))


def reference_times(dtype_name: str, pool_elements: int) -> list[float]:
    """Thread-CPU seconds of REFERENCE_REPS cold M = 1 GEMVs of REFERENCE_SHAPE (see module docstring)."""
    import torch
    import torch.nn.functional as F

    n, k = REFERENCE_SHAPE
    x = torch.ones(1, k, dtype=_torch_dtype(dtype_name))
    state = {}

    def before():
        state["w"] = _POOL.take(dtype_name, n * k, pool_elements).view(n, k)

    return [thread_clock.time_once(lambda: F.linear(x, state["w"]), before)[0] for _ in range(REFERENCE_REPS)]


def measure_linear(spec: MeasurementSpec) -> dict:
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

    times, zero_reads = _repeat(run, before=before, max_reps=p.get("max_reps", MAX_REPS))
    y, w = state["y"], state["w"]
    rows = torch.arange(0, m, max(1, m // 4))[:4]
    cols = torch.arange(0, n, max(1, n // 16))[:16]
    ref = x[rows].double() @ w[cols].double().T
    err = (y[rows][:, cols].double() - ref).abs()
    bound = k * _eps(dt) * (x[rows].double().abs() @ w[cols].double().abs().T) + 1e-30
    ok = bool((err <= bound).all())
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = {"times_s": times, "zero_reads": zero_reads, "ref_times_s": ref_times, "valid": ok, "flops": linear_flops(m, n, k),
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


def measure_decode(spec: MeasurementSpec) -> dict:
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

    times, zero_reads = _repeat(run, before=before, max_reps=p.get("max_reps", MAX_REPS))
    ok, err = _check_attention(q.unsqueeze(2), state["k"], state["v"], state["o"].unsqueeze(2))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = {"times_s": times, "zero_reads": zero_reads, "ref_times_s": ref_times, "valid": ok, "max_abs_err": err,
           "flops": 4 * b * h * ctx * d, "bytes": 2 * numel * itemsize + 2 * b * h * d * itemsize}
    if not ok:
        out["invalid_reason"] = f"attention output off by {err:.3e} from the float64 reference"
    return out


def measure_prefill(spec: MeasurementSpec) -> dict:
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

    times, zero_reads = _repeat(run, before=before, max_reps=p.get("max_reps", MAX_REPS))
    row0 = torch.arange(kv_len)[None, :] <= (torch.arange(n)[:, None] + c)
    ok, err = _check_attention(q, state["k"], state["v"], state["o"], row0)
    pairs = n * c + n * (n + 1) // 2
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = {"times_s": times, "zero_reads": zero_reads, "valid": ok, "max_abs_err": err, "pairs": pairs, "masked": mask is not None,
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


def measure_segment(spec: MeasurementSpec) -> dict:
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
    times, zero_reads = _repeat(run, before=before, max_reps=p.get("max_reps", MAX_REPS))
    ok = bool(check())
    out = {"times_s": times, "zero_reads": zero_reads, "valid": ok, "bytes": nbytes}
    if not ok:
        out["invalid_reason"] = f"{seg} output differs from its definition"
    return out
