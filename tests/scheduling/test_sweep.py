"""Sweep: grid, options, resumable table, spec checks; end to end through the real replay engine
(process pool vs serial vs Ray when ray is importable), resume, plots, the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from common.errors import ConfigError, GpubenchError, UnknownSKUError
from scheduling.experiments.sweep import (
    CSV_NAME,
    SweepCell,
    SweepSpec,
    cell_jobs,
    load_table,
    parse_assignments,
    run_sweep,
    summary_metrics,
)
from scheduling.experiments.sweep_table import SweepTable

REPO = Path(__file__).resolve().parents[2]


def test_grid_and_keys():
    spec = SweepSpec(policies=("fcfs", "continuum"), skus=("h100-sxm",), jps=(0.1, 0.2), seeds=(0, 1))
    cells = spec.cells()
    assert len(cells) == 8 and len({c.key for c in cells}) == 8
    assert cells[0] == SweepCell("fcfs", "h100-sxm", 0.1, 0) and cells[0].key == "fcfs|h100-sxm|0.1|0"
    assert [c.policy for c in cells[:2]] == ["fcfs", "continuum"] and cells[2].jps == 0.2


def test_validate_names_values():
    with pytest.raises(ConfigError, match="unknown policy 'fcfz'"):
        SweepSpec(policies=("fcfz",)).validate()
    with pytest.raises(UnknownSKUError):
        SweepSpec(skus=("h1000",)).validate()
    with pytest.raises(ConfigError, match="jps values must be finite and > 0"):
        SweepSpec(jps=(0.0,)).validate()
    with pytest.raises(ConfigError, match="repeats"):
        SweepSpec(seeds=(1, 1)).validate()
    with pytest.raises(ConfigError, match="not in the sweep"):
        SweepSpec(policies=("fcfs",), policy_params={"continuum": {"ttl_s": 1}}).validate()
    SweepSpec().validate()


def test_cell_jobs_shared_across_policies_and_skus():
    spec = SweepSpec(num_jobs=5)
    a, b = cell_jobs(spec, 0.2, 3), cell_jobs(spec, 0.2, 3)
    assert a == b and len(a) == 5
    assert [j.arrival_s for j in cell_jobs(spec, 0.4, 3)] != [j.arrival_s for j in a]
    spec_trace = SweepSpec(num_jobs=2, trace=str(REPO / "scheduling/data/swesmith_sample.jsonl"))
    assert len(cell_jobs(spec_trace, 0.2, 0)) == 2


def test_parse_assignments():
    pp, rp = parse_assignments(["continuum.ttl_s=5", "continuum.ttl_rule=fixed", "max_num_seqs=128", "x=true"],
                               ["fcfs", "continuum"])
    assert pp == {"continuum": {"ttl_s": 5, "ttl_rule": "fixed"}} and rp == {"max_num_seqs": 128, "x": True}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_assignments(["oops"], [])


def test_summary_metrics_flatten():
    flat = summary_metrics({"config": {"sku": "x"}, "metrics": {"jct": {"mean_s": 1.5, "p90_s": 2}, "preemptions": 3,
                                                                "note": "text"}})
    assert flat == {"jct_mean_s": 1.5, "jct_p90_s": 2, "preemptions": 3}


def test_table_appends_widens_and_resumes(tmp_path):
    path = tmp_path / CSV_NAME
    t = SweepTable(path)
    t.append({"key": "a", "policy": "fcfs", "sku": "s", "jps": 0.1, "seed": 0, "m1": 1.0, "wall_s": 0.1, "error": ""})
    t.append({"key": "b", "policy": "fcfs", "sku": "s", "jps": 0.2, "seed": 0, "m2": 2.0, "wall_s": 0.1, "error": ""})
    frame = pd.read_csv(path)
    assert list(frame.columns) == ["key", "policy", "sku", "jps", "seed", "m1", "m2", "wall_s", "cpu_s", "error"]
    assert frame["m1"].tolist()[0] == 1.0 and pd.isna(frame["m1"].tolist()[1]) and frame["m2"].tolist()[1] == 2.0
    t2 = SweepTable(path)  # a resumed sweep keeps the header
    t2.append({"key": "c", "policy": "fcfs", "sku": "s", "jps": 0.4, "seed": 0, "m1": 3.0, "wall_s": 0.1, "error": ""})
    assert pd.read_csv(path)["key"].tolist() == ["a", "b", "c"]


# ---------------------------------------------------------------------------------------------
# End to end through scheduling.experiments.replay
# ---------------------------------------------------------------------------------------------

SMALL = dict(policies=("fcfs", "continuum"), skus=("l40s",), jps=(0.5, 2.0), seeds=(0,), num_jobs=4)


def _metric_frame(frame: pd.DataFrame) -> pd.DataFrame:
    drop = [c for c in ("wall_s", "cpu_s") if c in frame.columns]
    metrics = frame.drop(columns=drop)
    sim_wall = [c for c in metrics.columns if "wall" in c or c.endswith("sim_s") or "elapsed" in c]
    metrics = metrics.drop(columns=sim_wall)
    # the header order follows which cell finished first (new metrics are appended): compare by name
    return metrics[sorted(metrics.columns)].sort_values("key").reset_index(drop=True)


def test_sweep_end_to_end_pool_equals_serial_and_resumes(tmp_path):
    spec = SweepSpec(**SMALL)
    serial = run_sweep(spec, tmp_path / "serial", workers=1, progress=False, plots=False)
    assert len(serial) == 4 and (serial["error"] == "").all(), serial["error"].tolist()
    pooled = run_sweep(spec, tmp_path / "pool", workers=2, progress=False, plots=True)
    pd.testing.assert_frame_equal(_metric_frame(serial), _metric_frame(pooled))
    assert (tmp_path / "pool" / "jct_vs_jps.png").stat().st_size > 10_000
    # resume: nothing left to run, the table is unchanged; a bigger grid runs only new cells
    ran = []
    again = run_sweep(spec, tmp_path / "serial", workers=1, progress=False, plots=False, on_row=ran.append)
    assert ran == [] and len(again) == 4
    bigger = SweepSpec(**{**SMALL, "jps": (0.5, 2.0, 4.0)})
    run_sweep(bigger, tmp_path / "serial", workers=1, progress=False, plots=False, on_row=ran.append)
    assert sorted(r["jps"] for r in ran) == [4.0] * 2
    # a different fixed part refuses to mix into the same table
    with pytest.raises(ConfigError, match="different num_jobs"):
        run_sweep(SweepSpec(**{**SMALL, "num_jobs": 5}), tmp_path / "serial", workers=1, progress=False)


def test_sweep_pool_same_as_serial(tmp_path):
    """The process pool gives the rows a serial run gives (Ray: tests/scheduling/test_sweep_ray.py)."""
    spec = SweepSpec(policies=("fcfs",), skus=("h100-sxm",), jps=(3.0,), seeds=(0, 1), num_jobs=4)
    serial = run_sweep(spec, tmp_path / "serial", workers=1, progress=False, plots=False)
    other = run_sweep(spec, tmp_path / "pool", workers=2, progress=False, plots=False)
    pd.testing.assert_frame_equal(_metric_frame(serial), _metric_frame(other))


def test_ray_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does where the extra is not installed
    spec = SweepSpec(policies=("fcfs",), skus=("h100-sxm",), jps=(1.0,), num_jobs=2)
    with pytest.raises(GpubenchError, match="needs the optional extra"):
        run_sweep(spec, tmp_path / "r", ray_address="local", progress=False, plots=False)
    assert not (tmp_path / "r" / "sweep.csv").exists()


def test_sweep_cli(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "gpubench.cli", "sweep", "--policies", "fcfs,continuum", "--skus", "h100-sxm",
           "--jps", "0.5", "2", "--jobs", "3", "--workers", "1", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    frame = load_table(out)
    assert len(frame) == 4 and set(frame["policy"]) == {"fcfs", "continuum"}
    assert (out / "jct_vs_jps.png").is_file() and (out / "tables.md").is_file()
    command = (out / "COMMAND").read_text()
    assert command.startswith("gpubench sweep") and "--jobs 3" in command
    assert json.loads((out / "spec.json").read_text())["num_jobs"] == 3
    bad = subprocess.run([sys.executable, "-m", "gpubench.cli", "sweep", "--skus", "h1000", "--out", str(out)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "h1000" in bad.stderr


def test_plots_only_redraws_from_table(tmp_path):
    out = tmp_path / "p"
    run_sweep(SweepSpec(policies=("fcfs",), skus=("h100-sxm",), jps=(1.0, 3.0), num_jobs=2), out, workers=1,
              progress=False, plots=False)
    assert not (out / "jct_vs_jps.png").exists()
    proc = subprocess.run([sys.executable, "-m", "gpubench.cli", "sweep", "--plots-only", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "jct_vs_jps.png").stat().st_size > 10_000
    table = (out / "tables.md").read_text()
    frame = load_table(out)
    for v in frame["jct_mean_s"]:
        assert f"{v:.0f}" in table


def test_policy_variants_carry_their_own_parameters():
    from common.errors import ConfigError
    from scheduling.experiments.sweep import SweepCell, SweepSpec, replay_config, split_policy_label

    assert split_policy_label("cpu-offload@cpu_gib=128+store=lazy") == ("cpu-offload", {"cpu_gib": 128, "store": "lazy"})
    assert split_policy_label("fcfs") == ("fcfs", {})
    spec = SweepSpec(policies=("cpu-offload", "cpu-offload@cpu_gib=128"), skus=("a100-40",), jps=(1.0,),
                     policy_params={"cpu-offload": {"link_efficiency": 0.5}})
    spec.validate()
    base, big = (replay_config(spec, SweepCell(p, "a100-40", 1.0, 0)) for p in spec.policies)
    assert base.policy == big.policy == "cpu-offload"
    assert base.policy_params == {"link_efficiency": 0.5}
    assert big.policy_params == {"link_efficiency": 0.5, "cpu_gib": 128}  # the base's --set, then the variant's
    for bad in ("cpu-offload@pool=16", "cpu-offload@cpu_gib", "teleport@x=1"):
        with pytest.raises(ConfigError):
            SweepSpec(policies=(bad,), skus=("a100-40",), jps=(1.0,)).validate()


def test_sweep_json_stdout_is_only_json_with_the_progress_bar_on(tmp_path):
    """The progress bar once went to stdout, ahead of --json's records ("sweep ━━━ 1/1 ..." then the
    JSON): now it goes to stderr and stdout parses as JSON."""
    cmd = [sys.executable, "-m", "gpubench.cli", "sweep", "--policies", "fcfs", "--skus", "h100-sxm", "--jps", "1",
           "--jobs", "2", "--workers", "1", "--no-plots", "--json", "--out", str(tmp_path / "j")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert [r["key"] for r in rows] == ["fcfs|h100-sxm|1|0"]
    assert "━" not in proc.stdout and "sweep" not in proc.stdout.split("[", 1)[0]
    assert "sweep" in proc.stderr and "1/1" in proc.stderr  # the bar was on, on stderr
