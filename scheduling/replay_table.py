"""The table ``gpubench replay`` prints of one replay's summary (the simulator's or live vLLM's)."""
from __future__ import annotations


def print_summary(m: dict, config, out, trace_path=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from scheduling.slo.attainment import summary_rows

    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    where = getattr(config, "sku", None) or f"vLLM {m.get('engine', {}).get('vllm_version', '')} (live)"
    t = Table(title=f"replay: {config.policy} · {where} · {config.model}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("jobs / turns", f"{m['num_jobs']} / {m['num_turns']}"),
        ("JCT mean / p50 / p90 / p99 (s)",
         " / ".join(f(m[k], "{:.1f}") for k in ("jct_mean_s", "jct_p50_s", "jct_p90_s", "jct_p99_s"))),
        ("TTFT mean / p50 / p90 / p99 (s)",
         " / ".join(f(m[k]) for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s"))),
        ("TPOT mean / p50 / p90 / p99 (s)",
         " / ".join(f(m.get(k)) for k in ("tpot_mean_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s"))),
        (f"goodput: turns within TTFT <= {f(m['slo']['ttft_s'], '{:g}')} s and TPOT <= {f(m['slo']['tpot_s'], '{:g}')} s",
         f"{f(m['slo_turn_share'], '{:.1%}')} ({f(m['goodput_tok_per_s'], '{:.0f}')} tok/s)"),
        *summary_rows(m.get("slo_attainment"), f),
        ("queueing delay mean / p90 (s)", " / ".join(f(m[k]) for k in ("queue_mean_s", "queue_p90_s"))),
        ("throughput (output tok/s)", f(m["output_tok_per_s"], "{:.0f}")),
        ("jobs/s", f(m["jobs_per_s"], "{:.4f}")),
        ("GPU prefix-hit rate", f(m["gpu_prefix_hit_rate"])),
        ("pool hit rate", f(m["pool_hit_rate"])),
        ("preemptions / recomputed tokens", f"{m['preemptions']} / {m['recomputed_tokens']}"),
        ("KV blocks on GPU", str(m["num_gpu_blocks"])),
        ("steps / sim wall (s)", f"{m['steps']} / {m['sim_wall_s']:.1f}"),
        *cluster_rows(m.get("cluster"), f),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console = Console()
    console.print(t)
    console.print(f"wrote {out}/summary.json, steps.csv, turns.csv, jobs.csv" + (", rejected.csv" if m.get("cluster") else ""))
    if trace_path is not None:
        console.print(f"wrote {trace_path} (Chrome trace: open it in ui.perfetto.dev)")


def cluster_rows(c: dict | None, f) -> list[tuple[str, str]]:
    """A cluster replay's rows: turns, prefix hits and TTFT per replica, and what the router refused."""
    if not c:
        return []
    per = c["per_replica"]
    return [(f"{c['replicas']} replicas behind {c['router']}: turns per replica", " / ".join(str(p["turns"]) for p in per)),
            ("  prefix-hit rate per replica", " / ".join(f(p["prefix_hit_rate"], "{:.2f}") for p in per)),
            ("  TTFT p50 per replica (s)", " / ".join(f(p["ttft_p50_s"]) for p in per)),
            ("  turns refused (jobs abandoned)", f"{c['rejected_turns']} ({c['rejected_jobs']})"),
            *_pd_rows(c.get("pd"), f)]


def _pd_rows(p: dict | None, f) -> list[tuple[str, str]]:
    if not p:
        return []
    mb = p["kv_bytes_per_remote_turn"]
    rate = f"{p['link_gbs']:g} GB/s, " if p.get("link_gbs") is not None else ""  # a live pair: measured per turn
    return [(f"disaggregated: {p['prefill_replicas']} prefill, {p['decode_replicas']} decode over {p['link']} "
             f"({rate}{'layer-wise, ' if p.get('layerwise') else ''}reserve {p['reserve']})",
             f"{p['turns_prefilled_remotely']} turns remote / {p['turns_prefilled_locally']} local"),
            ("  KV moved per remote turn (MB) / transfer p50 / p90 (ms)",
             f"{f(mb / 1e6 if mb is not None else None, '{:.1f}')} / "
             f"{f(p['kv_transfer_p50_s'] and p['kv_transfer_p50_s'] * 1e3, '{:.2f}')} / "
             f"{f(p['kv_transfer_p90_s'] and p['kv_transfer_p90_s'] * 1e3, '{:.2f}')}")]
