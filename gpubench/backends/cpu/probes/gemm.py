"""GEMM through numpy's BLAS on the CPU, fp32 and fp64, decode-shaped and square.

Decode shapes are ``x @ W.T`` with activations x (M, K) and a weight W (N, K) stored row-major as a
model stores it; M = 1, 2, 4, ..., 512 tokens. The (N, K) pairs are the four projections of
Llama-3.2-1B (common/model_configs/llama-3.2-1b.json: hidden 2048, intermediate 8192, 32 heads,
8 KV heads, head_dim 64), fixed here because gpubench must not import predictor:

    qkv      N = 2048 + 2*8*64 = 3072, K = 2048
    o        N = 2048,                 K = 2048
    gate_up  N = 2*8192 = 16384,       K = 2048
    down     N = 2048,                 K = 8192

Square shapes M = N = K are added for the library's best case. FLOPs = 2*M*N*K; bytes = A, B and
C once. A weight smaller than 2x LLC is rotated among copies so that repetitions stream it from
memory as a real decode step does. Timed with time.perf_counter (CLOCK_MONOTONIC) around the
blocking call. Validation: a sample of output entries against a float64 product of the same rows
and columns, within K * eps(dtype) * (|A||B|) elementwise (the standard GEMM error bound).
"""
from __future__ import annotations

import math
import time
import zlib

import numpy as np

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.backends.probe_common import llc_bytes, opt

MODEL_SHAPES = {  # name -> (N, K), from llama-3.2-1b (see module docstring)
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
}
M_VALUES = tuple(2**i for i in range(10))  # 1 .. 512
QUICK_M_VALUES = (1, 16, 256)
SQUARE = (256, 512, 1024, 2048)
QUICK_SQUARE = (512,)
DTYPES = {"fp32": np.float32, "fp64": np.float64}


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def gemm_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    return (m * k + n * k + m * n) * itemsize


def blas_library() -> str:
    """``numpy-blas:<name> <version>`` from numpy's build configuration."""
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]
        return f"numpy-blas:{blas.get('name', 'unknown')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - older numpy: the name is informational only
        return "numpy-blas:unknown"


class GemmProbe(Probe):
    name = "gemm"
    description = "BLAS GEMM via numpy, fp32/fp64, Llama-3.2-1B decode shapes and square"
    timer = "steady_clock"
    time_budget_s = 900.0

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        ms = QUICK_M_VALUES if cfg.quick else M_VALUES
        shapes = ("qkv", "down") if cfg.quick else tuple(MODEL_SHAPES)
        squares = QUICK_SQUARE if cfg.quick else SQUARE
        max_m = opt(cfg, "gemm", "max_m", max(ms))
        max_square = opt(cfg, "gemm", "max_square", max(squares))
        scale = opt(cfg, "gemm", "shape_scale", 1.0)  # tests shrink N and K
        reps = opt(cfg, "gemm", "num_reps", cfg.num_reps)
        llc = llc_bytes(cfg.device)
        specs = []
        for dtype in DTYPES:
            for shape in shapes:
                n, k = (max(8, int(v * scale)) for v in MODEL_SHAPES[shape])
                for m in ms:
                    if m <= max_m:
                        specs.append(self._spec(dtype, shape, m, n, k, reps, llc, "llama-3.2-1b"))
            for s in squares:
                if s <= max_square:
                    specs.append(self._spec(dtype, "square", s, s, s, reps, llc, "square"))
        return specs

    @staticmethod
    def _spec(dtype, shape, m, n, k, reps, llc, source) -> MeasurementSpec:
        key = f"gemm_{dtype}_square_{m}" if shape == "square" else f"gemm_{dtype}_{shape}_m{m}"
        return MeasurementSpec(key=key, params={"dtype": dtype, "shape": shape, "m": m, "n": n, "k": k,
                                                "num_reps": reps, "llc_bytes": llc, "shape_source": source},
                               label=f"{dtype} {shape} M={m}")

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        dt = DTYPES[p["dtype"]]
        m, n, k = p["m"], p["n"], p["k"]
        rng = np.random.default_rng(zlib.crc32(spec.key.encode()))
        a = rng.uniform(-1, 1, size=(m, k)).astype(dt)
        w_bytes = n * k * np.dtype(dt).itemsize
        num_copies = 1 if w_bytes >= 2 * p["llc_bytes"] else min(8, math.ceil(2 * p["llc_bytes"] / w_bytes))
        weights = [rng.uniform(-1, 1, size=(n, k)).astype(dt) for _ in range(num_copies)]
        c = np.empty((m, n), dtype=dt)
        np.matmul(a, weights[0].T, out=c)  # warm-up: BLAS thread pool start, page faults
        times = []
        for i in range(p["num_reps"]):
            w = weights[i % num_copies]
            t0 = time.perf_counter()
            np.matmul(a, w.T, out=c)
            times.append(time.perf_counter() - t0)
        err, tol, ok = _check(a, weights[(p["num_reps"] - 1) % num_copies], c, rng)
        row = {
            "dtype": p["dtype"], "shape": p["shape"], "m": m, "n": n, "k": k,
            "flops": gemm_flops(m, n, k), "bytes": gemm_bytes(m, n, k, np.dtype(dt).itemsize),
            "library": blas_library(), "shape_source": p["shape_source"], "weight_copies": num_copies,
            "times_s": times, "valid": ok, "max_abs_err": err, "tol": tol,
        }
        if not ok:
            row["invalid_reason"] = f"max |C - C_ref| = {err:.3e} exceeds K*eps*|A||B| bound {tol:.3e}"
        return row


def _check(a: np.ndarray, w: np.ndarray, c: np.ndarray, rng) -> tuple[float, float, bool]:
    """Sampled check of c = a @ w.T against float64; (max abs error, max bound, all within bound)."""
    m, k = a.shape
    n = w.shape[0]
    rows = rng.choice(m, size=min(m, 4), replace=False)
    cols = rng.choice(n, size=min(n, 16), replace=False)
    a64, w64 = a[rows].astype(np.float64), w[cols].astype(np.float64)
    ref = a64 @ w64.T
    err = np.abs(c[np.ix_(rows, cols)].astype(np.float64) - ref)
    bound = k * np.finfo(a.dtype).eps * (np.abs(a64) @ np.abs(w64).T)
    return float(err.max()), float(bound.max()), bool(np.all(err <= bound))
