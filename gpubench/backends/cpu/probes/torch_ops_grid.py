"""The torch_ops sweep: its sizes, the bounds that cut it, the repetition rule, the reference GEMV
and the linear work formulas.

Constants and two formulas only, apart from the probe (``torch_ops``) and its measurements
(``torch_ops_measure``): the vllm_ops probe measures vLLM's linear and attention on this same grid
with this same repetition rule, and the predictor times the same reference GEMV beside its step rows.
"""
from __future__ import annotations

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
QUICK_SEGMENT_T = (1, 4, 16, 64, 256, 1024)  # past the largest T the tables go proportional to T
SEGMENT_W = (512, 2048, 8192)
KV_WRITE_W = (128, 512, 2048)     # K/V widths (KV heads x head_dim) of real models
KV_WRITE_SLOTS = 16               # positions per cache row: the write scatters, the row length does not matter
ARGMAX_W = (8192, 32768, 131072)  # vocabularies
EMBED_ROWS = 32000
HEAD_DIM = 64                     # rope and kv_write heads
DTYPES = ("fp32", "bf16")
MIN_TIMED_S = 0.05                # keep repeating until this much was timed ...
MIN_REPS, MAX_REPS = 5, 40        # ... within these bounds (the first repetition is the warm-up)
QUICK_MAX_REPS = 12               # --quick: each repetition of a cold op pays an untimed flush GEMV,
                                  # so the repetition cap is what a quick run's segments cost
FLUSH_ELEMENTS = 1 << 22          # 16 MiB GEMV before each segment repetition
# Segments at T = 1 after context GEMVs of these sizes (elements): what a step's preceding projection
# evicts decides a small op's fixed cost (38 us hot, ~150 us after a 16 MiB GEMV, for an RMSNorm here).
SEGMENT_CONTEXTS = (0, 1 << 17, 1 << 19, 1 << 20, 1 << 22)
QUICK_SEGMENT_CONTEXTS = (0, 1 << 18, 1 << 22)
REFERENCE_SHAPE = (1024, 1024)    # (N, K) of the reference GEMV timed next to every streaming row
REFERENCE_REPS = 7
# Each linear (N, K) node's M sweep runs this many times, and the fit takes each (N, K, M) cell's
# median over the passes. One pass times a cell in one burst of a few tens of ms, and a burst that
# falls in a slow moment of a shared host stays an outlier even after the reference GEMV's phase
# correction: on the AMD VM, oneDNN's (N, K, M) = (16384, 1024, 3) cell read 8.62 ms normalized
# where five later passes read 4.19-5.08 ms, and it priced every model near that shape at B = 3.
LINEAR_PASSES = 3
QUICK_LINEAR_PASSES = 2


def linear_sweep(ms: tuple[int, ...], passes: int) -> list[tuple[int, int]]:
    """``(pass, M)`` in measurement order: ``passes`` sweeps over ``ms``, each starting at a
    different M, so that a cell's passes sit at different places in their sweeps."""
    if passes < 1:
        from common.errors import ConfigError

        raise ConfigError(f"linear_passes must be >= 1 (got {passes})")
    order = []
    for p in range(passes):
        shift = (p * len(ms)) // passes
        order += [(p, m) for m in ms[shift:] + ms[:shift]]
    return order


def linear_key(prefix: str, dtype: str, n: int, k: int, m: int, pass_index: int) -> str:
    """A linear row's key; the first pass keeps the single-pass key, so a run taken before passes
    existed resumes into them."""
    return f"{prefix}_{dtype}_n{n}_k{k}_m{m}" + (f"_p{pass_index}" if pass_index else "")


def linear_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def linear_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    return (m * k + n * k + m * n) * itemsize


def linear_cells(quick: bool, scale: float, max_m: int, passes: int):
    """The linear grid both engines' probes sweep, in measurement order: ``(n, k, n_scaled,
    k_scaled, pass, m)`` per cell and pass (weights over MAX_WEIGHT_ELEMENTS and calls over
    MAX_CALL_FLOPS left out; sizes scaled in tests, at least 8)."""
    for k in (QUICK_LINEAR_K if quick else LINEAR_K):
        for n in (QUICK_LINEAR_N if quick else LINEAR_N):
            kk, nn = max(8, int(k * scale)), max(8, int(n * scale))
            if nn * kk > MAX_WEIGHT_ELEMENTS:
                continue
            ms = tuple(m for m in (QUICK_LINEAR_M if quick else LINEAR_M)
                       if m <= max_m and linear_flops(m, nn, kk) <= MAX_CALL_FLOPS)
            for p, m in linear_sweep(ms, passes):
                yield n, k, nn, kk, p, m
