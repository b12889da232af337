"""``python -m vllmref.worker_ops``: vLLM's own CPU linear, timed for the ``vllm_ops`` probe.

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
"""
from __future__ import annotations

import json
import sys
import time

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


def _reference(state: _State, req: dict) -> list[float]:
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
        t0 = time.thread_time()
        F.linear(x, w)
        times.append(time.thread_time() - t0)
    return times


def measure(state: _State, req: dict) -> dict:
    import torch
    from vllm import _custom_ops as ops

    torch.set_num_threads(int(req["threads"]))
    _pool_for(state, req)
    m, n, k = req["m"], req["n"], req["k"]
    x = (torch.rand(m, k, generator=torch.Generator().manual_seed(int(req["seed"]) + m)) * 2 - 1).to(_dtype(req["dtype"]))
    ref_times = _reference(state, req)
    times: list[float] = []
    timed = 0.0
    y = handler_index = None
    with torch.inference_mode():
        while len(times) < req["min_reps"] or (timed < req["min_timed_s"] and len(times) < req["max_reps"]):
            handler_index = state.cursor
            state.cursor = (state.cursor + 1) % len(state.handlers)
            t0 = time.thread_time()
            y = ops.onednn_mm(state.handlers[handler_index], x, None)
            dt = time.thread_time() - t0
            times.append(dt)
            if len(times) > 1:
                timed += dt
    w = state.weights[handler_index]
    rows = torch.arange(0, m, max(1, m // 4))[:4]
    cols = torch.arange(0, n, max(1, n // 16))[:16]
    ref = x[rows].double() @ w[cols].double().T
    err = (y[rows][:, cols].double() - ref).abs()
    bound = k * EPS[req["dtype"]] * (x[rows].double().abs() @ w[cols].double().abs().T) + 1e-30
    ok = bool((err <= bound).all())
    out = {"times_s": times, "ref_times_s": ref_times, "valid": ok, "max_abs_err": float(err.max()),
           "num_weights": len(state.handlers)}
    if not ok:
        out["invalid_reason"] = f"max |y - y_ref| = {float(err.max()):.3e} exceeds the K*eps*|x||W| bound"
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
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = measure(state, json.loads(line))
        except Exception as e:  # one bad request is that row's error, not the end of the worker
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
