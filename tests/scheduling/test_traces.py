"""Trace schema, validation, JSONL round trip, Poisson arrivals and the synthetic generator."""
from __future__ import annotations

import json

import numpy as np
import pytest

from common.errors import GpubenchError, TraceFormatError
from scheduling.workload.trace_files import load_trace
from scheduling.workload.trace_synth import SyntheticParams, ToolTimeModel, synthetic_jobs, trace_stats
from scheduling.workload.traces import Job, Turn, job_from_dict, save_trace, validate_job, with_poisson_arrivals


def make_job(job_id="j0", turns=((100, 10, "bash", 0.5), (50, 20, None, 0.0)), system_tokens=1000, group="g0"):
    return Job(job_id, group, system_tokens, tuple(Turn(*t) for t in turns))


def test_prompt_layout_counts_whole_history():
    job = make_job(turns=((100, 10, "bash", 0.5), (50, 20, "edit", 1.0), (7, 3, None, 0.0)))
    assert job.prompt_tokens(0) == 1000 + 100
    assert job.prompt_tokens(1) == 1000 + 100 + 10 + 50
    assert job.prompt_tokens(2) == 1000 + 110 + 70 + 7
    assert job.total_tokens() == 1000 + 110 + 70 + 10


def test_roundtrip_jsonl(tmp_path):
    jobs = with_poisson_arrivals(synthetic_jobs(20, seed=3), jps=2.0, seed=1)
    path = save_trace(jobs, tmp_path / "t.jsonl")
    assert load_trace(path) == jobs


@pytest.mark.parametrize("mutate, field", [
    (lambda o: o.pop("system_tokens"), "system_tokens"),
    (lambda o: o.update(system_tokens=-1), "system_tokens"),
    (lambda o: o.update(job_id=""), "job_id"),
    (lambda o: o.update(turns=[]), "turns"),
    (lambda o: o["turns"][0].update(output_tokens=0), "output_tokens"),
    (lambda o: o["turns"][0].update(input_tokens=1.5), "input_tokens"),
    (lambda o: o["turns"][0].update(input_tokens="12"), "input_tokens"),
    (lambda o: o["turns"][0].update(tool_s=-2), "tool_s"),
    (lambda o: o["turns"][0].update(tool_s=float("nan")), "tool_s"),
    (lambda o: o["turns"][1].update(tool="bash", tool_s=3.0), "tool"),
    (lambda o: o.update(arrival_s=-1), "arrival_s"),
])
def test_bad_job_names_file_line_job_and_field(tmp_path, mutate, field):
    good = {"job_id": "ok", "prefix_group": "g", "system_tokens": 10,
            "turns": [{"input_tokens": 5, "output_tokens": 2, "tool": "bash", "tool_s": 0.1},
                      {"input_tokens": 5, "output_tokens": 2, "tool": None, "tool_s": 0}]}
    bad = json.loads(json.dumps(good))
    bad["job_id"] = "bad-7"
    mutate(bad)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    msg = str(info.value)
    assert f"{path}:3" in msg and repr(field) in msg, msg
    if field != "job_id":
        assert "'bad-7'" in msg
    assert isinstance(info.value, GpubenchError)


def test_bad_json_and_duplicates_and_missing(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"job_id": "a", oops}\n')
    with pytest.raises(TraceFormatError, match=r"t.jsonl:1: malformed JSON"):
        load_trace(path)
    line = json.dumps({"job_id": "a", "system_tokens": 5, "turns": [{"input_tokens": 1, "output_tokens": 1}]})
    path.write_text(line + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: job 'a': field 'job_id' duplicates line 1"):
        load_trace(path)
    with pytest.raises(TraceFormatError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")
    path.write_text("\n")
    with pytest.raises(TraceFormatError, match="no jobs"):
        load_trace(path)


def test_validate_job_built_in_code():
    with pytest.raises(TraceFormatError, match=r"job 'x' turn 0: field 'output_tokens'"):
        validate_job(make_job("x", turns=((1, 0, None, 0.0),)))
    with pytest.raises(TraceFormatError, match="empty first prompt"):
        validate_job(make_job("x", turns=((0, 1, None, 0.0),), system_tokens=0))
    validate_job(make_job())


def test_defaults_prefix_group_and_tool():
    job = job_from_dict({"job_id": "a", "system_tokens": 5, "turns": [{"input_tokens": 1, "output_tokens": 1}]})
    assert job.prefix_group == "default" and job.turns[0].tool is None and job.arrival_s == 0.0


def test_poisson_arrivals_rate_order_and_seed():
    jobs = synthetic_jobs(2000, seed=0, params=SyntheticParams(turns_mean=4, turns_max=6))
    arrived = with_poisson_arrivals(jobs, jps=5.0, seed=11)
    times = np.array([j.arrival_s for j in arrived])
    assert np.all(np.diff(times) > 0) and times[0] > 0
    gaps = np.diff(np.concatenate([[0.0], times]))
    # mean gap 1/jps within ~4 standard errors (sd of the mean = 0.2 / sqrt(2000))
    assert abs(gaps.mean() - 0.2) < 4 * 0.2 / np.sqrt(2000)
    # exponential: coefficient of variation 1
    assert 0.9 < gaps.std() / gaps.mean() < 1.1
    assert with_poisson_arrivals(jobs, 5.0, 11) == arrived
    assert with_poisson_arrivals(jobs, 5.0, 12) != arrived
    assert [j.turns for j in arrived] == [j.turns for j in jobs]
    assert all(j.arrival_s == 0.0 for j in with_poisson_arrivals(jobs[:5], float("inf"), 0))


def test_synthetic_seeded_and_prefix_stable():
    a = synthetic_jobs(30, seed=5)
    assert a == synthetic_jobs(30, seed=5)
    assert a != synthetic_jobs(30, seed=6)
    assert synthetic_jobs(10, seed=5) == a[:10]
    for job in a:
        validate_job(job)
    # one system-prompt size per prefix group
    sizes: dict[str, set[int]] = {}
    for job in a:
        sizes.setdefault(job.prefix_group, set()).add(job.system_tokens)
    assert all(len(s) == 1 for s in sizes.values())


def test_synthetic_defaults_match_swe_smith_statistics():
    """The default agent is calibrated to public SWE-smith statistics (per job: ~43 turns, ~142K
    summed prompt tokens, ~1.1K output tokens, ~131:1) and agent tool times (medians 0.1-0.6 s,
    a heavy tail holding a large share of tool time)."""
    from scheduling.workload.trace_synth import SWE_SMITH_TARGETS

    jobs = synthetic_jobs(600, seed=0)
    s = trace_stats(jobs)
    for name, (low, high) in SWE_SMITH_TARGETS.items():
        assert low <= s[name] <= high, (name, s[name], (low, high))
    assert s["turns_min"] >= 3 and s["turns_max"] <= 120
    assert s["tool_s_max"] >= 60 and s["tool_time_share_ge_60s"] > 0.3  # the tail holds the time
    assert s["tool_s_mean"] < 2.0 and s["job_tool_s_mean"] < 90  # ...but a job is not mostly tool time
    tools = {t.tool for j in jobs for t in j.turns}
    assert {"bash", "edit", "view", "search", "test", "submit", None} <= tools


def test_long_context_preset_is_heavier():
    from scheduling.workload.trace_synth import PRESETS

    base = trace_stats(synthetic_jobs(300, 0))
    long = trace_stats(synthetic_jobs(300, 0, PRESETS["swe-long"]()))
    assert 10_000 <= long["final_context_median"] <= 60_000
    assert long["job_prompt_tokens_median"] > 3 * base["job_prompt_tokens_median"]
    assert 100 <= long["out_tokens_median"] <= 300


def test_synthetic_params_change_distributions():
    short = synthetic_jobs(200, 0, SyntheticParams(turns_mean=5, turns_min=2, turns_max=8, out_tokens_median=50))
    s = trace_stats(short)
    assert s["turns_max"] <= 8 and s["turns_min"] >= 2 and s["out_tokens_median"] < 80
    with pytest.raises(ValueError, match="without a duration model"):
        synthetic_jobs(1, 0, SyntheticParams(tool_mix={"teleport": 1.0}))


def test_tool_time_model_tail():
    rng = np.random.default_rng(0)
    model = ToolTimeModel(median_s=0.3, sigma=1.0, tail_prob=0.1, tail_scale_s=30, tail_alpha=1.2, max_s=600)
    x = model.sample(rng, 20000)
    assert 0.25 < np.median(x) < 0.5
    assert 0.08 < np.mean(x >= 30) < 0.12
    assert x.max() <= 600


def test_synthetic_same_across_processes(tmp_path):
    """Seeded means seeded: the same jobs in another process, whatever its hash randomization."""
    import subprocess
    import sys

    code = ("import hashlib, json; from scheduling.workload.trace_synth import synthetic_jobs; "
            "from scheduling.workload.traces import job_to_dict; "
            "print(hashlib.sha256(json.dumps([job_to_dict(j) for j in synthetic_jobs(40, 7)]).encode()).hexdigest())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": str(h)}).stdout for h in (1, 2, 3)}
    assert len(outs) == 1


def test_several_hundred_swesmith_trajectories_replay_end_to_end(tmp_path, capsys):
    """A SWE-smith-format file of 400 trajectories (all three layouts) loads back with the
    statistics of the jobs it renders and replays end to end on the predictor."""
    import json

    from gpubench.cli import main
    from scheduling.workload.trace_synth import SWE_SMITH_TARGETS

    path = tmp_path / "trajs.parquet"
    assert main(["trace", "swesmith", "--jobs", "400", "--out", str(path), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written == {"out": str(path), "jobs": 400, "bytes": path.stat().st_size, "preset": "swe", "seed": 0}
    jobs = load_trace(path)
    assert len(jobs) == 400 and len({j.job_id for j in jobs}) == 400
    loaded, source = trace_stats(jobs), trace_stats(synthetic_jobs(400, 0))
    assert loaded["turns_median"] == source["turns_median"]
    for key in ("job_prompt_tokens_median", "job_output_tokens_median", "final_context_median"):
        assert 0.95 <= loaded[key] / source[key] <= 1.2, key  # a tool call has a minimum length
    low, high = SWE_SMITH_TARGETS["turns_median"]
    assert low <= loaded["turns_median"] <= high
    assert len({j.prefix_group for j in jobs}) == 4  # one system prompt per group, shared
    out = tmp_path / "replay"
    assert main(["replay", "--trace", str(path), "--jps", "1", "--sku", "h100-sxm", "--out", str(out),
                 "--no-progress", "--no-step-log"]) == 0
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    assert metrics["num_jobs"] == 400 and metrics["num_turns"] == sum(j.num_turns for j in jobs)
    assert metrics["gpu_prefix_hit_rate"] > 0.9 and metrics["arrival_span_s"] > 100


def test_trace_stats_command_prints_targets_and_plots(tmp_path, capsys):
    from gpubench.cli import main

    png = tmp_path / "stats.png"
    assert main(["trace", "stats", "--jobs", "200", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "public SWE-smith target" in out and "turns per job, median" in out
    assert png.stat().st_size > 10_000
    assert main(["trace", "stats", "--jobs", "50", "--preset", "swe-long", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stats"]["num_jobs"] == 50 and "turns_median" in doc["targets"]
