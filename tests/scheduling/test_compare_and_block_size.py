"""Block size as an engine parameter, and `compare-replay` on two real simulator replays."""
import json
import subprocess
import sys

import pytest

from gpubench.errors import ConfigError, ResultsFormatError
from scheduling import compare
from scheduling.engine import EngineConfig
from scheduling.replay import ReplayConfig, run_replay, write_outputs
from scheduling.step_cost import ConstantStepCost
from scheduling.trace_synth import scaled_cpu_params, synthetic_jobs
from scheduling.traces import Job, Turn, with_poisson_arrivals


def two_turn_job() -> Job:
    return Job("j", "g", 300, (Turn(100, 10, "bash", 0.5), Turn(50, 5)), arrival_s=0.0)


@pytest.mark.parametrize("block_size, expect_hit", [(16, 400), (32, 384), (128, 384), (64, 384), (96, 384)])
def test_second_turn_hits_whole_blocks_of_the_engines_size(block_size, expect_hit):
    # Turn 0 computes 300 + 100 + 9 = 409 tokens (the last sampled token gets no KV); turn 1's
    # prompt is 460 tokens: the hit is the whole blocks of those 409 computed tokens.
    cfg = ReplayConfig(num_gpu_blocks=200, block_size=block_size, step_cost="constant:0.01")
    res = run_replay([two_turn_job()], cfg)
    hits = res.turns.sort_values("turn")["hit_tokens"].tolist()
    assert hits == [0, expect_hit]
    assert res.summary["num_gpu_blocks"] == 200


def test_block_size_must_be_positive():
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(num_gpu_blocks=10, block_size=0)


def test_scaled_cpu_preset_is_small():
    jobs = synthetic_jobs(40, seed=3, params=scaled_cpu_params())
    assert all(3 <= j.num_turns <= 8 for j in jobs)
    assert max(j.total_tokens() for j in jobs) < 6000
    gaps = [t.tool_s for j in jobs for t in j.turns[:-1]]
    assert max(gaps) <= 4.0 and 0.3 < sum(gaps) / len(gaps) < 2.5


def _replay(tmp_path, name, seconds, jobs):
    cfg = ReplayConfig(num_gpu_blocks=60, block_size=128, max_num_batched_tokens=4096, step_cost=f"constant:{seconds}")
    return write_outputs(run_replay(jobs, cfg, step_cost=ConstantStepCost(seconds)), tmp_path / name)


def test_compare_two_replays_of_the_same_jobs(tmp_path):
    jobs = with_poisson_arrivals(synthetic_jobs(4, seed=0, params=scaled_cpu_params()), 0.5, seed=0)
    slow, fast = _replay(tmp_path, "slow", 0.02, jobs), _replay(tmp_path, "fast", 0.01, jobs)
    result = compare.compare(compare.load_replay(slow), compare.load_replay(fast))
    m = {r["metric"]: r for r in result["metrics"]}
    # Every step takes twice as long: a turn's inter-token time doubles exactly.
    assert m["TPOT mean (s)"]["rel_err"] == pytest.approx(1.0)
    assert m["TTFT mean (s)"]["rel_err"] > 0.5
    assert m["prefix-hit tokens (sum)"]["a"] == m["prefix-hit tokens (sum)"]["b"] > 0
    assert result["num_turns"] == sum(j.num_turns for j in jobs)
    compare.write(result, tmp_path / "cmp", command="test")
    doc = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert doc["command"] == "test" and (tmp_path / "cmp" / "comparison.md").read_text().startswith("<!-- test -->")


def test_compare_refuses_replays_of_different_jobs(tmp_path):
    a = _replay(tmp_path, "a", 0.01, synthetic_jobs(2, seed=0, params=scaled_cpu_params()))
    b = _replay(tmp_path, "b", 0.01, synthetic_jobs(3, seed=0, params=scaled_cpu_params()))
    with pytest.raises(ResultsFormatError, match="not replays of the same jobs"):
        compare.compare(compare.load_replay(a), compare.load_replay(b))


def test_compare_replay_cli_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpubench.cli", "compare-replay", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "not a replay directory" in proc.stderr


def test_summary_has_tpot_percentiles_and_goodput():
    from scheduling.metrics import SLO_TPOT_S, SLO_TTFT_S

    jobs = with_poisson_arrivals(synthetic_jobs(4, seed=0, params=scaled_cpu_params()), 0.5, seed=0)
    fast = run_replay(jobs, ReplayConfig(num_gpu_blocks=60, block_size=128, step_cost="constant:0.01"),
                      step_cost=ConstantStepCost(0.01)).summary
    slow = run_replay(jobs, ReplayConfig(num_gpu_blocks=60, block_size=128, step_cost="constant:0.2"),
                      step_cost=ConstantStepCost(0.2)).summary
    # Every decode step takes the constant: a turn's inter-token time is exactly that.
    assert fast["tpot_p50_s"] == pytest.approx(0.01) and fast["tpot_p99_s"] == pytest.approx(0.01)
    assert slow["tpot_mean_s"] == pytest.approx(0.2)
    assert fast["slo"] == {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S}
    assert fast["slo_turn_share"] == 1.0 and fast["goodput_tok_per_s"] == pytest.approx(fast["output_tok_per_s"])
    assert slow["slo_turn_share"] == 0.0 and slow["goodput_tok_per_s"] == 0.0  # 0.2 s > the 0.1 s TPOT target
