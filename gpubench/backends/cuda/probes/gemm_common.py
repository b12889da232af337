"""What the two GEMM paths share (gemm.py times torch's cuBLAS, gemm_cupy.py CuPy's): how a result is
checked, how many weight copies defeat the L2, and when calls are timed inside one CUDA graph.

Its own module so that neither path imports the other's (gemm.py picks a path; gemm_cupy.py needs
only these).
"""
from __future__ import annotations

import math

# Unit roundoff of the inputs (tf32 keeps 10 mantissa bits) for the validation tolerance.
GEMM_EPS = {"bf16": 2.0**-8, "fp16": 2.0**-11, "tf32": 2.0**-11}

GRAPH_TIMING_BELOW_S = 50e-6  # calls shorter than this are timed inside a CUDA graph
GRAPH_CALLS = 32               # matmuls per captured graph


def gemm_tolerance(dtype: str, k: int) -> float:
    """Max |C - C_ref| accepted for inputs in [-1, 1]: 8 eps sqrt(K) (rounding errors add like a walk)."""
    return 8.0 * GEMM_EPS[dtype] * math.sqrt(k)


def weight_copies(b_bytes: int, l2_bytes: int) -> int:
    """Copies of B (at most 8) that together cover 2x L2, so consecutive calls read B from memory."""
    return max(1, min(8, math.ceil(2 * l2_bytes / b_bytes))) if l2_bytes else 1


def gemm_check_result(err: float, dtype: str, k: int, num_rows: int) -> dict:
    """The validation fields of a GEMM row from the largest error over ``num_rows`` checked rows."""
    tol = gemm_tolerance(dtype, k)
    ok = math.isfinite(err) and err <= tol
    return {"valid": ok, "max_abs_err": err, "tol": tol,
            "check": f"{num_rows} rows of C vs a float64 product: max |err| {err:.3g} {'<=' if ok else '>'} tol {tol:.3g}"}
