"""Block size as an engine parameter, and `compare-replay` on two real simulator replays."""
import json
import subprocess
import sys

import pytest

from common.errors import ConfigError, ResultsFormatError
from scheduling.engine import EngineConfig
from scheduling.engine.step_cost import ConstantStepCost
from scheduling.experiments import compare
from scheduling.experiments.replay import ReplayConfig, run_replay, write_outputs
from scheduling.workload.trace_synth import scaled_cpu_params, synthetic_jobs
from scheduling.workload.traces import Job, Turn, with_poisson_arrivals


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
    (tmp_path / "other").mkdir()
    proc = subprocess.run([sys.executable, "-m", "gpubench.cli", "compare-replay", str(tmp_path), str(tmp_path / "other")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "not a replay directory" in proc.stderr


def _take(tmp_path, name, seconds, jobs):
    """A take of one replay's settings whose steps ran at another speed, as a live engine's do from run
    to run (the recorded settings are the same: the step cost is the object passed, not the label)."""
    cfg = ReplayConfig(num_gpu_blocks=60, block_size=128, max_num_batched_tokens=4096, step_cost="constant:0.01")
    return write_outputs(run_replay(jobs, cfg, step_cost=ConstantStepCost(seconds)), tmp_path / name)


def test_compare_with_repeats_scores_each_take_against_the_reference(tmp_path):
    jobs = with_poisson_arrivals(synthetic_jobs(4, seed=0, params=scaled_cpu_params()), 0.5, seed=0)
    ref = compare.load_replay(_take(tmp_path, "ref", 0.010, jobs))
    takes = [compare.load_replay(_take(tmp_path, n, s, jobs)) for n, s in (("r1", 0.011), ("r2", 0.0095))]
    close = compare.load_replay(_take(tmp_path, "close", 0.0105, jobs))
    far = compare.load_replay(_take(tmp_path, "far", 0.02, jobs))

    def tpot(result):
        return next(r for r in result["metrics"] if r["metric"] == "TPOT mean (s)")

    near = compare.with_repeats(compare.compare(close, ref), ref, takes, close)
    # every decode step is 10 % / -5 % / +5 % / +100 % longer: so is every turn's inter-token time
    row = tpot(near)
    assert row["repeat_rel_errs"] == pytest.approx([0.10, -0.05])
    assert row["takes_min"] == pytest.approx(0.0095) and row["takes_max"] == pytest.approx(0.011)
    assert row["takes_mean"] == pytest.approx((0.010 + 0.011 + 0.0095) / 3)
    assert row["rel_err_vs_takes_mean"] == pytest.approx(0.0105 / row["takes_mean"] - 1)
    assert row["within_takes_range"] is True  # 0.0105 s lies between 0.0095 and 0.011
    wide = compare.with_repeats(compare.compare(far, ref), ref, takes, far)
    assert tpot(wide)["rel_err"] == pytest.approx(1.0) and tpot(wide)["within_takes_range"] is False
    assert [t["path"] for t in wide["reference_repeats"]] == [str(t.path) for t in takes]
    text = compare.to_markdown(wide)
    assert "3 takes: range" in text and "0.010 .. 0.011" in text
    assert "against itself (2 other takes" in text
    # a count of 0 in every take compares as a value, not as a relative error
    pre = next(r for r in wide["metrics"] if r["metric"] == "preemptions (sum)")
    assert pre["b"] == 0 and pre["within_takes_range"] is True and pre["rel_err_vs_takes_mean"] is None
    compare.write(wide, tmp_path / "cmp", command="test")
    doc = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert len(doc["reference_repeats"]) == 2 and "repeat_turns" not in doc
    assert (tmp_path / "cmp" / "comparison.png").stat().st_size > 0


def test_compare_refuses_repeats_that_are_not_other_takes_of_the_reference(tmp_path):
    jobs = with_poisson_arrivals(synthetic_jobs(3, seed=0, params=scaled_cpu_params()), 0.5, seed=0)
    ref = compare.load_replay(_take(tmp_path, "ref", 0.01, jobs))
    take = compare.load_replay(_take(tmp_path, "take", 0.012, jobs))
    other = compare.load_replay(_replay(tmp_path, "other", 0.012, jobs))  # step_cost constant:0.012 recorded
    result = compare.compare(take, ref)
    with pytest.raises(ConfigError, match="the reference itself"):
        compare.with_repeats(result, ref, [ref], take)
    with pytest.raises(ConfigError, match="the scored replay itself"):
        compare.with_repeats(result, ref, [take], take)
    with pytest.raises(ConfigError, match="given twice"):
        compare.with_repeats(compare.compare(other, ref), ref, [take, take])
    with pytest.raises(ConfigError, match="step_cost is 'constant:0.012' there"):
        compare.with_repeats(result, ref, [other], take)
    diff_jobs = compare.load_replay(_take(tmp_path, "more", 0.01, synthetic_jobs(4, seed=0, params=scaled_cpu_params())))
    with pytest.raises(ResultsFormatError, match="not replays of the same jobs"):
        compare.with_repeats(result, ref, [diff_jobs], take)


def test_compare_replay_cli_with_repeats(tmp_path):
    jobs = with_poisson_arrivals(synthetic_jobs(3, seed=0, params=scaled_cpu_params()), 0.5, seed=0)
    dirs = [str(_take(tmp_path, n, s, jobs)) for n, s in (("a", 0.0105), ("ref", 0.01), ("r1", 0.011))]
    cmd = [sys.executable, "-m", "gpubench.cli", "compare-replay", dirs[0], dirs[1], "--repeat", dirs[2]]
    ok = subprocess.run(cmd + ["--out", str(tmp_path / "cmp")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "within the takes' range" in ok.stdout and (tmp_path / "cmp" / "comparison.png").is_file()
    bad = subprocess.run(cmd + ["--repeat", dirs[1]], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "reference itself" in bad.stderr


def test_summary_has_tpot_percentiles_and_goodput():
    from scheduling.experiments.metrics import SLO_TPOT_S, SLO_TTFT_S

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


def _cli_replay(out, *extra):
    """A small simulated replay through the CLI (it records its command, as a user's does)."""
    cmd = [sys.executable, "-m", "gpubench.cli", "replay", "--jobs", "4", "--preset", "scaled-cpu", "--seed", "0",
           "--num-gpu-blocks", "60", "--block-size", "128", "--step-cost", "constant:0.01", "--no-progress",
           "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return str(out)


def test_compare_replay_refuses_other_workloads_and_an_out_over_its_inputs(tmp_path):
    """summary.json's config holds the engine's settings, not the arrival rate: the recorded commands
    are what catches a --run, a --repeat or a pair replayed at another --jps; and --out naming an
    input would overwrite its turns.csv with the joined table."""
    a = _cli_replay(tmp_path / "a", "--jps", "1", "--step-jitter", "0.1", "--jitter-seed", "1")
    b = _cli_replay(tmp_path / "b", "--jps", "1")
    run = _cli_replay(tmp_path / "run", "--jps", "1", "--step-jitter", "0.1", "--jitter-seed", "2")
    other_rate = _cli_replay(tmp_path / "fast", "--jps", "3")
    other_run = _cli_replay(tmp_path / "fast-run", "--jps", "3", "--step-jitter", "0.1", "--jitter-seed", "2")
    base = [sys.executable, "-m", "gpubench.cli", "compare-replay"]
    ok = subprocess.run(base + [a, b, "--run", run, "--repeat", _cli_replay(tmp_path / "b2", "--jps", "1")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    before = (tmp_path / "b" / "turns.csv").read_text()
    for args, message in (([a, other_rate], "replay different jobs: jps is 1.0 and 3.0"),
                          ([a, b, "--run", other_run], "only --jitter-seed may differ): jps is 3.0 there and 1.0"),
                          ([a, b, "--repeat", other_rate], "not a take of the reference's settings: jps is 3.0"),
                          ([a, b, "--out", b], "--out " + b + " is the REFERENCE directory"),
                          ([b, b], "REPLAY and REFERENCE are both")):
        proc = subprocess.run(base + args, capture_output=True, text=True)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert message in proc.stderr, proc.stderr
    assert (tmp_path / "b" / "turns.csv").read_text() == before


def test_a_replay_over_an_earlier_one_leaves_none_of_its_files(tmp_path):
    """A capped cluster replay writes rejected.csv; a later replay into the same directory that
    refuses nothing must not leave it beside its own summary."""
    out = tmp_path / "r"
    _cli_replay(out, "--jps", "4", "--replicas", "2", "--max-outstanding", "1")
    assert (out / "rejected.csv").is_file()
    _cli_replay(out, "--jps", "4")
    assert not (out / "rejected.csv").exists()
