"""The analytical SLO model: its parts on hand-checkable inputs, its direction on the real step cost,
and its agreement with real replays where the answer is not in doubt."""
import json
import math

import numpy as np
import pytest

from scheduling.engine.step_cost import ConstantStepCost, make_step_cost
from scheduling.experiments.replay import ReplayConfig, engine_config, run_replay
from scheduling.slo import SLOSpec
from scheduling.slo.lru import GapTable, che_time, kept_share, queue_points
from scheduling.slo.model import Limits, Workload, max_rate, predict, solve_load
from scheduling.workload.trace_synth import synthetic_jobs
from scheduling.workload.traces import with_poisson_arrivals
from tests.conftest import job
from tests.gpubench.conftest import run_cli


def test_che_time_solves_the_cache_balance_with_contexts_eaten_from_the_tail():
    ctx = np.array([0.0, 1000.0, 1000.0])
    gap = np.array([math.inf, 2.0, 4.0])
    table = GapTable(ctx, gap)
    no_wait = queue_points(0.0)
    # New tokens written at 1000/s eat a freed context of 1000 in 1 s once its tail's time T_C is up.
    # T_C = 1 s: each later context is held whole for 1 s (1000 token-s), then eaten over the next
    # second (500 token-s): 1500 each, a mean of 1000 over the three turns, at 1 turn/s.
    assert table.held(1.0, no_wait, 1000.0) == pytest.approx(1000.0)
    assert che_time(1000.0, 1.0, table, no_wait, 1000.0) == pytest.approx(1.0, rel=1e-6)
    assert che_time(1e9, 1.0, table, no_wait, 1000.0) == math.inf  # everything fits: every context survives
    assert che_time(0.0, 1.0, table, no_wait, 1000.0) == pytest.approx(-1.0)  # no room: eaten at once
    # what a turn finds: all of it before T_C, half of it half a second after, none a second after
    kept = kept_share(np.array([0.0, 1000.0, 1000.0, 1000.0]), np.array([math.inf, 0.5, 1.5, 2.0]), no_wait, 1.0, 1000.0)
    assert kept.tolist() == [[1.0, 1.0, 0.5, 0.0]]
    # queueing spreads the return: eight equally likely waits with the mean asked for
    waits = queue_points(3.0)
    assert len(waits) == 8 and waits.mean() == pytest.approx(3.0) and np.all(np.diff(waits) > 0)


def test_a_light_load_meets_everything_and_keeps_every_context():
    jobs = [job(f"j{i}", [(200, 20, 1.0), (50, 20, 1.0), (50, 20, 0)], arrival=2.0 * i) for i in range(5)]
    lim = Limits(token_budget=8192, max_num_seqs=256, pool_tokens=1_000_000)
    pred = predict(jobs, lim, ConstantStepCost(0.01), SLOSpec())
    assert pred.attainment["turn"] == 1.0 and pred.attainment["job"] == 1.0
    st = solve_load(2.0, Workload.of(jobs), lim, ConstantStepCost(0.01))
    assert st.wait_s == 0.0 and np.all(st.kept == 1.0) and st.step_s == pytest.approx(0.01)
    # a turn's TTFT is the rest of the step running when it arrives (half of one, with equal steps) and
    # its own step; its JCT is its turns' steps plus its tool time
    assert pred.percentiles["ttft_p50_s"] == pytest.approx(0.015, rel=0.02)
    assert pred.percentiles["jct_mean_s"] == pytest.approx(3 * (0.01 + 19 * 0.01) + 2.0, rel=0.1)


def test_a_smaller_pool_evicts_contexts_and_costs_attainment():
    jobs = with_poisson_arrivals(synthetic_jobs(60, 0), 2.0, 0)
    cfg = ReplayConfig(sku="l40s")
    e = engine_config(cfg)
    cost = make_step_cost("predictor", sku="l40s", model="llama-3.1-8b")
    big = predict(jobs, Limits(e.max_num_batched_tokens, e.max_num_seqs, e.num_gpu_blocks * 16), cost, SLOSpec())
    small = predict(jobs, Limits(e.max_num_batched_tokens, e.max_num_seqs, 2000 * 16), cost, SLOSpec())
    assert small.attainment["turn"] < big.attainment["turn"]
    assert min(h for *_, h in small.loads) < 1.0 == max(h for *_, h in big.loads[:1])


@pytest.mark.parametrize("num_gpu_blocks, collapses", [(None, False), (1500, True)])
def test_the_model_agrees_with_a_replay_on_which_side_of_the_cliff_it_is(num_gpu_blocks, collapses):
    """60 agent jobs on an L40S: its own pool holds them, 1,500 blocks do not (evictions, recompute,
    queueing). Replay and model must both put attainment on the same side of 50 %, within 20 pp."""
    jobs = with_poisson_arrivals(synthetic_jobs(60, 0), 2.0, 0)
    cfg = ReplayConfig(sku="l40s", num_gpu_blocks=num_gpu_blocks, record_steps=False)
    e = engine_config(cfg)
    measured = run_replay(jobs, cfg).summary["slo_attainment"]["turn"]
    cost = make_step_cost("predictor", sku="l40s", model="llama-3.1-8b")
    model = predict(jobs, Limits(e.max_num_batched_tokens, e.max_num_seqs, e.num_gpu_blocks * e.block_size), cost,
                    SLOSpec()).attainment["turn"]
    assert (measured < 0.5) == collapses == (model < 0.5)
    assert abs(model - measured) < 0.2


def test_max_rate_is_where_the_target_is_last_met():
    jobs = synthetic_jobs(30, 0)
    cost = ConstantStepCost(0.02)
    lim = Limits(token_budget=2048, max_num_seqs=4, pool_tokens=400_000)  # 0.05 jobs/s meets it, 0.5 does not
    slo = SLOSpec(ttft_s=1.0, tpot_s=0.1, tool_turn_s=None)
    rate, pred = max_rate(lambda jps: with_poisson_arrivals(jobs, jps, 0), lim, cost, slo, target=0.9, lo=0.05, hi=50.0)
    assert rate is not None and 0.05 < rate < 50.0 and pred.attainment["turn"] >= 0.9
    above = predict(with_poisson_arrivals(jobs, rate * 1.5, 0), lim, cost, slo).attainment["turn"]
    assert above < 0.9


def test_slo_predict_cli_and_its_bad_input(tmp_path):
    proc = run_cli("slo", "predict", "--sku", "h200", "--jobs", "20", "--jps", "1", "--slo", "ttft=1", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["attainment"]["turn"] == pytest.approx(1.0) and doc["slo"]["ttft_s"] == 1.0
    # shares of turns: never past 1, where a weighted mean of ones rounds up by an ulp
    assert all(v <= 1.0 for k, v in doc["attainment"].items() if k in ("ttft", "tpot", "tool_turn", "turn", "job"))
    for args, message in ((["--jps", "0"], "--jps (> 0) is required"), (["--max-rate", "--target", "1.5"], "--target must be"),
                          (["--jps", "1", "--slo", "job=-2"], "finite number of seconds"),
                          (["--jps", "1", "--slo", "ttft=1,ttft=2"], "names ttft twice"),
                          (["--max-rate", "--jps", "1"], "--jps goes without --max-rate"),
                          (["--jps", "1", "--target", "0.8"], "--target and --of go with --max-rate"),
                          (["--jps", "1", "--num-gpu-blocks", "10"], "more than the whole GPU pool (160 tokens)")):
        bad = run_cli("slo", "predict", "--jobs", "5", *args, timeout=120)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_slo_predict_max_rate_says_when_the_search_bound_still_holds():
    """20 jobs on an H100 meet the default SLO at any rate the search tries: the answer is a lower
    bound, and the text and JSON say so rather than give the bound as the largest rate."""
    proc = run_cli("slo", "predict", "--sku", "h100-sxm", "--max-rate", "--jobs", "20", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "the search's upper bound: the largest rate is at least that" in proc.stdout
    doc = json.loads(run_cli("slo", "predict", "--sku", "h100-sxm", "--max-rate", "--jobs", "20", "--json",
                             timeout=300).stdout)
    assert doc["at_search_limit"] is True and doc["max_jps"] == 100.0


def test_slo_check_puts_the_model_beside_a_sweeps_replays(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("sweep", "--policies", "fcfs", "--skus", "h200", "--jps", "1", "4", "--jobs", "20", "--out", str(sweep),
                   "--no-progress", "--no-plots", timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "check"
    proc = run_cli("slo", "check", "--sweep", str(sweep), "--out", str(out), "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["cells"] == 2 and doc["out_dir"] == str(out) and len(doc["rows"]) == 2
    for name in ("check.csv", "check.md", "attainment_vs_jps.png", "COMMAND"):
        assert (out / name).is_file(), name
    import pandas as pd

    df = pd.read_csv(out / "check.csv")
    assert list(df["jps"]) == [1.0, 4.0] and df["attainment_error_pp"].abs().max() < 10
    bad = run_cli("slo", "check", "--sweep", str(tmp_path), "--out", str(tmp_path / "x"), timeout=120)
    assert bad.returncode == 2 and "not a sweep directory" in bad.stderr


@pytest.mark.parametrize("check", ["check-default", "check-seed1", "check-seed2"])
def test_committed_slo_checks_regenerate_cell_by_cell(check):
    """Three cells of each committed check (one holding the SLO, one past the cliff, one at its edge)
    come back from the model as committed (the whole check takes ~3 min: CI re-runs a sample)."""
    from pathlib import Path

    import pandas as pd

    from scheduling.experiments.sweep import SweepSpec, cell_jobs
    from scheduling.slo.model import engine_limits_and_cost

    root = Path(__file__).resolve().parents[2] / "results" / "slo" / check
    committed = pd.read_csv(root / "check.csv")
    sweep = (root / "COMMAND").read_text().split("--sweep ")[1].split()[0]
    spec_doc = json.loads((root.parents[2] / sweep / "spec.json").read_text())
    spec = SweepSpec(model=spec_doc["model"], num_jobs=spec_doc["num_jobs"], trace=spec_doc.get("trace"))
    for sku, jps in (("b200", 0.5), ("h100-sxm", 5.0), ("a100-40", 1.0)):
        row = committed[(committed.sku == sku) & (committed.jps == jps)].iloc[0]
        lim, cost = engine_limits_and_cost(sku, spec.model)
        pred = predict(cell_jobs(spec, jps, int(row.seed)), lim, cost, SLOSpec(ttft_s=2.0, tpot_s=0.1, tool_turn_s=None))
        assert pred.attainment["turn"] == pytest.approx(row.attainment_model, rel=1e-5, abs=1e-9), (sku, jps)  # 6 digits in check.csv
        assert pred.percentiles["jct_mean_s"] == pytest.approx(row.jct_mean_s_model, rel=1e-5), (sku, jps)
