"""What a profiled step's ops are: kinds of torch ops and device kernels, their time per kind, how many
ran, and the profiler's C++ log lines kept off the terminal (predictor.profile for the eager engine,
predictor.profile_graph for the graph engine)."""
from __future__ import annotations

import contextlib
import os
import sys

_OP_KINDS = (
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
    ("linear", ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm")),
    ("kv_write", ("aten::index_put",)),
    ("sampling", ("aten::argmax",)),
    ("gather", ("aten::embedding", "aten::index", "aten::index_select")),
    ("copy", ("aten::to", "aten::_to_copy", "aten::copy_", "aten::lift_fresh", "aten::empty")),
)


def op_kind(name: str) -> str:
    """Kind of a top-level aten op ("elementwise" for norms, RoPE, activations, residuals)."""
    for kind, keys in _OP_KINDS:
        if any(name.startswith(k) or k in name for k in keys):
            return kind
    return "elementwise"


def op_times_by_kind(events, *, device_type: str) -> dict[str, float]:
    """Seconds per op kind from profiler events, attributed to each top-level op (no double count).

    CPU: the op's inclusive CPU time; CUDA: the device time of the kernels it launched.
    """
    out: dict[str, float] = {}
    for ev in events:
        if ev.cpu_parent is not None or not ev.name.startswith("aten::"):
            continue
        us = ev.device_time_total if device_type == "cuda" else ev.cpu_time_total
        out[op_kind(ev.name)] = out.get(op_kind(ev.name), 0.0) + us * 1e-6
    return out


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2 while the profiler runs: kineto prints two log lines per session
    from C++ (no setting turns them off), which would bury the progress bar."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def kernels_in(events, *, device_type: str) -> int:
    """Kernels one profiled step launched (CUDA; copies left out), or its top-level aten ops (CPU)."""
    import torch.profiler as tp

    if device_type == "cuda":
        return sum(1 for e in events if e.device_type == tp.DeviceType.CUDA and "memcpy" not in e.name.lower())
    return sum(1 for e in events if e.cpu_parent is None and e.name.startswith("aten::"))
