"""What a run's ``kernels`` probe gives a GPU calibration: decode attention's fixed time and time per
sequence, and the floors of tiny real kernels beside the launch probe's empty ones.

- ``t_attn_fixed_s`` and ``t_attn_seq_s``: the line, in relative error, of a decode attention call's
  time net of its bytes at the fitted streaming rate (bytes / (B x eta_max)) and of one graph-node
  interval, against the batch size, over the rows at the probe's smallest context (16 cached tokens
  a sequence: the KV read is small there, and what is left is the kernel's floor and what each
  sequence adds). The same two parameters ``gpubench fit --from-silicon`` fits from measured kernel
  tables; here they come from this GPU's probes alone. Both clipped at 0.
- the fit report's ``kernel_floor_us``: per tiny op (add, gemv, reduce) and mode (eager, graph), the
  median time per kernel in microseconds, and ``kernel_floor_over_interval``: each graph floor over
  the launch probe's empty graph node, which says how much a real kernel costs beyond the interval
  the step model charges per kernel (reported, not folded into a parameter).
"""
from __future__ import annotations

import numpy as np

from predictor.calibrate_compute import finite_or_none, valid_rows
from predictor.calibration_model import Param
from predictor.hardware import HardwareSpec


def _per_call_s(rows) -> np.ndarray:
    count = rows["count"].fillna(1).to_numpy(float) if "count" in rows.columns else np.ones(len(rows))
    return rows["t_median_s"].to_numpy(float) / np.maximum(count, 1.0)


def fit_kernels(run, hw: HardwareSpec, params: dict, report: dict) -> None:
    """Set the attention parameters a ``kernels`` run supports in ``params``; floors into ``report``."""
    rows = valid_rows(run.frames.get("kernels"))
    if rows is None or len(rows) == 0 or "kind" not in rows.columns:
        return
    floor = rows[rows["kind"] == "floor"]
    if len(floor):
        per = _per_call_s(floor)
        report["kernel_floor_us"] = {f"{op} {mode}": round(float(t) * 1e6, 3)
                                     for op, mode, t in zip(floor["op"], floor["mode"], per)}
        node = params.get("t_graph_node_s")
        if node is not None and node.tier == "measured" and node.value > 0:
            graph = floor["mode"].to_numpy() == "graph"
            report["kernel_floor_over_interval"] = {op: round(float(t) / node.value, 2)
                                                    for op, t in zip(floor["op"][graph], per[graph])}
    attn = rows[rows["kind"] == "attn_decode"]
    if len(attn) == 0:
        return
    small = attn[attn["context"] == attn["context"].min()]
    if small["batch"].nunique() < 2:
        report["attn_floor_skipped"] = "fewer than two batch sizes at the smallest context"
        return
    mem_rate = hw.mem_bytes_per_s * params["eta_max"].value
    node_s = params["t_graph_node_s"].value if "t_graph_node_s" in params else 0.0
    measured = _per_call_s(small)
    net = measured - small["bytes"].to_numpy(float) / mem_rate - node_s
    batch = small["batch"].to_numpy(float)
    cov = None
    if len(small) > 3:  # a covariance needs more points than the line has parameters plus one
        (per_seq, intercept), cov = np.polyfit(batch, net, 1, w=1.0 / measured, cov=True)
    else:
        per_seq, intercept = np.polyfit(batch, net, 1, w=1.0 / measured)
    what = (f"{run.run_dir}: kernels probe, decode attention (SDPA, graph-timed) at {int(small['context'].min())} cached "
            f"tokens, batch {int(batch.min())}-{int(batch.max())} ({len(small)} rows): the line of per-call time - bytes / "
            f"(B x eta_max) - one graph-node interval against the batch size, in relative error")
    err = (lambda i: finite_or_none(float(np.sqrt(cov[i, i])))) if cov is not None else (lambda i: None)
    params["t_attn_fixed_s"] = Param(max(float(intercept), 0.0), err(1), "measured", what + ": its intercept")
    params["t_attn_seq_s"] = Param(max(float(per_seq), 0.0), err(0), "measured", what + ": its slope")
