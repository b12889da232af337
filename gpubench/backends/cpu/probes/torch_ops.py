"""The ops an eager PyTorch engine step runs on the CPU, timed where a step runs them (cold caches).

Why this probe exists: a CPU decode step spends its time in torch's GEMMs (MKL/oneDNN, whose
speed is not monotone in the row count M), in scaled-dot-product attention (whose cost on the
CPU follows the query heads, not the KV heads, under grouped-query attention) and in dozens of
small ops that cost 10-150 us each inside a step (after a weight-streaming GEMV has evicted the
caches) against 1-2 us in a hot loop. numpy's BLAS and hot-loop dispatch figures do not predict
that; these rows do, and ``gpubench fit`` turns them into the calibration's ``cpu_ops`` tables.

Families (``family`` field; every time is the calling thread's CPU time, ``time.thread_time``,
so a busy neighbour's share of the core is not counted; ``num_threads`` torch threads, 1 unless
``--set torch_ops.num_threads=N``, and at more than one the wall time, ``timer = "wall"``: see
``vllmref.thread_clock``):

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

This module plans the sweep and dispatches each spec; the sizes are in ``torch_ops_grid`` (which
vllm_ops shares) and the timed code in ``torch_ops_measure``.
"""
from __future__ import annotations

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.backends.cpu.probes import torch_ops_grid as grid
from gpubench.backends.cpu.probes.torch_ops_measure import measure_decode, measure_linear, measure_prefill, measure_segment
from gpubench.backends.probe_common import cold_pool_bytes, dtypes_option, llc_bytes, opt, torch_unavailable_reason


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
        dtypes = dtypes_option(cfg, "torch_ops", grid.DTYPES)
        families = tuple(f for f in str(opt(cfg, "torch_ops", "families", "linear,attn_decode,attn_prefill,segment")).split(",") if f)
        threads = opt(cfg, "torch_ops", "num_threads", 1)
        scale = opt(cfg, "torch_ops", "size_scale", 1.0)  # tests shrink every size
        max_m = opt(cfg, "torch_ops", "max_m", 1 << 30)
        max_rows = opt(cfg, "torch_ops", "max_rows", 1 << 30)  # segment T cap (tests)
        passes = opt(cfg, "torch_ops", "linear_passes", grid.QUICK_LINEAR_PASSES if q else grid.LINEAR_PASSES)
        pool = cold_pool_bytes(llc_bytes(cfg.device)) // 4  # elements of 4 bytes
        pool = int(pool * min(1.0, scale * 4)) if scale < 1 else pool
        common = {"num_threads": threads, "pool_elements": pool,
                  "max_reps": grid.QUICK_MAX_REPS if q else grid.MAX_REPS}

        def sz(v: int, floor: int = 1) -> int:
            return max(floor, int(v * scale))

        specs: list[MeasurementSpec] = []
        for dt in dtypes:
            if "linear" in families:
                for n, k, nn, kk, p, m in grid.linear_cells(q, scale, max_m, passes):
                    specs.append(MeasurementSpec(
                        key=grid.linear_key("torch_linear", dt, n, k, m, p),
                        params={**common, "family": "linear", "dtype": dt, "m": m, "n": nn, "k": kk, "pass": p},
                        label=f"linear {dt} M={m} N={nn} K={kk} pass {p + 1}/{passes}"))
            for h, hkv, d in (grid.QUICK_ATTN_HEADS if q else grid.ATTN_HEADS):
                if "attn_decode" in families:
                    for b in (grid.QUICK_DECODE_BATCH if q else grid.DECODE_BATCH):
                        for ctx in (grid.QUICK_DECODE_CONTEXT if q else grid.DECODE_CONTEXT):
                            if b * ctx > grid.MAX_DECODE_KV_TOKENS:
                                continue
                            specs.append(MeasurementSpec(
                                key=f"torch_attn_decode_{dt}_h{h}_kv{hkv}_d{d}_b{b}_l{ctx}",
                                params={**common, "family": "attn_decode", "dtype": dt, "heads": h,
                                        "kv_heads": hkv, "head_dim": d, "batch": b, "context": sz(ctx, 4)},
                                label=f"attn decode {dt} H={h}/{hkv} B={b} L={ctx}"))
                if "attn_prefill" in families:
                    for n_new in (grid.QUICK_PREFILL_NEW if q else grid.PREFILL_NEW):
                        for cached in (grid.QUICK_PREFILL_CACHED if q else grid.PREFILL_CACHED):
                            specs.append(MeasurementSpec(
                                key=f"torch_attn_prefill_{dt}_h{h}_kv{hkv}_d{d}_n{n_new}_c{cached}",
                                params={**common, "family": "attn_prefill", "dtype": dt, "heads": h,
                                        "kv_heads": hkv, "head_dim": d, "new_tokens": sz(n_new, 2),
                                        "cached_tokens": sz(cached, 0) if cached else 0},
                                label=f"attn prefill {dt} H={h}/{hkv} n={n_new} c={cached}"))
            if "segment" in families:
                for seg in grid.SEGMENTS:
                    for w in {"argmax": grid.ARGMAX_W, "kv_write": grid.KV_WRITE_W}.get(seg, grid.SEGMENT_W):
                        for t in (grid.QUICK_SEGMENT_T if q else grid.SEGMENT_T):
                            if (seg == "argmax" and t > 256) or t > max_rows:
                                continue  # argmax: one row per sequence, batches not token counts
                            specs.append(MeasurementSpec(
                                key=f"torch_segment_{seg}_{dt}_t{t}_w{w}",
                                params={**common, "family": "segment", "segment": seg, "dtype": dt,
                                        "rows": t, "width": max(grid.HEAD_DIM, sz(w, grid.HEAD_DIM) // grid.HEAD_DIM * grid.HEAD_DIM),
                                        "context_elements": sz(grid.FLUSH_ELEMENTS, 1024)},
                                label=f"segment {seg} {dt} T={t} W={w}"))
                        for ctx in (grid.QUICK_SEGMENT_CONTEXTS if q else grid.SEGMENT_CONTEXTS):
                            if ctx == grid.FLUSH_ELEMENTS:
                                continue  # the main grid's T = 1 row
                            specs.append(MeasurementSpec(
                                key=f"torch_segment_ctx_{seg}_{dt}_w{w}_c{ctx}",
                                params={**common, "family": "segment", "segment": seg, "dtype": dt, "rows": 1,
                                        "width": max(grid.HEAD_DIM, sz(w, grid.HEAD_DIM) // grid.HEAD_DIM * grid.HEAD_DIM),
                                        "context_elements": sz(ctx, 0) if ctx else 0},
                                label=f"segment {seg} {dt} T=1 W={w} after {ctx * 4 >> 10} KiB"))
        return _distinct(specs)

    def measure(self, spec: MeasurementSpec) -> dict:
        import torch

        from vllmref import thread_clock

        p = spec.params
        torch.set_num_threads(int(p["num_threads"]))
        timer = thread_clock.use_threads(int(p["num_threads"]))  # the wall clock at more than one thread
        with torch.inference_mode():
            fields = {"linear": measure_linear, "attn_decode": measure_decode,
                      "attn_prefill": measure_prefill, "segment": measure_segment}[p["family"]](spec)
        base = {k: v for k, v in p.items() if k != "pool_elements"}
        return {**base, "torch_version": str(torch.__version__), "timer": timer, **fields}


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
