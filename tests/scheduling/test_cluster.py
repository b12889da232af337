"""Replicas behind a router (scheduling.cluster): real engines on one clock, hand-built traces."""
import json

import pandas as pd
import pytest

from scheduling.cluster.routers import make_router
from scheduling.cluster.sim import Cluster
from scheduling.engine import Engine, EngineConfig
from scheduling.engine.step_cost import ConstantStepCost
from scheduling.experiments.metrics import frames
from scheduling.experiments.replay import ReplayConfig, run_replay
from scheduling.policies import make_policy
from tests.conftest import job


def cluster(jobs, replicas, router, *, blocks=2000, cost=0.01, router_params=None, policy="fcfs", **kw):
    cfg = EngineConfig(num_gpu_blocks=blocks)
    c = Cluster(jobs, cfg, ConstantStepCost(cost), [make_policy(policy) for _ in range(replicas)],
                make_router(router, replicas, router_params), **kw)
    res = c.run()
    for e in c.engines:
        e.pool.check_invariants()
    return c, res


@pytest.mark.parametrize("policy", ["fcfs", "jitserve", "continuum", "cpu-offload"])
@pytest.mark.parametrize("blocks, record_steps", [(1500, True), (1500, False), (100000, False)])
def test_one_replica_replays_exactly_as_the_engine(policy, blocks, record_steps):
    """The cluster's loop, horizon and routing leave a lone engine's replay unchanged, step for step
    (the pure-decode inline runs included: their counts match)."""
    from scheduling.engine.step_cost import make_step_cost
    from scheduling.experiments.replay import engine_config
    from scheduling.workload.trace_synth import synthetic_jobs
    from scheduling.workload.traces import with_poisson_arrivals

    jobs = with_poisson_arrivals(synthetic_jobs(16, seed=3), 2.0, seed=3)
    ecfg = engine_config(ReplayConfig(sku="l40s", num_gpu_blocks=blocks, record_steps=record_steps))
    cost = make_step_cost("predictor", sku="l40s", model="llama-3.1-8b")
    alone = Engine(jobs, ecfg, make_policy(policy), cost).run()
    res = Cluster(jobs, ecfg, cost, [make_policy(policy)], make_router("round-robin", 1)).run()
    for a, b in zip(frames(alone), frames(res.replicas[0])):
        pd.testing.assert_frame_equal(a, b)
    assert (alone.num_steps, alone.num_inline_decode_steps) == (res.replicas[0].num_steps,
                                                                res.replicas[0].num_inline_decode_steps)
    assert record_steps or blocks < 100000 or alone.num_inline_decode_steps > 0  # the inline path ran


# Two jobs of three turns, contexts of hundreds of blocks, one second of tool call between turns.
WARM = [job("a", [(4000, 20, 1.0), (200, 20, 1.0), (200, 20, 0)], arrival=0.0),
        job("b", [(4000, 20, 1.0), (200, 20, 1.0), (200, 20, 0)], arrival=0.1)]


def hits_by_turn(res):
    turns = pd.concat([frames(r)[1].assign(replica=k) for k, r in enumerate(res.replicas)])
    return turns.set_index(["job_id", "turn"]).sort_index()


def test_session_affinity_keeps_a_job_warm_where_round_robin_sends_it_to_a_cold_replica():
    _, rr = cluster(WARM, 3, "round-robin")
    _, sess = cluster(WARM, 3, "session")
    rr_t, sess_t = hits_by_turn(rr), hits_by_turn(sess)
    later = [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    # round robin over 3, in routing order a0 b0 a1 b1 a2 b2 -> 0 1 2 0 1 2: no later turn finds its context
    assert [rr_t.loc[k, "replica"] for k in [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]] == [0, 1, 2, 0, 1, 2]
    assert all(rr_t.loc[k, "hit_tokens"] == 0 for k in later)
    assert (sess_t.groupby("job_id")["replica"].nunique() == 1).all()
    assert all(sess_t.loc[k, "hit_tokens"] >= 4000 for k in later)  # the whole earlier context


def test_prefix_routing_follows_the_context_it_sent():
    c, res = cluster(WARM, 3, "prefix")
    t = hits_by_turn(res)
    assert (t.groupby("job_id")["replica"].nunique() == 1).all()
    assert t.loc[("a", 0), "replica"] != t.loc[("b", 0), "replica"]  # no match yet: the idle replica
    assert len(c.result.routed) == 6 and not c.result.rejected


def burst(n=8, system=1200):
    """``n`` one-turn jobs of one prefix group arriving 10 ms apart (a shared system prompt of
    ``system`` tokens: 30 % of each prompt)."""
    return [job(f"j{i}", [(2800, 200, 0)], system=system, group="g", arrival=0.01 * i) for i in range(n)]


def test_stale_load_turns_prefix_affinity_into_a_hot_spot():
    """llm-d's scorers on a burst: with the load fresh, queue and KV scores spread the jobs; on a load
    scraped once (10 s interval), the shared prefix is all that differs, and every job goes where the
    first one went (the hot spot users of cache-aware routing report)."""
    _, fresh = cluster(burst(), 4, "scorers", stats_interval_s=0.0, cost=0.05)
    _, stale = cluster(burst(), 4, "scorers", stats_interval_s=10.0, cost=0.05)
    per = [len(r.turns) for r in fresh.replicas]
    assert max(per) <= 3 and sum(per) == 8
    assert sorted(len(r.turns) for r in stale.replicas) == [0, 0, 0, 8]


def test_a_refused_turn_abandons_its_job_and_counts_against_goodput(tmp_path):
    from scheduling.experiments.replay import write_outputs

    jobs = [job(f"j{i}", [(100, 300, 0.5), (100, 5, 0)], arrival=0.001 * i) for i in range(4)]
    cfg = ReplayConfig(sku="l40s", replicas=2, router="round-robin", max_outstanding=1, step_cost="constant:0.01")
    res = run_replay(jobs, cfg)
    # j0 -> 0, j1 -> 1, j2 -> 0 (busy: refused), j3 -> 1 (refused)
    assert list(res.rejected["job_id"]) == ["j2", "j3"] and list(res.rejected["replica"]) == [0, 1]
    c = res.summary["cluster"]
    assert c["rejected_turns"] == 2 and c["rejected_jobs"] == 2
    att = res.summary["slo_attainment"]
    assert att["rejected_turns"] == 2 and att["turn"] == pytest.approx(4 / 6) and att["job"] == pytest.approx(2 / 4)
    assert set(res.jobs["job_id"]) == {"j0", "j1"} and len(res.turns) == 4
    out = write_outputs(res, tmp_path / "run")
    assert list(pd.read_csv(out / "rejected.csv").columns) == ["job_id", "turn", "time_s", "replica"]


def test_a_cluster_replay_is_deterministic_and_routes_every_turn_once():
    from scheduling.workload.trace_synth import synthetic_jobs
    from scheduling.workload.traces import with_poisson_arrivals

    jobs = with_poisson_arrivals(synthetic_jobs(24, seed=1), 4.0, seed=1)
    cfg = ReplayConfig(sku="l40s", replicas=4, router="kv-cost", router_params={"temperature": 0.5},
                       stats_interval_s=0.5, num_gpu_blocks=3000, record_steps=False)
    a, b = run_replay(jobs, cfg), run_replay(jobs, cfg)
    pd.testing.assert_frame_equal(a.turns, b.turns)
    assert not a.turns.duplicated(["job_id", "turn"]).any()
    assert len(a.turns) == sum(j.num_turns for j in jobs) and len(a.jobs) == len(jobs)
    per = a.summary["cluster"]["per_replica"]
    assert sum(p["turns"] for p in per) == len(a.turns) and all(p["turns"] > 0 for p in per)
    assert a.summary["steps"] == sum(p["steps"] for p in per)


def test_replay_cli_runs_replicas_and_refuses_router_options_without_them(tmp_path):
    from tests.gpubench.conftest import run_cli

    out = tmp_path / "c"
    proc = run_cli("replay", "--jobs", "6", "--preset", "scaled-cpu", "--jps", "2", "--sku", "l40s", "--replicas", "2",
                   "--router", "cache-aware", "--router-param", "cache_threshold=0.3", "--no-progress", "--json",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["config"]["replicas"] == 2 and doc["metrics"]["cluster"]["router_params"]["cache_threshold"] == 0.3
    turns = pd.read_csv(out / "turns.csv")
    assert set(turns["replica"]) <= {0, 1} and len(turns) == doc["metrics"]["num_turns"]
    for args, words in ((["--router", "session"], "add --replicas N"),
                        (["--replicas", "2", "--router-param", "beta"], "expected KEY=VALUE"),
                        (["--replicas", "2", "--router", "load-aware", "--router-param", "beta=-1"], "beta must be"),
                        (["--prefill-replicas", "1", "--engine", "vllm", "--kv-link-gbs", "5"], "ExampleConnector"),
                        (["--replicas", "2", "--engine", "vllm", "--max-outstanding", "3"], "the simulator's"),
                        (["--replicas", "2", "--engine", "vllm", "--router", "nope"], "invalid choice")):
        bad = run_cli("replay", "--jobs", "2", "--jps", "1", "--out", str(tmp_path / "bad"), *args)
        assert bad.returncode == 2 and words in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert not (tmp_path / "bad").exists()


def test_a_sweep_compares_routers_through_policy_labels(tmp_path):
    from common.errors import ConfigError
    from scheduling.experiments.sweep import SweepSpec, run_sweep

    labels = ("fcfs@replicas=3+router=round-robin", "fcfs@replicas=3+router=load-aware+router.beta=2")
    spec = SweepSpec(policies=labels, skus=("l40s",), jps=(3.0,), seeds=(0,), num_jobs=12)
    rows = run_sweep(spec, tmp_path / "sw", workers=1)
    assert set(rows["policy"]) == set(labels) and (rows["error"].fillna("") == "").all()
    assert (rows["cluster_replicas"] == 3).all() and (rows["cluster_rejected_turns"] == 0).all()
    assert not any(c.startswith("cluster_router_params") for c in rows.columns)  # settings, not outcomes
    for bad, words in (("fcfs@replicas=3+router=nope", "unknown router 'nope'"),
                       ("fcfs@replicas=3+router.beta=2", "router 'round-robin' takes no parameters"),
                       ("fcfs@replica=3", "fcfs has no parameter(s) replica")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            SweepSpec(policies=(bad,), skus=("l40s",), jps=(3.0,), seeds=(0,), num_jobs=2).validate()


@pytest.mark.parametrize("table, label, jps, sku, seed, num_jobs", [
    ("routers", "fcfs@replicas=4+router=prefix", 8.0, None, 0, 400),
    ("pd", "fcfs@replicas=2+prefill_replicas=2+router=load-aware+kv_link=network+kv_reserve=after", 2.0, None, 0, 400),
    ("ray-grid/on-ray", "fcfs@replicas=2+prefill_replicas=2+router=cache-aware", 16.0, "l40s", 3, 24),
    ("ray-grid/local", "fcfs@replicas=4+router=scorers", 4.0, "b200", 4, 24),
])
def test_committed_cluster_cells_regenerate(table, label, jps, sku, seed, num_jobs):
    """One cell of each committed cluster table (the 1,000-cell grid run on Ray and on the local pool
    among them), re-run: the same row (the simulator and the routers are deterministic; only the wall
    and CPU seconds differ)."""
    from pathlib import Path

    from scheduling.experiments.sweep import SweepCell, SweepSpec, run_cell

    root = Path(__file__).resolve().parents[2] / "results" / "cluster" / table
    committed = pd.read_csv(root / "sweep.csv")
    pick = (committed["policy"] == label) & (committed["jps"] == jps) & (committed["seed"] == seed)
    row = committed[pick & (committed["sku"] == sku if sku else pick)].iloc[0]
    spec = SweepSpec(policies=(label,), skus=(row["sku"],), jps=(jps,), seeds=(seed,), num_jobs=num_jobs)
    fresh = run_cell(spec, SweepCell(label, row["sku"], jps, seed))
    for col in ("jct_mean_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "gpu_prefix_hit_rate", "steps",
                "cluster_turn_imbalance", "slo_attainment_turn", "cluster_pd_kv_bytes_total"):
        if col in committed.columns and row[col] == row[col]:
            assert fresh[col] == pytest.approx(row[col], rel=1e-6), col
