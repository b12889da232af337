"""A replay (or sweep) whose GPU KV pool never fills says so on stderr: users compared KV policies on
tiny workloads, got the same numbers from each, and had no hint why. A run that fills the pool
says nothing; the counts behind the note are exact with the step log on or off."""
from __future__ import annotations

import json
import re

import pytest

from gpubench.cli import main
from scheduling.experiments.sweep_table import load_table

TINY = ["--jobs", "3", "--jps", "1", "--step-cost", "constant:0.02", "--no-progress"]
# Six agents at 2 jobs/s in 800 blocks: cached prefixes are evicted and requests wait for blocks.
FULL = ["--jobs", "6", "--jps", "2", "--step-cost", "constant:0.02", "--no-progress", "--num-gpu-blocks", "800"]
NOTE = re.compile(r"note: the GPU KV pool never filled \(peak ([\d,]+) of ([\d,]+) blocks\)")


@pytest.mark.parametrize("policy", ["fcfs", "cpu-offload"])
def test_replay_notes_a_pool_that_never_filled(tmp_path, capsys, policy):
    assert main(["replay", *TINY, "--policy", policy, "--out", str(tmp_path / "r")]) == 0
    out, err = capsys.readouterr()
    [line] = [ln for ln in err.splitlines() if ln.startswith("note:")]
    peak, total = (int(g.replace(",", "")) for g in NOTE.match(line).groups())
    metrics = json.loads((tmp_path / "r" / "summary.json").read_text())["metrics"]
    assert (peak, total) == (metrics["kv_peak_blocks"], metrics["num_gpu_blocks"]) and 0 < peak < total
    assert "--num-gpu-blocks" in line and "note:" not in out


def test_replay_json_stays_json_and_the_note_goes_to_stderr(tmp_path, capsys):
    assert main(["replay", *TINY, "--json", "--out", str(tmp_path / "r")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["metrics"]["kv_evicted_blocks"] == 0
    assert NOTE.search(err)


def test_replay_that_fills_the_pool_has_no_note(tmp_path, capsys):
    assert main(["replay", *FULL, "--out", str(tmp_path / "r")]) == 0
    _, err = capsys.readouterr()
    assert "note:" not in err
    metrics = json.loads((tmp_path / "r" / "summary.json").read_text())["metrics"]
    assert metrics["kv_peak_blocks"] == metrics["num_gpu_blocks"] == 800
    assert metrics["kv_evicted_blocks"] > 0 and metrics["kv_block_shortages"] > 0


@pytest.mark.parametrize("blocks, filled", [(800, True), (None, False)])
def test_peak_matches_the_step_log_and_does_not_need_it(blocks, filled):
    """The peak is blocks in use or holding a cached prefix; with the step log off (a sweep's cells)
    the engine's inline decode runs still count."""
    from scheduling.experiments.replay import ReplayConfig, pool_never_filled, run_replay
    from scheduling.workload.trace_synth import synthetic_jobs
    from scheduling.workload.traces import with_poisson_arrivals

    jobs = with_poisson_arrivals(synthetic_jobs(6, 0), 2.0, seed=0)
    logged, unlogged = (run_replay(jobs, ReplayConfig(step_cost="constant:0.02", num_gpu_blocks=blocks,
                                                      record_steps=rec)) for rec in (True, False))
    steps = logged.steps
    assert logged.summary["kv_peak_blocks"] == (steps["kv_used_blocks"] + steps["kv_cached_blocks"]).max()
    keys = ("kv_peak_blocks", "kv_evicted_blocks", "kv_block_shortages", "preemptions")
    assert [unlogged.summary[k] for k in keys] == [logged.summary[k] for k in keys]
    assert pool_never_filled(logged.summary) is not filled


def test_sweep_notes_runs_whose_pool_never_filled(tmp_path, capsys):
    common = ["sweep", "--policies", "fcfs,continuum", "--skus", "h100-sxm", "--workers", "1", "--no-progress",
              "--no-plots"]
    assert main([*common, "--jps", "1", "--jobs", "3", "--json", "--out", str(tmp_path / "tiny")]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)) == 2
    assert "note: the GPU KV pool never filled in 2 of 2 runs" in err and "--set num_gpu_blocks=N" in err
    assert main([*common, "--jps", "2", "--jobs", "6", "--set", "num_gpu_blocks=800",
                 "--out", str(tmp_path / "full")]) == 0
    assert "note:" not in capsys.readouterr().err
    full = load_table(tmp_path / "full")
    assert len(full) == 2 and (full["error"] == "").all() and (full["kv_evicted_blocks"] > 0).all()
