"""Step jitter (``replay --step-jitter CV --jitter-seed N``): a real engine's step-to-step noise in the
simulator, what it does to a timing-dependent router's routes, and ``compare-replay --run``, which
scores the mean of several jittered runs."""
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import ConfigError
from scheduling.engine.step_cost import ConstantStepCost, JitteredStepCost, PredictorStepCost
from scheduling.experiments import compare
from scheduling.experiments.replay import ReplayConfig, run_replay, write_outputs
from scheduling.workload.trace_synth import scaled_cpu_params, synthetic_jobs
from scheduling.workload.traces import with_poisson_arrivals

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(num_prefill_tokens=0, num_prefill_seqs=0, prefill_context_tokens=0, num_decode_seqs=4,
             decode_context_tokens=800)


def test_the_factors_have_mean_one_and_the_asked_coefficient_of_variation():
    cost = JitteredStepCost(ConstantStepCost(0.02), 0.15, seed=3)
    draws = [cost.step_s(**SHAPE) / 0.02 for _ in range(40_000)]
    assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.005)
    assert statistics.pstdev(draws) == pytest.approx(0.15, rel=0.04)
    assert min(draws) > 0
    again = JitteredStepCost(ConstantStepCost(0.02), 0.15, seed=3)
    assert [again.step_s(**SHAPE) for _ in range(5)] == [d * 0.02 for d in draws[:5]]  # the seed fixes the draws
    other = JitteredStepCost(ConstantStepCost(0.02), 0.15, seed=4)
    assert [other.step_s(**SHAPE) for _ in range(5)] != [d * 0.02 for d in draws[:5]]


def test_every_decode_step_draws_and_estimates_do_not():
    base = PredictorStepCost("h100-sxm", "llama-3.1-8b")
    cost = JitteredStepCost(base, 0.1, seed=0)
    seconds, dmax = cost.decode_quantum(4, 800)
    assert dmax == 800  # no other context shares these seconds: the next decode step draws again
    assert cost.decode_quantum(4, 800)[0] != seconds
    assert cost.expected() is base
    assert "jitter(cv=0.1, seed=0)" in cost.describe()
    with pytest.raises(ValueError):
        JitteredStepCost(base, 0.0, seed=0)


def _cluster(tmp_path, name: str, **fields):
    jobs = with_poisson_arrivals(synthetic_jobs(12, seed=5, params=scaled_cpu_params()), 2.0, seed=5)
    cfg = ReplayConfig(sku="h100-sxm", model="llama-3.1-8b", num_gpu_blocks=40, block_size=128,
                       max_num_batched_tokens=4096, replicas=2, router="least-loaded", seed=5, **fields)
    result = run_replay(jobs, cfg)
    return result, write_outputs(result, tmp_path / name)


def test_jitter_moves_a_load_reading_routers_routes_and_a_seed_repeats_them(tmp_path):
    plain, _ = _cluster(tmp_path, "plain")
    runs = [_cluster(tmp_path, f"j{k}", step_jitter=0.1, jitter_seed=k)[0] for k in range(4)]
    again, _ = _cluster(tmp_path, "j0-again", step_jitter=0.1, jitter_seed=0)
    key = ["job_id", "turn"]

    def routes(res):
        return res.turns.sort_values(key)["replica"].tolist()

    assert routes(again) == routes(runs[0])
    assert again.turns.sort_values(key)["finish_s"].tolist() == runs[0].turns.sort_values(key)["finish_s"].tolist()
    # The noise is small per step, but least-loaded reads the load at an instant: routes differ.
    assert any(routes(r) != routes(plain) for r in runs)
    assert len({tuple(routes(r)) for r in runs}) > 1
    assert runs[0].summary["step_cost"].endswith("jitter(cv=0.1, seed=0)")
    assert plain.summary["step_cost"] == "predictor:h100-sxm:llama-3.1-8b"
    assert runs[0].config.to_dict()["step_jitter"] == 0.1


@pytest.mark.parametrize("fields, message", [({"step_jitter": 1.5}, "is a coefficient of variation in"),
                                             ({"step_jitter": -0.1}, "step_jitter"),
                                             ({"jitter_seed": -1}, "jitter_seed must be an integer >= 0"),
                                             ({"jitter_seed": 3}, "without step_jitter draws nothing")])
def test_bad_jitter_settings_are_refused_when_the_config_is_made(fields, message):
    with pytest.raises(ConfigError, match=message):
        ReplayConfig(**fields)


def gpubench(*args):
    return subprocess.run([sys.executable, "-m", "gpubench", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


@pytest.mark.parametrize("args", [["--step-jitter", "2"], ["--step-jitter", "0.1", "--engine", "vllm"],
                                  ["--jitter-seed", "3", "--engine", "vllm"]])
def test_the_cli_refuses_bad_jitter_in_one_line_before_any_work(tmp_path, args):
    proc = gpubench("replay", "--jobs", "2", "--jps", "1", "--out", str(tmp_path / "out"), *args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


def test_compare_replay_scores_the_runs_mean_against_the_takes_mean(tmp_path):
    _, reference = _cluster(tmp_path, "reference", step_jitter=0.1, jitter_seed=100)  # stands in for live takes
    _, take2 = _cluster(tmp_path, "take2", step_jitter=0.1, jitter_seed=101)
    paths = [_cluster(tmp_path, f"run{k}", step_jitter=0.1, jitter_seed=k)[1] for k in range(3)]
    proc = gpubench("compare-replay", str(paths[0]), str(reference), "--repeat", str(take2), "--run", str(paths[1]),
                    "--run", str(paths[2]), "--out", str(tmp_path / "cmp"), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["metric"]: r for r in json.loads(proc.stdout)["metrics"]}
    ttft = rows["TTFT p50 (s)"]
    own = [json.loads((p / "summary.json").read_text())["metrics"]["ttft_p50_s"] for p in paths]
    assert ttft["runs_values"] == pytest.approx(own)  # each run's own TTFT p50, the scored replay's first
    assert ttft["runs_mean"] == pytest.approx(statistics.fmean(own))
    assert ttft["runs_mean_rel_err"] == pytest.approx((ttft["runs_mean"] - ttft["takes_mean"]) / ttft["takes_mean"])
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "sim h100-sxm, 3 runs: mean (range)" in table and "runs' mean vs the takes' mean" in table
    # Without takes, the runs' mean is held against the reference.
    alone = compare.with_runs(compare.compare(compare.load_replay(paths[0]), compare.load_replay(reference)),
                              compare.load_replay(paths[0]), compare.load_replay(reference),
                              [compare.load_replay(p) for p in paths[1:]])
    row = next(r for r in alone["metrics"] if r["metric"] == "TTFT p50 (s)")
    assert math.isclose(row["runs_mean_rel_err"], (row["runs_mean"] - row["b"]) / row["b"])


def test_a_run_of_other_settings_or_the_scored_replay_itself_is_refused(tmp_path):
    _, scored = _cluster(tmp_path, "scored", step_jitter=0.1, jitter_seed=0)
    _, reference = _cluster(tmp_path, "reference")
    _, other = _cluster(tmp_path, "other", step_jitter=0.2, jitter_seed=1)
    for run, message in ((other, "only --jitter-seed may differ): step_jitter is 0.2 there"),
                         (scored, "is given twice or is the scored replay itself")):
        proc = gpubench("compare-replay", str(scored), str(reference), "--run", str(run))
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert message in proc.stderr


def test_step_noise_cv_refuses_malformed_rows_in_one_line(tmp_path):
    script = REPO / "scripts" / "step_noise_cv.py"
    for content, message in (("[1, 2]\n", "line 1: not a JSON object"), ("{oops\n", "line 1: Expecting"),
                             ('{"family": "engine_step", "wall_times_s": [0, 1, 1, 1, 1, 1]}\n',
                              "line 1: a wall time that is not a positive number")):
        (tmp_path / "vllm_ops.jsonl").write_text(content)
        proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr


def test_step_noise_cv_reads_a_probe_runs_engine_rows(tmp_path):
    """scripts/step_noise_cv.py: steps alternating 1 and e^0.2 have log differences of +-0.2, whose
    spread over sqrt(2) is 0.141; rows of other families and short rows are not read."""
    times = [1.0 if i % 2 == 0 else math.exp(0.2) for i in range(20)]
    rows = [{"key": "a", "family": "engine_step", "wall_times_s": times},
            {"key": "b", "family": "engine_layers", "wall_times_s": times},
            {"key": "c", "family": "matmul", "wall_times_s": [1.0, 3.0] * 10},
            {"key": "d", "family": "engine_step", "wall_times_s": [1.0, 9.0]}]
    (tmp_path / "vllm_ops.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = REPO / "scripts" / "step_noise_cv.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"{0.2 / math.sqrt(2):.3f}", proc.stderr
    assert proc.stderr.count(": 0.141") == 2
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "none")], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_the_committed_jittered_router_check_regenerates(tmp_path):
    """results/cluster/live-jitter: two of least-loaded's jittered simulator runs at 1 job/s, re-run from
    their COMMAND lines, give the committed turns (a seed fixes the draws); the check re-run on the
    committed runs and takes gives the committed runs' and takes' means."""
    import shlex

    import pandas as pd

    d = REPO / "results" / "cluster" / "live-jitter"
    lines = (d / "COMMAND").read_text().splitlines()
    cell = "least-loaded-jps-1"
    for seed in (0, 5):
        line = next(ln for ln in lines if ln.endswith(f"--out {d.relative_to(REPO)}/sim-jitter/{cell}-seed-{seed}"))
        argv = shlex.split(line)
        argv[argv.index("--out") + 1] = str(tmp_path / f"seed-{seed}")
        proc = gpubench(*argv[1:])
        assert proc.returncode == 0, proc.stderr[-2000:]
        fresh = pd.read_csv(tmp_path / f"seed-{seed}" / "turns.csv")
        committed = pd.read_csv(d / "sim-jitter" / f"{cell}-seed-{seed}" / "turns.csv")
        for col in ("first_token_s", "finish_s", "hit_tokens", "replica"):
            assert fresh[col].tolist() == pytest.approx(committed[col].tolist(), rel=1e-9), col
    check = next(ln for ln in lines if ln.startswith("gpubench compare-replay") and f"--out {d.relative_to(REPO)}/check/{cell}" in ln)
    argv = shlex.split(check)
    argv[argv.index("--out") + 1] = str(tmp_path / "check")
    assert gpubench(*argv[1:]).returncode == 0
    fresh = {r["metric"]: r for r in json.loads((tmp_path / "check" / "comparison.json").read_text())["metrics"]}
    want = {r["metric"]: r for r in json.loads((d / "check" / cell / "comparison.json").read_text())["metrics"]}
    for name in ("TTFT p50 (s)", "JCT mean (s)"):
        assert fresh[name]["runs_mean"] == pytest.approx(want[name]["runs_mean"]), name
        assert fresh[name]["takes_mean"] == pytest.approx(want[name]["takes_mean"]), name
