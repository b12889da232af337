"""Prefill/decode disaggregation (scheduling.cluster.pd): real engines, a constant step cost, a KV
link slow enough to see (1 GB/s), hand-built turns."""
import pandas as pd
import pytest

from common.errors import ConfigError
from gpubench import skus
from scheduling.cluster.pd import FileLinks, KVLink, PDSettings, kv_link
from scheduling.cluster.routers import make_router
from scheduling.cluster.sim import Cluster
from scheduling.engine import EngineConfig
from scheduling.engine.step_cost import ConstantStepCost
from scheduling.experiments.metrics import frames
from scheduling.experiments.replay import ReplayConfig, run_replay
from scheduling.policies import make_policy
from tests.conftest import job

KV_PER_TOKEN = 1 << 17   # 128 KiB: Llama-3.1-8B in bf16
SLOW = KVLink("network", 1.0, 0.0, "test")  # 1 GB/s: 16 tokens' KV (2 MiB) take 2.1 ms
STEP = 0.01


def run_pd(jobs, *, prefill=1, decode=1, blocks=4000, **settings):
    s = PDSettings(prefill, settings.pop("link", SLOW), **settings)
    cfg = EngineConfig(num_gpu_blocks=blocks, kv_bytes_per_token=KV_PER_TOKEN)
    c = Cluster(jobs, cfg, ConstantStepCost(STEP), [make_policy("fcfs") for _ in range(prefill + decode)],
                make_router("round-robin", decode), pd=s, prefill_router=make_router("round-robin", prefill), num_layers=32)
    res = c.run()
    for e in [*c.engines, *c.prefill_engines]:
        e.pool.check_invariants()
    turns = pd.concat([frames(r)[1] for r in res.replicas]).set_index(["job_id", "turn"]).sort_index()
    moved = {(j, t): (b, sec) for j, t, b, _, sec in res.transfers}
    return res, turns, moved


# one job: a 1600-token prompt (100 blocks), 10 output tokens, a 1 s tool call, then 160 new tokens
ONE = [job("a", [(1600, 10, 1.0), (160, 10, 0)])]


def test_a_pulled_turn_waits_for_its_prefill_its_transfer_and_one_decode_step():
    res, turns, moved = run_pd(ONE)
    # turn 0: prefill step [0, 0.01); the decode instance pulls 1584 tokens (whole blocks under
    # prompt - 1), 207.6 MB at 1 GB/s; then one step computes the last 16 tokens and samples
    nbytes, sec = moved[("a", 0)]
    assert nbytes == 1584 * KV_PER_TOKEN and sec == pytest.approx(nbytes / 1e9)
    assert turns.loc[("a", 0), "ttft_s"] == pytest.approx(STEP + sec + STEP)
    assert turns.loc[("a", 0), "pool_hit_tokens"] == 1584 and turns.loc[("a", 0), "hit_tokens"] == 0
    # turn 1: the decode instance holds turn 0's context: it pulls only the new whole blocks
    assert turns.loc[("a", 1), "hit_tokens"] >= 1600
    assert moved[("a", 1)][0] < 200 * KV_PER_TOKEN
    assert [r[:3] for r in res.prefill_turns] == [("a", 0, 0), ("a", 1, 0)]


def test_layerwise_transfer_hides_behind_the_prefill_and_a_push_moves_the_whole_prompt():
    _, pulled, moved = run_pd(ONE)
    _, layered, moved_l = run_pd(ONE, layerwise=True)
    full = moved[("a", 0)][1]
    # 0.21 s of transfer against 0.01 s of prefill overlap: 0.01 s is hidden
    assert moved_l[("a", 0)][1] == pytest.approx(full - STEP)
    fast = KVLink("nvlink", 450.0, 5e-6, "test")
    _, _, moved_fast = run_pd(ONE, layerwise=True, link=fast)
    # on NVLink the whole transfer fits in the prefill: what is left is the last layer's share
    assert moved_fast[("a", 0)][1] == pytest.approx(5e-6 + (fast.transfer_s(1584 * KV_PER_TOKEN) - 5e-6) / 32)
    _, pushed, moved_p = run_pd(ONE, reserve="after")
    assert moved_p[("a", 1)][0] == (1600 + 10 + 160 - 1) // 16 * 16 * KV_PER_TOKEN  # the whole prompt again
    assert pushed.loc[("a", 0), "ttft_s"] == pytest.approx(pulled.loc[("a", 0), "ttft_s"])


def test_no_prefix_caching_on_the_decode_side_resends_every_turn_whole():
    _, turns, moved = run_pd(ONE, prefix_caching="prefill")
    assert (turns["hit_tokens"] == 0).all()
    assert moved[("a", 1)][0] == (1600 + 10 + 160 - 1) // 16 * 16 * KV_PER_TOKEN


def test_a_turn_below_the_threshold_is_prefilled_where_it_decodes():
    res, turns, moved = run_pd(ONE, threshold_tokens=512)
    assert ("a", 0) in moved and ("a", 1) not in moved  # turn 1 misses ~176 tokens: local
    assert [r[4] for r in res.routed] == [0, -1]
    assert turns.loc[("a", 1), "ttft_s"] == pytest.approx(STEP)


FILES = FileLinks(write=KVLink("file", 1.0, 0.002, "test"), read=KVLink("file", 2.0, 0.001, "test"))


def test_a_file_link_writes_the_whole_block_prompt_and_the_decode_step_reads_it_all():
    """vLLM's ExampleConnector: the prefill instance writes the prompt's whole blocks; the decode
    instance, missing some of them, reads the whole file inside the step that admits the turn."""
    res, turns, moved = run_pd(ONE, link=FILES.read, files=FILES)
    write0, read0 = FILES.write.transfer_s(1584 * KV_PER_TOKEN), FILES.read.transfer_s(1584 * KV_PER_TOKEN)
    assert moved[("a", 0)] == (1584 * KV_PER_TOKEN, pytest.approx(read0))  # the log's read row (bytes read)
    assert turns.loc[("a", 0), "ttft_s"] == pytest.approx(STEP + write0 + STEP + read0)
    # turn 1 (1770 tokens): the decode instance holds 1600 of them, still misses whole blocks, and
    # reads the whole 1760-token file again; the prefill instance wrote it
    assert moved[("a", 1)][0] == 1760 * KV_PER_TOKEN
    transfers = [t for t in res.transfers if t[:2] == ("a", 1)]
    assert [t[2] for t in transfers] == [0, 1760 * KV_PER_TOKEN]
    assert transfers[0][4] == pytest.approx(FILES.write.transfer_s(1760 * KV_PER_TOKEN))


def test_a_file_link_skips_a_write_of_whole_blocks_already_written_and_a_read_the_cache_covers():
    # turn 1 (1590 + 2 + 3 = 1595 tokens) has turn 0's whole blocks (1584): the connector finds the
    # file and writes nothing; the decode instance caches those blocks and reads nothing
    two = [job("a", [(1590, 2, 0.5), (3, 4, 0)])]
    res, turns, moved = run_pd(two, link=FILES.read, files=FILES)
    assert [t[:3] for t in res.transfers] == [("a", 0, 0), ("a", 0, 1584 * KV_PER_TOKEN)]
    assert turns.loc[("a", 1), "ttft_s"] == pytest.approx(STEP + STEP)


def test_a_file_link_needs_the_measured_rates_and_nothing_else(tmp_path):
    rate = tmp_path / "kv_file_rate.json"
    rate.write_text('{"write": {"gbs": 0.8, "latency_s": 0.004}, "read": {"gbs": 1.6, "latency_s": 0.002}}')
    cfg = ReplayConfig(prefill_replicas=1, kv_link="file", kv_file_rate=str(rate), sku="cpu", model="smollm2-135m")
    assert FileLinks.load(cfg.kv_file_rate).write.transfer_s(8e8) == pytest.approx(1.004)
    for fields, words in (({}, "needs the host's measured rates"), ({"kv_file_rate": str(rate), "kv_link_gbs": 1.0},
                                                                     "priced from --kv-file-rate alone")):
        with pytest.raises(ConfigError, match=words):
            ReplayConfig(prefill_replicas=1, kv_link="file", **fields)
    with pytest.raises(ConfigError, match="add --kv-link file"):
        ReplayConfig(prefill_replicas=1, kv_file_rate=str(rate))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="no write and read rates"):
        ReplayConfig(prefill_replicas=1, kv_link="file", kv_file_rate=str(tmp_path / "bad.json"))


def test_two_prefill_instances_feed_one_decode_instance_and_every_job_finishes():
    jobs = [job(f"j{i}", [(800, 20, 0.3), (200, 20, 0)], arrival=0.002 * i) for i in range(8)]
    res, turns, moved = run_pd(jobs, prefill=2, decode=1)
    assert len(turns) == 16 and len(moved) == 16
    assert {r[2] for r in res.prefill_turns} == {0, 1}
    assert sum(len(r.jobs) for r in res.replicas) == 8


def test_the_link_comes_from_the_sku_table():
    assert kv_link(skus.get("h100-sxm")).kind == "nvlink" and kv_link(skus.get("h100-sxm")).gbs == 450
    assert kv_link(skus.get("h100-sxm"), "network").gbs == 50
    assert kv_link(skus.get("l40s")).kind == "pcie" and kv_link(skus.get("l40s")).gbs == 32
    with pytest.raises(ConfigError, match="l40s has no network bandwidth"):
        kv_link(skus.get("l40s"), "network")
    assert kv_link(skus.get("l40s"), "network", 25.0).gbs == 25.0


@pytest.mark.parametrize("fields, words", [
    ({"prefill_replicas": 1, "policy": "cpu-offload"}, "loads KV from its own pool"),
    ({"prefill_replicas": -1}, "prefill_replicas must be an integer >= 0"),
    ({"prefill_replicas": 1, "kv_reserve": "later"}, "kv_reserve must be one of before, after"),
    ({"prefill_replicas": 1, "kv_link": "wifi"}, "kv_link must be one of"),
    ({"prefill_replicas": 1, "pd_prefix_caching": "some"}, "pd_prefix_caching must be one of"),
    ({"prefill_replicas": 1, "kv_link_gbs": 0}, "kv_link_gbs must be a finite number > 0"),
])
def test_bad_disaggregation_settings_are_one_clear_error(fields, words):
    with pytest.raises(ConfigError, match=words):
        ReplayConfig(**fields)


def test_replay_summarises_disaggregation(tmp_path):
    from scheduling.experiments.replay import write_outputs

    jobs = [job(f"j{i}", [(3000, 50, 0.5), (300, 50, 0)], arrival=0.05 * i) for i in range(6)]
    res = run_replay(jobs, ReplayConfig(sku="h100-sxm", replicas=2, prefill_replicas=1, router="session",
                                        step_cost="constant:0.01"))
    p = res.summary["cluster"]["pd"]
    assert p["link"] == "nvlink" and p["link_gbs"] == 450 and p["turns_prefilled_remotely"] == 12
    assert p["kv_bytes_total"] == int(res.turns["kv_bytes"].sum()) > 0
    assert set(res.turns["prefill_replica"]) == {0} and set(res.steps["role"]) == {"prefill", "decode"}
    out = write_outputs(res, tmp_path / "pd")
    assert {"prefill_replica", "kv_bytes", "kv_transfer_s"} <= set(pd.read_csv(out / "turns.csv").columns)


def test_replay_cli_disaggregates_and_refuses_pd_options_without_prefill_replicas(tmp_path):
    import json

    from tests.gpubench.conftest import run_cli

    out = tmp_path / "pd"
    proc = run_cli("replay", "--jobs", "4", "--preset", "scaled-cpu", "--jps", "2", "--replicas", "2", "--prefill-replicas", "1",
                   "--router", "session", "--kv-link", "network", "--kv-layerwise", "--no-progress", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)["metrics"]["cluster"]["pd"]
    assert (p["link"], p["link_gbs"], p["layerwise"]) == ("network", 50, True)
    for args, words in ((["--kv-layerwise"], "add --prefill-replicas P"),
                        (["--prefill-replicas", "1", "--sku", "l40s", "--kv-link", "network"], "--kv-link-gbs"),
                        (["--prefill-replicas", "1", "--policy", "lmcache"], "loads KV from its own pool")):
        bad = run_cli("replay", "--jobs", "2", "--jps", "1", "--out", str(tmp_path / "bad"), *args)
        assert bad.returncode == 2 and words in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert not (tmp_path / "bad").exists()


def test_a_live_steps_kv_time_is_shared_by_tokens_among_the_requests_it_moved():
    from scheduling.experiments.live_cluster import _kv_shares

    ev = {"requests": [{"id": "a", "op": "save", "tokens": 300}, {"id": "b", "op": "save", "tokens": 100},
                       {"id": "c", "op": "load", "tokens": 512}], "save_s": 0.04, "load_s": 0.02}
    shares = {(r, op): (s, t) for r, op, s, t in _kv_shares(ev)}
    assert shares[("a", "save")] == (pytest.approx(0.03), 300) and shares[("b", "save")] == (pytest.approx(0.01), 100)
    assert shares[("c", "load")] == (pytest.approx(0.02), 512)


def test_a_file_rate_fit_recovers_each_halfs_latency_and_bandwidth_and_refuses_one_size():
    from vllmref.kv_file_rate import fit

    rows = [{"tokens": t, "bytes": t * 1000, "write_s": 0.002 + t * 1000 / 1e9, "read_s": 0.001 + t * 1000 / 2e9}
            for t in (256, 1024, 4096)]
    rate = fit(rows)
    assert (rate.write.gbs, rate.write.latency_s) == (pytest.approx(1.0), pytest.approx(0.002))
    assert (rate.read.gbs, rate.read.latency_s) == (pytest.approx(2.0), pytest.approx(0.001))
    with pytest.raises(ConfigError, match="two sizes"):
        fit(rows[:1])


def test_a_given_link_latency_prices_every_hand_off():
    link = kv_link(skus.get("cpu"), "auto", 0.5, 0.012)
    assert link.transfer_s(1e9) == pytest.approx(2.012)
    with pytest.raises(ConfigError, match="kv_link_latency_s"):
        ReplayConfig(prefill_replicas=1, kv_link_gbs=1.0, kv_link_latency_s=-1.0)


@pytest.mark.parametrize("check", [("pd-live", "sim-seed3/jps-1", "check-seed3/jps-1"),
                                   ("pd-live-ram", "sim/jps-1", "check/jps-1")], ids=["disk", "ram"])
def test_the_committed_live_pair_check_regenerates(tmp_path, check):
    """results/cluster/pd-live (files on disk, seed 3) and pd-live-ram (files in RAM, seed 4): the
    simulator's replay of the confirmation jobs at 1 job/s priced with the committed file rates, and its
    comparison with the committed live takes, re-run from their COMMAND lines: the same turns and the
    same table (both are deterministic given the takes)."""
    import json
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    name, sim, chk = check
    d = root / "results" / "cluster" / name
    for sub in (sim, chk):
        argv = shlex.split((d / sub / "COMMAND").read_text().splitlines()[0])
        argv[argv.index("--out") + 1] = str(tmp_path / sub)
        if sub == chk:  # score the fresh simulator replay, not the committed one
            argv[argv.index("compare-replay") + 1] = str(tmp_path / sim)
        done = subprocess.run([sys.executable, "-m", "gpubench", *argv[1:]], cwd=root, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    fresh = pd.read_csv(tmp_path / sim / "turns.csv")
    committed = pd.read_csv(d / sim / "turns.csv")
    for col in ("ttft_s", "finish_s", "hit_tokens", "kv_bytes", "kv_transfer_s", "prefill_replica"):
        assert fresh[col].tolist() == pytest.approx(committed[col].tolist(), rel=1e-9), col
    rows = {r["metric"]: r for r in json.loads((tmp_path / chk / "comparison.json").read_text())["metrics"]}
    want = {r["metric"]: r for r in json.loads((d / chk / "comparison.json").read_text())["metrics"]}
    for name in ("TTFT p50 (s)", "TPOT p50 (s)", "KV transfer p50 (s)", "KV moved per remote turn, mean (MB)"):
        assert rows[name]["a"] == pytest.approx(want[name]["a"]) and rows[name]["takes_mean"] == pytest.approx(
            want[name]["takes_mean"]), name
