"""``python -m vllmref.worker_ops``: vLLM's own CPU linear and attention, timed for the ``vllm_ops`` probe.

Runs inside the vLLM environment as a long-lived child of the probe's worker: one JSON request
per stdin line, one JSON reply per stdout line, and it exits when stdin closes (so it dies with
the probe). Why a separate worker: vLLM on this CPU does not run its projections through
``torch.nn.functional.linear`` (MKL) but through oneDNN with a prepacked weight
(``dispatch_cpu_unquantized_gemm`` -> ``ops.create_onednn_mm(weight.t())`` once at load, then
``ops.onednn_mm(handler, x, bias)`` per call), whose cost in M differs from MKL's (a 4-row decode
costs vLLM ~1.06x a 1-row one, MKL ~1.9x); only the vLLM environment has that kernel.

Request: ``{"m", "n", "k", "dtype", "pool_bytes", "threads", "seed", "min_reps", "max_reps",
"min_timed_s", "ref_n", "ref_k", "ref_reps"}``. Each repetition calls a different handler from a
pool of prepacked weights whose total exceeds ``pool_bytes`` (2x the last-level cache), so no
repetition finds its weight in cache, as in a step. Times are the thread's CPU time. The reply
carries ``times_s`` (first = warm-up), ``ref_times_s`` (a cold 1 x ``ref_k`` x ``ref_n`` torch GEMV
timed beside it, the machine-phase reference every streaming probe row carries), ``valid`` and
``max_abs_err`` (sampled outputs against a float64 product, bound K*eps*|x||W|).

Attention request (``"op": "attention"``): ``{"heads", "kv_heads", "head_dim", "block_size",
"seq_lens", "query_lens", "dtype", "pool_bytes", ...}`` (and the repetition and reference fields
above). One call of vLLM's CPU paged-attention kernel (``ops.cpu_attention_with_kv_cache`` with
its ``cpu_attn_get_scheduler_metadata``, split-KV on, the ISA vLLM picks) over requests whose
query tokens are the last ``query_lens[i]`` of ``seq_lens[i]`` tokens (a decode: 1 of L; a
prefill chunk: n of c + n, causal), as the CPU attention backend issues it for a step's batch.
The paged KV cache is a pool of blocks larger than ``pool_bytes`` and every repetition reads
blocks no earlier repetition touched (the cache is cold, as in a step after a layer's weights
streamed). The output of one smaller problem of the same head configuration, its KV written with
vLLM's own ``cpu_attn_reshape_and_cache``, is checked against a float64 softmax(QK^T/sqrt(d))V.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from vllmref import thread_clock

MAX_HANDLERS = 2048   # the smallest weights stay below the pool size rather than allocating ~10^4 handlers
EPS = {"fp32": 2.0**-23, "bf16": 2.0**-7}


class _State:
    """The handler pool of the last (n, k, dtype) asked for, and the reference buffer."""

    def __init__(self):
        self.shape = None
        self.weights: list = []
        self.handlers: list = []
        self.cursor = 0
        self.ref_pool = None
        self.ref_cursor = 0


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _pool_for(state: _State, req: dict) -> None:
    import torch
    from vllm import _custom_ops as ops

    shape = (req["n"], req["k"], req["dtype"], req["pool_bytes"])
    if state.shape == shape:
        return
    state.weights, state.handlers = [], []  # free the previous shape's pool first
    n, k = req["n"], req["k"]
    itemsize = torch.empty(0, dtype=_dtype(req["dtype"])).element_size()
    count = max(2, min(MAX_HANDLERS, -(-req["pool_bytes"] // (n * k * itemsize))))
    gen = torch.Generator().manual_seed(int(req["seed"]))
    for _ in range(count):
        w = (torch.rand(n, k, generator=gen) * 2 - 1).to(_dtype(req["dtype"]))
        state.weights.append(w)
        state.handlers.append(ops.create_onednn_mm(w.t(), 32))  # what vLLM's layer dispatch builds
    state.shape, state.cursor = shape, 0


def repeat_timed(call, req: dict, before=None) -> tuple[list[float], int]:
    """Seconds of ``call()`` by the request's repetition rule (``thread_clock.repeat``: the loop every
    torch_ops row is timed with; the wall clock at more than one thread), and the zero readings retaken."""
    return thread_clock.repeat(call, min_reps=req["min_reps"], max_reps=req["max_reps"],
                               min_timed_s=req["min_timed_s"], before=before)


def reference_gemv_times(state: _State, req: dict) -> list[float]:
    import torch
    import torch.nn.functional as F

    n, k = req["ref_n"], req["ref_k"]
    if state.ref_pool is None or state.ref_pool.numel() < 2 * n * k:
        elements = max(req["pool_bytes"] // 4, 2 * n * k)
        state.ref_pool = torch.empty(elements, dtype=torch.float32).uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
    x = torch.ones(1, k)
    times = []
    for _ in range(req["ref_reps"]):
        if state.ref_cursor + n * k > state.ref_pool.numel():
            state.ref_cursor = 0
        w = state.ref_pool[state.ref_cursor:state.ref_cursor + n * k].view(n, k)
        state.ref_cursor += n * k
        times.append(thread_clock.time_once(lambda: F.linear(x, w))[0])
    return times


def measure(state: _State, req: dict) -> dict:
    import torch
    from vllm import _custom_ops as ops

    torch.set_num_threads(int(req["threads"]))
    timer = thread_clock.use_threads(int(req["threads"]))  # the wall clock at more than one thread
    _pool_for(state, req)
    m, n, k = req["m"], req["n"], req["k"]
    x = (torch.rand(m, k, generator=torch.Generator().manual_seed(int(req["seed"]) + m)) * 2 - 1).to(_dtype(req["dtype"]))
    ref_times = reference_gemv_times(state, req)
    last: dict = {}

    def before():  # every repetition calls the next prepacked weight of the pool
        last["handler"] = state.cursor
        state.cursor = (state.cursor + 1) % len(state.handlers)

    def call():
        last["y"] = ops.onednn_mm(state.handlers[last["handler"]], x, None)

    with torch.inference_mode():
        times, zero_reads = repeat_timed(call, req, before=before)
    handler_index, y = last["handler"], last["y"]
    w = state.weights[handler_index]
    rows = torch.arange(0, m, max(1, m // 4))[:4]
    cols = torch.arange(0, n, max(1, n // 16))[:16]
    ref = x[rows].double() @ w[cols].double().T
    err = (y[rows][:, cols].double() - ref).abs()
    bound = k * EPS[req["dtype"]] * (x[rows].double().abs() @ w[cols].double().abs().T) + 1e-30
    ok = bool((err <= bound).all())
    out = {"times_s": times, "zero_reads": zero_reads, "ref_times_s": ref_times, "valid": ok, "max_abs_err": float(err.max()),
           "num_weights": len(state.handlers), "timer": timer}
    if not ok:
        out["invalid_reason"] = f"max |y - y_ref| = {float(err.max()):.3e} exceeds the K*eps*|x||W| bound"
    return out


class _AttentionState:
    """The KV block pool of the last head configuration asked for, and its checked configurations;
    ``reference``: the linear family's state, whose buffer the reference GEMV reads."""

    def __init__(self, reference: _State):
        self.reference = reference
        self.shape: tuple | None = None
        self.kv_cache: Any = None  # a torch tensor (torch is imported in the worker's functions)
        self.cursor = 0
        self.checked: dict = {}


def _attention_isa(dtype, block_size: int, head_dim: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


def _split_cache(kv_cache):
    """Key and value views of a [blocks, kv_heads, block_size, 2 * head_dim] cache (vLLM's layout)."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)


def _attention_call(query, key_cache, value_cache, output, query_lens, seq_lens, block_table, req: dict, isa: str):
    import math

    import torch
    from vllm import _custom_ops as ops

    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=req["heads"], num_kv_heads=req["kv_heads"], head_dim=req["head_dim"],
        seq_lens=lens, dtype=query.dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=True)

    def call():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=query_start,
            seq_lens=lens, scale=1.0 / math.sqrt(req["head_dim"]), causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    return call


def _check_attention(req: dict, isa: str) -> float:
    """Max |error| of one 48-query, 300-key causal problem of this head configuration against float64."""
    import math

    import torch
    from vllm import _custom_ops as ops

    heads, kv_heads, dim, block_size = req["heads"], req["kv_heads"], req["head_dim"], req["block_size"]
    dtype = _dtype(req["dtype"])
    num_new, num_keys = 48, 300
    num_blocks = -(-num_keys // block_size)
    gen = torch.Generator().manual_seed(int(req["seed"]))
    k, v = ((torch.rand(num_keys, kv_heads, dim, generator=gen) * 2 - 1).to(dtype) for _ in range(2))
    q = (torch.rand(num_new, heads, dim, generator=gen) * 2 - 1).to(dtype)
    kv_cache = torch.zeros(num_blocks + 1, kv_heads, block_size, 2 * dim, dtype=dtype)
    key_cache, value_cache = _split_cache(kv_cache)
    block_table = torch.arange(1, num_blocks + 1, dtype=torch.int32)[None]
    positions = torch.arange(num_keys)
    slots = (block_table[0, positions // block_size] * block_size + positions % block_size).long()
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    out = torch.empty(num_new, heads, dim, dtype=dtype)
    _attention_call(q, key_cache, value_cache, out, [num_new], [num_keys], block_table, req, isa)()
    group = heads // kv_heads
    kd, vd = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kd) / math.sqrt(dim)
    visible = torch.arange(num_keys)[None, :] <= torch.arange(num_keys - num_new, num_keys)[:, None]
    ref = torch.einsum("hnl,lhd->nhd", scores.masked_fill(~visible[None], float("-inf")).softmax(-1), vd)
    return float((out.double() - ref).abs().max())


def measure_attention(state: _AttentionState, req: dict) -> dict:
    import torch

    torch.set_num_threads(int(req["threads"]))
    timer = thread_clock.use_threads(int(req["threads"]))  # the wall clock at more than one thread
    dtype = _dtype(req["dtype"])
    heads, kv_heads, dim, block_size = req["heads"], req["kv_heads"], req["head_dim"], req["block_size"]
    seq_lens, query_lens = [int(v) for v in req["seq_lens"]], [int(v) for v in req["query_lens"]]
    if len(seq_lens) != len(query_lens) or any(q < 1 or q > s for q, s in zip(query_lens, seq_lens)):
        raise ValueError("query_lens must be 1..seq_len for each request")
    isa = _attention_isa(dtype, block_size, dim)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    block_bytes = kv_heads * block_size * 2 * dim * torch.empty(0, dtype=dtype).element_size()
    pool_blocks = max(2 * sum(blocks_per_req), -(-req["pool_bytes"] // block_bytes))
    shape = (kv_heads, dim, block_size, req["dtype"], pool_blocks)
    if state.shape != shape:
        state.kv_cache = None  # free the previous pool first
        state.kv_cache = torch.empty(pool_blocks, kv_heads, block_size, 2 * dim, dtype=dtype).uniform_(
            -1, 1, generator=torch.Generator().manual_seed(int(req["seed"])))
        state.shape, state.cursor = shape, 0
    key_cache, value_cache = _split_cache(state.kv_cache)
    config = (heads, kv_heads, dim, block_size, req["dtype"])
    if config not in state.checked:
        state.checked[config] = _check_attention(req, isa)
    gen = torch.Generator().manual_seed(int(req["seed"]) + len(seq_lens))
    query = (torch.rand(sum(query_lens), heads, dim, generator=gen) * 2 - 1).to(dtype)
    output = torch.empty_like(query)
    ref_times = reference_gemv_times(state.reference, req)
    prepared: dict = {}

    def before():  # fresh blocks each repetition: a cold cache
        block_table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
        for i, num_blocks in enumerate(blocks_per_req):
            if state.cursor + num_blocks > pool_blocks:
                state.cursor = 0
            block_table[i, :num_blocks] = torch.arange(state.cursor, state.cursor + num_blocks)
            state.cursor += num_blocks
        prepared["call"] = _attention_call(query, key_cache, value_cache, output, query_lens, seq_lens, block_table,
                                           req, isa)

    with torch.inference_mode():
        times, zero_reads = repeat_timed(lambda: prepared["call"](), req, before=before)
    err = state.checked[config]
    bound = 1e-4 if req["dtype"] == "fp32" else 3e-2
    valid = bool(err <= bound) and bool(torch.isfinite(output).all())
    out = {"times_s": times, "zero_reads": zero_reads, "ref_times_s": ref_times, "valid": valid,
           "max_abs_err": err, "isa": isa, "pool_blocks": pool_blocks, "timer": timer}
    if not out["valid"]:
        out["invalid_reason"] = f"attention output off by {err:.3e} from the float64 reference (bound {bound:g})"
    return out


def main() -> int:
    try:
        import torch
        import vllm
        from vllm import _custom_ops as ops
    except Exception as e:  # an environment that cannot import vLLM is one line for the probe
        print(json.dumps({"error": f"cannot import vLLM: {type(e).__name__}: {e}"}), flush=True)
        return 2
    if not ops._supports_onednn:
        print(json.dumps({"error": "this vLLM build has no oneDNN linear (create_onednn_mm_handler)"}), flush=True)
        return 2
    print(json.dumps({"ready": True, "vllm_version": vllm.__version__, "torch_version": str(torch.__version__)}), flush=True)
    state = _State()
    attention_state = _AttentionState(reference=state)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            reply = measure_attention(attention_state, req) if req.get("op") == "attention" else measure(state, req)
        except Exception as e:  # one bad request is that row's error, not the end of the worker
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
