"""run_replay / write_outputs / `gpubench replay` (real files, a real subprocess)."""
import json
import math
import pickle

import pandas as pd
import pytest

from common.errors import ConfigError
from gpubench import skus
from predictor import load_model_config
from scheduling.engine.loop import JOB_COLUMNS, STEP_COLUMNS, TURN_COLUMNS
from scheduling.experiments.replay import ReplayConfig, kv_pool_blocks, run_replay, write_outputs
from scheduling.workload.trace_synth import SyntheticParams, synthetic_jobs
from scheduling.workload.traces import save_trace, with_poisson_arrivals
from tests.conftest import gpubench

SMALL = SyntheticParams(turns_mean=4, turns_min=2, turns_max=6, obs_tokens_median=100, obs_tokens_max=600,
                        out_tokens_median=20, out_tokens_max=60)


def jobs(n=5, seed=1):
    return with_poisson_arrivals(synthetic_jobs(n, seed=seed, params=SMALL), 2.0, seed=seed)


def test_kv_pool_blocks_formula():
    s, m = skus.get("h100-sxm"), load_model_config("llama-3.1-8b")
    # The driver-reported total in binary MiB (81,559 MiB on an H100 80GB), as vLLM reads it.
    assert s.device_memory_bytes == 81559 * 2**20
    expect = math.floor((81559 * 2**20 * 0.9 - m.weight_bytes(2) - 2 * 2**30) / (m.kv_bytes_per_token(2) * 16))
    blocks, kv_per_token, link = kv_pool_blocks(skus.get("h100-sxm"), load_model_config("llama-3.1-8b"))
    assert blocks == expect and kv_per_token == m.kv_bytes_per_token(2) and link == s.host_link_gbs
    # more memory -> more blocks; a 70B model in bf16 does not fit a 40 GB card
    assert kv_pool_blocks(skus.get("h200"), load_model_config("llama-3.1-8b"))[0] > blocks
    with pytest.raises(ConfigError, match="leaves no room"):
        kv_pool_blocks(skus.get("a100-40"), load_model_config("llama-3.1-70b"))


def test_run_replay_with_the_predictor_and_outputs(tmp_path):
    cfg = ReplayConfig(policy="continuum", max_num_batched_tokens=2048)
    res = run_replay(jobs(), cfg)
    out = write_outputs(res, tmp_path / "run", command="gpubench replay ...")
    doc = json.loads((out / "summary.json").read_text())
    assert doc["config"]["policy"] == "continuum" and doc["command"] == "gpubench replay ..."
    m = doc["metrics"]
    for key in ("jct_mean_s", "jct_p50_s", "jct_p90_s", "jct_p99_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
                "queue_mean_s", "output_tok_per_s", "jobs_per_s", "gpu_prefix_hit_rate", "pool_hit_rate",
                "preemptions", "recomputed_tokens", "sim_wall_s", "steps"):
        assert key in m
    assert m["num_jobs"] == 5 and m["step_cost"].startswith("predictor:h100-sxm")
    steps = pd.read_csv(out / "steps.csv")
    turns = pd.read_csv(out / "turns.csv")
    jobs_df = pd.read_csv(out / "jobs.csv")
    assert tuple(steps.columns) == STEP_COLUMNS and len(steps) == m["steps"]
    assert tuple(turns.columns) == TURN_COLUMNS and tuple(jobs_df.columns) == JOB_COLUMNS
    assert (steps["dur_s"] > 0).all() and steps["t_s"].is_monotonic_increasing
    # step time grows with the batch: a prefill step of a long prompt outlasts a lone decode step
    assert steps.loc[steps["num_prefill_tokens"] > 1000, "dur_s"].min() > steps.loc[
        (steps["num_prefill_tokens"] == 0) & (steps["num_decode_seqs"] == 1), "dur_s"].max()
    assert (jobs_df["jct_s"] > 0).all()


def test_replay_is_deterministic_and_config_pickles():
    cfg = ReplayConfig(policy="cpu-offload", policy_params={"cpu_gib": 1.0}, num_gpu_blocks=400,
                       step_cost="constant:0.01")
    cfg2 = pickle.loads(pickle.dumps(cfg))
    a, b = run_replay(jobs(), cfg), run_replay(jobs(), cfg2)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    pd.testing.assert_frame_equal(a.turns, b.turns)
    assert {k: v for k, v in a.summary.items() if k not in ("sim_wall_s", "steps_per_wall_s")} == \
        {k: v for k, v in b.summary.items() if k not in ("sim_wall_s", "steps_per_wall_s")}


def test_cli_replay_synthetic_and_trace(tmp_path):
    p = gpubench("replay", "--jobs", "3", "--jps", "1", "--policy", "lmcache", "--lmcache-cpu-gib", "2",
                 "--step-cost", "constant:0.01", "--no-progress", "--out", str(tmp_path / "syn"))
    assert p.returncode == 0, p.stderr
    assert "GPU prefix-hit rate" in p.stdout
    doc = json.loads((tmp_path / "syn" / "summary.json").read_text())
    assert doc["config"]["policy_params"] == {"cpu_gib": 2.0} and doc["metrics"]["num_jobs"] == 3


def test_cli_replay_trace_in_process(tmp_path, capsys):
    from gpubench.cli import main

    trace = save_trace(jobs(3), tmp_path / "t.jsonl")
    rc = main(["replay", "--trace", str(trace), "--policy", "continuum", "--ttl-rule", "fixed",
               "--step-cost", "constant:0.01", "--out", str(tmp_path / "tr")])
    assert rc == 0
    assert len(pd.read_csv(tmp_path / "tr" / "jobs.csv")) == 3
    assert json.loads((tmp_path / "tr" / "summary.json").read_text())["config"]["policy_params"] == {"ttl_rule": "fixed"}


@pytest.mark.parametrize("args, message", [
    (["--jobs", "3", "--jps", "1", "--policy", "fcfs", "--cpu-gib", "4"], "applies to policy 'cpu-offload'"),
    (["--jobs", "3"], "need --jps"),
    (["--jobs", "3", "--jps", "1", "--sku", "h9000"], "unknown SKU"),
    (["--jobs", "3", "--jps", "1", "--step-cost", "magic"], "unknown step cost"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, args, message):
    from gpubench.cli import main

    rc = main(["replay", *args, "--no-progress", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_token_budget_and_max_num_seqs_follow_vllm_serve_defaults():
    from scheduling.experiments.replay import engine_config, vllm_server_defaults

    # vllm serve keys its defaults on driver-reported memory and the device name.
    def defaults(sku):
        return vllm_server_defaults(skus.get(sku))

    assert defaults("b200") == (16384, 1024)
    assert defaults("h100-sxm") == defaults("h200") == (8192, 1024)
    assert defaults("a100-80") == (2048, 256)  # >= 70 GiB, but an A100
    assert defaults("l40s") == defaults("a100-40") == (2048, 256)
    assert defaults("cpu") == (4096, 256)  # what replay --engine vllm runs
    ecfg = engine_config(ReplayConfig(sku="l40s"))
    assert (ecfg.max_num_batched_tokens, ecfg.max_num_seqs) == (2048, 256)
    ecfg = engine_config(ReplayConfig(sku="l40s", max_num_batched_tokens=4096, max_num_seqs=64))
    assert (ecfg.max_num_batched_tokens, ecfg.max_num_seqs) == (4096, 64)


def test_async_scheduling_overlaps_host_time_on_gpus():
    from predictor import StepModel

    model = StepModel.for_names(sku="h100-sxm", model="llama-3.1-8b")
    batch = [(1, 2000)] * 4
    parts = model.predict(batch)
    device_s = parts.total_s - parts.host_s
    assert model.predict_time(batch) == pytest.approx(parts.total_s)
    assert model.predict_time(batch, async_scheduling=True) == pytest.approx(max(device_s, parts.host_s))
    assert model.predict_time(batch, async_scheduling=True) < model.predict_time(batch)
    cpu = StepModel.for_names(sku="cpu", model="smollm2-135m")  # no device queue to overlap with
    assert cpu.predict_time(batch, async_scheduling=True) == cpu.predict_time(batch)


@pytest.mark.parametrize("fields, message", [
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    ({"block_size": 1.5}, "block_size must be an integer >= 1"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"activation_reserve_gib": float("nan")}, "activation_reserve_gib must be a finite number"),
    ({"sku": "h1000"}, "h1000"),
    ({"model": "llama-9000"}, "llama-9000"),
    ({"policy": "lru-ish"}, "unknown policy 'lru-ish'"),
    ({"policy": "continuum", "policy_params": {"ttl_s": -1.0}}, "ttl_s"),
])
def test_a_replay_config_checks_itself_when_made(fields, message):
    # One place checks a replay's settings: the CLI, --set and a sweep's cells all make a ReplayConfig.
    from common.errors import GpubenchError  # ConfigError, UnknownSKUError, ...: one line at the CLI

    with pytest.raises(GpubenchError, match=message):
        ReplayConfig(**fields)


def test_a_replay_config_resolves_its_sku_and_model_once(monkeypatch):
    from scheduling.experiments import replay

    cfg = ReplayConfig(sku="h200", model="llama-3.1-8b", num_gpu_blocks=None)
    assert cfg.sku_spec.id == "h200" and cfg.model_config.num_layers > 0
    calls = []
    monkeypatch.setattr(skus, "get", lambda *a: calls.append(a))  # any later lookup would be seen
    replay.engine_config(cfg)
    assert calls == []
    assert pickle.loads(pickle.dumps(cfg)) == cfg and cfg.to_dict()["sku"] == "h200"
