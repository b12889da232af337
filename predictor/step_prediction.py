"""StepPrediction and OpTime: a predicted step and its per-op breakdown, and how ``StepModel.predict``
fills them in from its per-call op times.

Separate from predictor.step because the breakdown is a report built once per ``predict``: the
step model's arithmetic (and its scalar hot path, which returns no breakdown) stays in step.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from predictor.step import StepModel


@dataclass(frozen=True)
class OpTime:
    """One op's share of a step, summed over its calls (layers). Times in seconds."""

    name: str
    kind: str
    num_calls: int
    num_kernels: int
    flops: float
    bytes_read: float
    bytes_written: float
    weight_bytes: float
    gemm_mnk: tuple | None
    t_c_s: float
    t_m_s: float
    t_s: float  # what this op contributes to the total in the chosen form
    # Which roof the op sits under: "compute" when its arithmetic intensity (FLOPs per byte) is at or
    # above the ridge point of the rates it runs at (calibrated peak / calibrated bandwidth), else
    # "memory". Not t_c > t_m: a calibrated t_c carries the measured efficiency at the op's M, and a
    # batch-1 GEMV, which streams its weights, would read "compute bound" whenever that is low.
    bound: str
    t_fixed_s: float = 0.0  # the fixed per-kernel time inside t_s (GPU GEMMs, when calibrated)

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class StepPrediction:
    """A predicted step. ``total_s = blocks_s + launch_added_s + host_s + sample_s`` and
    ``blocks_s + sample_s = sum(op.t_s for op in ops.values())`` (the breakdown sums to the total).

    ``launch_s`` is the launch floor N_kern * t_launch (GPU) or the dispatch cost (CPU);
    ``launch_added_s`` is what it adds to the total (GPU: max(0, launch_s - blocks_s)).
    """

    total_s: float
    form: str
    backend: str
    ops: dict
    blocks_s: float
    compute_s: float
    memory_s: float
    launch_s: float
    launch_added_s: float
    host_s: float
    sample_s: float
    num_kernels: int
    num_seqs: int
    num_new_tokens: int
    tiers: dict = field(default_factory=dict)

    @property
    def bound(self) -> str:
        """What dominates the blocks. The max form: the roof the step takes (``blocks_s`` is the larger
        of ``compute_s`` and ``memory_s``). The additive form and the CPU op tables: "compute" when
        the compute-bound ops' time (each op's ``bound``) exceeds the memory-bound ops', else "memory"."""
        if self.form == "max":
            return "compute" if self.compute_s >= self.memory_s else "memory"
        t = {"compute": 0.0, "memory": 0.0}
        for name, op in self.ops.items():
            if name != "sample":
                t[op.bound] += op.t_s
        return "compute" if t["compute"] > t["memory"] else "memory"

    @property
    def blocks_rule(self) -> str:
        """How ``blocks_s`` is made of the ops, in words (``compute_s``/``memory_s`` are the sums of the
        ops' t_c and t_m in every form; only the max form takes its blocks from them)."""
        return {"max": "max(compute, memory)", "cpu_ops": "sum of the measured op tables' times"}.get(
            self.form, "sum over ops of max(t_c, t_m) + fixed")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ops"] = {k: {**asdict(v), "bytes": v.bytes} for k, v in self.ops.items()}
        d["bound"] = self.bound
        d["blocks_rule"] = self.blocks_rule
        return d


def _op_breakdown(model: StepModel, feats: np.ndarray, t_c: np.ndarray, t_m: np.ndarray, op_seconds,
                  fixed_s: np.ndarray) -> dict:
    """Per op of the step graph for one step (``feats`` (1, 5)): its calls, kernels (CPU: dispatched
    ops), FLOPs and bytes, the roofline's t_c and t_m, ``op_seconds(i, name, t_c, t_m)`` as its time
    and ``fixed_s[i]`` (per call) as the fixed kernel time inside it."""
    g = model.graph
    calls = g.num_calls
    flops = (feats @ g.flops.T)[0]
    b_read = g.per_call(feats, "bytes_read")[0]
    b_written = (feats @ g.bytes_written.T)[0]
    w = g.per_call(feats, "weight_read_bytes")[0]
    kernels_per_call = g.num_cpu_dispatches if model.hardware.backend == "cpu" else g.num_kernels
    ridge = model._flops_per_s / model._mem_bytes_per_s  # FLOPs per byte where the two roofs meet, per op
    ops = {}
    for i, spec in enumerate(g.ops):
        tc, tm = t_c[0, i] * calls[i], t_m[0, i] * calls[i]
        mnk = (int(feats[0, spec.m_feature]), *spec.gemm_nk) if spec.gemm_nk is not None else None
        op_flops, op_bytes = float(flops[i] * calls[i]), float((b_read[i] + b_written[i]) * calls[i])
        compute_bound = op_flops >= ridge[i] * op_bytes if op_bytes > 0 else op_flops > 0
        ops[spec.name] = OpTime(
            name=spec.name, kind=spec.kind, num_calls=int(calls[i]), num_kernels=int(calls[i] * kernels_per_call[i]),
            flops=op_flops, bytes_read=float(b_read[i] * calls[i]),
            bytes_written=float(b_written[i] * calls[i]), weight_bytes=float(w[i] * calls[i]),
            gemm_mnk=mnk, t_c_s=float(tc), t_m_s=float(tm), t_s=float(op_seconds(i, spec.name, tc, tm)),
            bound="compute" if compute_bound else "memory", t_fixed_s=float(fixed_s[i] * calls[i]))
    return ops


def roofline_prediction(model: StepModel, feats: np.ndarray, t_c: np.ndarray, t_m: np.ndarray,
                        op_t: np.ndarray, total: np.ndarray, parts: dict) -> StepPrediction:
    """``predict``'s breakdown of one step (``feats`` (1, 5)) from the per-call op times and the
    step totals ``StepModel._combine`` made of them."""
    g = model.graph
    compute_wins = parts["compute_s"][0] >= parts["memory_s"][0]

    def op_seconds(i, _name, tc, tm):
        if model.form == "additive" or i == g.sample_index:
            return op_t[0, i] * g.num_calls[i]
        return tc if compute_wins else tm

    # the max form prices the blocks as one roofline, with no per-kernel fixed time
    fixed = model._op_fixed_s if model.form == "additive" else np.zeros(g.num_ops)
    ops = _op_breakdown(model, feats, t_c, t_m, op_seconds, fixed)
    return StepPrediction(
        total_s=float(total[0]), form=model.form, backend=model.hardware.backend, ops=ops,
        blocks_s=float(parts["blocks_s"][0]), compute_s=float(parts["compute_s"][0]),
        memory_s=float(parts["memory_s"][0]), launch_s=float(model.launch_s),
        launch_added_s=float(parts["launch_added_s"][0]), host_s=float(parts["host_s"][0]),
        sample_s=float(parts["sample_s"][0]), num_kernels=int(model.num_kernels),
        num_seqs=int(feats[0, 2]), num_new_tokens=int(feats[0, 1]), tiers=model.calibration.tiers())


def table_prediction(model: StepModel, times: dict, feats: np.ndarray, t_c: np.ndarray, t_m: np.ndarray) -> StepPrediction:
    """``predict`` with the CPU op tables: each op's time is the table's (``times``, from
    ``CpuTableStep.op_times``); t_c/t_m stay the roofline's (what the op would take at peak rate or
    bandwidth, for reading the breakdown)."""
    ops = _op_breakdown(model, feats, t_c, t_m, lambda _i, name, _tc, _tm: times[name], np.zeros(model.graph.num_ops))
    sample_s = float(times["sample"])
    host_s = float(times.pop("engine", 0.0))  # vLLM's per-step engine cost (cpu_step.engine_s)
    blocks_s = float(sum(v for k, v in times.items() if k != "sample"))
    compute_s = float(sum(ops[k].t_c_s for k in ops if k != "sample"))
    memory_s = float(sum(ops[k].t_m_s for k in ops if k != "sample"))
    return StepPrediction(
        total_s=blocks_s + sample_s + host_s, form="cpu_ops", backend="cpu", ops=ops, blocks_s=blocks_s,
        compute_s=compute_s, memory_s=memory_s, launch_s=0.0, launch_added_s=0.0, host_s=host_s,
        sample_s=sample_s, num_kernels=int(model.num_kernels), num_seqs=int(feats[0, 2]),
        num_new_tokens=int(feats[0, 1]), tiers={**model.calibration.tiers(), "cpu_ops": "measured"})
