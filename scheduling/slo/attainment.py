"""How often a replay met an :class:`~scheduling.slo.spec.SLOSpec`: per kind, per turn, per job, and
the goodputs built on them.

Over a replay's ``turns`` and ``jobs`` frames (scheduling.experiments.metrics):

- a turn meets ``ttft`` when ttft_s <= target; ``tpot`` when (finish - first token) / (output - 1)
  <= target (a one-token turn has no inter-token time and meets it); ``tool_turn`` when it is not
  its job's last turn and finish - arrival <= target (a last turn triggers no tool: it meets it);
- a turn meets the SLO when it meets every kind that applies to it; a job when every one of its
  turns does and, with a ``job`` target, jct_s <= target;
- attainment of a kind is the share of the turns (jobs, for ``job``) it applies to that meet it
  (None for a kind the SLO leaves out);
- job goodput: jobs meeting the SLO per second, token goodput: output tokens of turns meeting it
  per second, both over the replay's span (first arrival to last finish), as its throughputs are.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from scheduling.slo.spec import SLOSpec


def turn_checks(turns: pd.DataFrame, jobs: pd.DataFrame, slo: SLOSpec) -> pd.DataFrame:
    """Per turn: booleans ``ttft_ok``, ``tpot_ok``, ``tool_turn_ok``, ``ok`` and whether ``tool_turn``
    applies (``has_tool``)."""
    last = jobs.set_index("job_id")["num_turns"] - 1
    has_tool = (turns["turn"].to_numpy() < turns["job_id"].map(last).to_numpy())
    after_first = (turns["output_tokens"] - 1).to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = (turns["finish_s"] - turns["first_token_s"]).to_numpy(float) / after_first
    latency = (turns["finish_s"] - turns["arrival_s"]).to_numpy(float)
    ones = np.ones(len(turns), dtype=bool)
    ttft_ok = ones if slo.ttft_s is None else turns["ttft_s"].to_numpy(float) <= slo.ttft_s
    tpot_ok = ones if slo.tpot_s is None else np.where(after_first > 0, tpot <= slo.tpot_s, True)
    tool_ok = ones if slo.tool_turn_s is None else np.where(has_tool, latency <= slo.tool_turn_s, True)
    return pd.DataFrame({"job_id": turns["job_id"].to_numpy(), "has_tool": has_tool, "ttft_ok": ttft_ok,
                         "tpot_ok": tpot_ok, "tool_turn_ok": tool_ok, "ok": ttft_ok & tpot_ok & tool_ok})


def attainment(turns: pd.DataFrame, jobs: pd.DataFrame, slo: SLOSpec, *, checks: pd.DataFrame | None = None) -> dict:
    """The ``slo_attainment`` block of a replay summary (module docstring); ``checks``: this
    :func:`turn_checks` when the caller has it already."""
    if not len(turns) or not len(jobs):
        return {"slo": slo.to_dict(), "turns": 0, "jobs": 0}
    checks = turn_checks(turns, jobs, slo) if checks is None else checks
    job_turns_ok = checks.groupby("job_id")["ok"].all()
    job_ok = jobs["job_id"].map(job_turns_ok).fillna(False).to_numpy(bool)
    jct_ok = np.ones(len(jobs), dtype=bool) if slo.job_s is None else jobs["jct_s"].to_numpy(float) <= slo.job_s
    job_ok = job_ok & jct_ok
    span_s = max(float(jobs["finish_s"].max() - jobs["arrival_s"].min()), 1e-12)
    tool = checks["has_tool"].to_numpy(bool)
    return {
        "slo": slo.to_dict(),
        "turns": int(len(turns)),
        "jobs": int(len(jobs)),
        # a kind the SLO leaves out has no attainment (None), as the job deadline without a target
        "ttft": float(checks["ttft_ok"].mean()) if slo.ttft_s is not None else None,
        "tpot": float(checks["tpot_ok"].mean()) if slo.tpot_s is not None else None,
        "tool_turn": float(checks["tool_turn_ok"].to_numpy()[tool].mean()) if tool.any() and slo.tool_turn_s is not None else None,
        "job_deadline": float(jct_ok.mean()) if slo.job_s is not None else None,
        "turn": float(checks["ok"].mean()),
        "job": float(job_ok.mean()),
        "job_goodput_per_s": float(job_ok.sum()) / span_s,
        "token_goodput_per_s": float(turns["output_tokens"].to_numpy()[checks["ok"].to_numpy(bool)].sum()) / span_s,
    }

def summary_rows(a: dict | None, f) -> list[tuple[str, str]]:
    """The replay summary table's rows of an ``attainment`` block (``f(value, fmt)`` formats one), none without one."""
    if not a or not a.get("turns"):
        return []
    kinds = " / ".join(f(a.get(k), "{:.1%}") for k in ("ttft", "tpot", "tool_turn", "job_deadline"))
    return [(f"SLO ({SLOSpec(**a['slo']).describe()}): turns / jobs meeting it",
             f"{f(a['turn'], '{:.1%}')} / {f(a['job'], '{:.1%}')}"),
            ("  attainment ttft / tpot / tool turn / job deadline", kinds),
            ("  goodput: jobs/s / output tok/s", f"{f(a['job_goodput_per_s'], '{:.4f}')} / {f(a['token_goodput_per_s'], '{:.0f}')}")]
