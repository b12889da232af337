"""A cluster replay's tables and summary: the replicas' records side by side, a ``replica`` column
added (steps.csv, turns.csv), jobs where their last turn finished, and a ``cluster`` block (per
replica: turns, prefix hits, steps, KV peak; the router's rejects).

Disaggregated (scheduling.cluster.pd), the turns are the decode instances' (the turn as its user
sees it, from its arrival at the router), with ``prefill_replica`` (-1: prefilled where it decoded),
``kv_bytes`` and ``kv_transfer_s`` (the KV moved and how long the move took from the decode
instance's admission, or from the prefill's end when pushed); steps.csv has a ``role`` column.

A turn the router refused never ran: it counts against every attainment share and goodput (the
turn and its job missed the SLO), so a router cannot look good by refusing work.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from scheduling.cluster.sim import ClusterResult
from scheduling.engine.outputs import EngineResult

REJECT_COLUMNS = ("job_id", "turn", "time_s", "replica")


def merged(result: ClusterResult) -> EngineResult:
    """The replicas' counters as one engine's: sums, the cluster's clock and wall time (the KV peak
    is the sum of the replicas' peaks, each at its own moment)."""
    reps = [*result.replicas, *result.prefill]
    stats: dict = {}
    for r in reps:
        for k, v in (r.policy_stats or {}).items():
            stats[k] = stats.get(k, 0) + v if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return replace(EngineResult(), num_steps=sum(r.num_steps for r in reps),
                   num_preemptions=sum(r.num_preemptions for r in reps),
                   num_inline_decode_steps=sum(r.num_inline_decode_steps for r in reps),
                   sim_time_s=result.sim_time_s, wall_s=result.wall_s,
                   num_gpu_blocks=sum(r.num_gpu_blocks for r in reps), peak_kv_blocks=sum(r.peak_kv_blocks for r in reps),
                   num_evicted_blocks=sum(r.num_evicted_blocks for r in reps),
                   num_block_shortages=sum(r.num_block_shortages for r in reps), policy_stats=stats)


def cluster_frames(result: ClusterResult) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(steps, turns, jobs, rejected)``: steps and turns in time order with their replica."""
    from scheduling.experiments.metrics import frames

    parts = [frames(r) for r in result.replicas]
    steps = pd.concat([s.assign(replica=k) for k, (s, _, _) in enumerate(parts)], ignore_index=True)
    turns = pd.concat([t.assign(replica=k) for k, (_, t, _) in enumerate(parts)], ignore_index=True)
    if result.prefill:
        steps = steps.assign(role="decode")
        prefill = [frames(r)[0].assign(replica=k, role="prefill") for k, r in enumerate(result.prefill)]
        steps = pd.concat([steps, *prefill], ignore_index=True)
        turns = _with_transfers(turns, result)
    jobs = pd.concat([j for _, _, j in parts], ignore_index=True)
    steps = steps.sort_values(["t_s", "replica"], kind="stable").reset_index(drop=True)
    turns = turns.sort_values(["finish_s", "replica"], kind="stable").reset_index(drop=True)
    jobs = jobs.sort_values(["finish_s"], kind="stable").reset_index(drop=True)
    rejected = pd.DataFrame.from_records(result.rejected, columns=list(REJECT_COLUMNS))
    return steps, turns, jobs, rejected


def _with_transfers(turns: pd.DataFrame, result: ClusterResult) -> pd.DataFrame:
    routed = pd.DataFrame.from_records(result.routed, columns=["job_id", "turn", "time_s", "replica", "prefill_replica"])
    moved = pd.DataFrame.from_records(result.transfers, columns=["job_id", "turn", "kv_bytes", "start_s", "kv_transfer_s"])
    # a file link logs a turn's write and its read apart: one row per turn, bytes read, both times
    moved = moved.groupby(["job_id", "turn"], as_index=False)[["kv_bytes", "kv_transfer_s"]].sum()
    out = turns.merge(routed[["job_id", "turn", "prefill_replica"]], on=["job_id", "turn"], how="left")
    out = out.merge(moved[["job_id", "turn", "kv_bytes", "kv_transfer_s"]], on=["job_id", "turn"], how="left")
    return out.fillna({"kv_bytes": 0, "kv_transfer_s": 0.0}).astype({"kv_bytes": "int64", "prefill_replica": "int64"})


def count_rejects(att: dict, num_rejected_turns: int, num_rejected_jobs: int) -> dict:
    """An ``slo_attainment`` block with refused turns (and their jobs) counted as misses."""
    if not num_rejected_turns:
        return {**att, "rejected_turns": 0, "rejected_jobs": 0}
    turns, jobs = att.get("turns", 0), att.get("jobs", 0)
    out = dict(att)
    for k in ("ttft", "tpot", "turn"):
        if att.get(k) is not None:
            out[k] = att[k] * turns / (turns + num_rejected_turns)
    for k in ("job", "job_deadline"):
        if att.get(k) is not None:
            out[k] = att[k] * jobs / (jobs + num_rejected_jobs)
    out.update(rejected_turns=num_rejected_turns, rejected_jobs=num_rejected_jobs)
    return out


def cluster_block(result: ClusterResult, turns: pd.DataFrame, router_name: str, router_params: dict,
                  pd_settings=None) -> dict:
    """The summary's ``cluster`` block (``pd_settings``: scheduling.cluster.pd.PDSettings, disaggregated)."""
    extra = [{"steps": int(r.num_steps), "kv_peak_blocks": int(r.peak_kv_blocks), "preemptions": int(r.num_preemptions)}
             for r in result.replicas]
    block = cluster_summary(turns, extra, router_name, router_params, rejected_turns=len(result.rejected),
                            rejected_jobs=len({j for j, *_ in result.rejected}))
    if pd_settings is not None:
        block["pd"] = _pd_block(result, turns, pd_settings)
    return block


def cluster_summary(turns: pd.DataFrame, extra: list[dict], router_name: str, router_params: dict, *,
                    rejected_turns: int = 0, rejected_jobs: int = 0) -> dict:
    """Replicas, router, refusals, turn imbalance and per replica (one ``extra`` dict each: what the
    engine counted) its turns, prompt and hit tokens, prefix-hit rate and TTFT p50: the simulator's and
    the live cluster's alike."""
    per = []
    for k, more in enumerate(extra):
        mine = turns[turns["replica"] == k]
        prompt = int(mine["prompt_tokens"].sum())
        hit = int(mine["hit_tokens"].sum())
        per.append({"replica": k, "turns": int(len(mine)), "prompt_tokens": prompt, "hit_tokens": hit,
                    "prefix_hit_rate": hit / prompt if prompt else None,
                    "ttft_p50_s": float(mine["ttft_s"].median()) if len(mine) else None, **more})
    counts = [int(len(turns[turns["replica"] == k])) for k in range(len(extra))]
    mean = sum(counts) / len(counts)
    return {"replicas": len(per), "router": router_name, "router_params": router_params,
            "rejected_turns": rejected_turns, "rejected_jobs": rejected_jobs,
            "turn_imbalance": max(counts) / mean if mean else None, "per_replica": per}


def _pd_block(result: ClusterResult, turns: pd.DataFrame, s) -> dict:
    """What disaggregation did: the link, the turns prefilled remotely, the KV moved and its time."""
    remote = turns[turns["prefill_replica"] >= 0]
    moved = remote["kv_bytes"]
    secs = remote["kv_transfer_s"]
    return {"prefill_replicas": s.prefill_replicas, "decode_replicas": len(result.replicas),
            "link": s.link.kind, "link_gbs": s.link.gbs, "link_latency_s": s.link.latency_s, "link_source": s.link.source,
            "layerwise": s.layerwise, "reserve": s.reserve, "threshold_tokens": s.threshold_tokens, "prefix_caching": s.prefix_caching,
            "turns_prefilled_remotely": int(len(remote)), "turns_prefilled_locally": int(len(turns) - len(remote)),
            "kv_bytes_total": int(moved.sum()), "kv_bytes_per_remote_turn": float(moved.mean()) if len(remote) else None,
            "kv_transfer_p50_s": float(secs.median()) if len(remote) else None,
            "kv_transfer_p90_s": float(secs.quantile(0.9)) if len(remote) else None,
            "prefill_steps": int(sum(r.num_steps for r in result.prefill)),
            "prefill_hit_tokens": int(sum(h for *_, h in result.prefill_turns))}
