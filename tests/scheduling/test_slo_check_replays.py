"""``gpubench slo check --replays``: takes of one setting grouped, the model beside their range, bad
input refused in one line, and the committed live-vLLM check regenerating from its committed takes."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.gpubench.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = str(ROOT / "results" / "vllm-cpu" / "calibration-cpu.json")
CPU = ["--sku", "cpu", "--model", "smollm2-135m", "--no-cuda-graphs", "--block-size", "128",
       "--max-num-batched-tokens", "4096", "--calibration", CALIBRATION]
JOBS = ["--jobs", "6", "--preset", "scaled-cpu", "--seed", "3", "--num-gpu-blocks", "24", "--no-progress",
        "--slo", "ttft=3,tpot=0.2"]


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    root = tmp_path_factory.mktemp("replays")
    for name, jps in (("a", "0.5"), ("b", "0.5"), ("c", "2")):
        proc = run_cli("replay", *JOBS, "--jps", jps, *CPU, "--out", str(root / name))
        assert proc.returncode == 0, proc.stderr[-2000:]
    return root


def test_takes_are_grouped_and_the_model_stands_beside_them(replays, tmp_path):
    out = tmp_path / "check"
    proc = run_cli("slo", "check", "--replays", *(str(replays / n) for n in "abc"), "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["settings"] == 2
    for name in ("check.csv", "curve.csv", "check.md", "attainment_vs_jps.png", "COMMAND"):
        assert (out / name).is_file(), name
    rows = pd.read_csv(out / "check.csv")
    assert list(rows["jps"]) == [0.5, 2.0] and list(rows["takes"]) == [2, 1]
    # The simulator repeats itself: two takes of one command have one attainment.
    assert (rows["turn_min"] == rows["turn_max"]).all()
    # Each replay is scored again from its tables with the SLO it recorded: the same figure its summary has.
    summary = json.loads((replays / "c" / "summary.json").read_text())["metrics"]["slo_attainment"]
    assert rows.loc[1, "turn_mean"] == pytest.approx(summary["turn"])
    assert rows.loc[1, "job_mean"] == pytest.approx(summary["job"])
    assert rows["turn_model"].between(0, 1).all() and rows["job_model"].between(0, 1).all()
    # More load, less attainment, in the replays and in the model.
    assert rows.loc[1, "turn_mean"] <= rows.loc[0, "turn_mean"]
    assert rows.loc[1, "turn_model"] <= rows.loc[0, "turn_model"]
    curve = pd.read_csv(out / "curve.csv")
    assert curve["jps"].min() == pytest.approx(0.25) and curve["jps"].max() == pytest.approx(4.0)
    assert curve.sort_values("jps")["turn_model"].is_monotonic_decreasing
    text = (out / "check.md").read_text()
    assert "ttft <= 3 s, tpot <= 0.2 s" in text


def test_a_new_slo_rescores_the_takes(replays, tmp_path):
    out = tmp_path / "loose"
    proc = run_cli("slo", "check", "--replays", str(replays / "c"), "--slo", "ttft=1000,tpot=1000,tool_turn=none",
                   "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout)["rows"][0]
    assert row["turn_mean"] == 1.0 and row["turn_model"] == pytest.approx(1.0)


@pytest.mark.parametrize("extra, message", [
    (["--replays", "{tmp}"], "not a replay directory"),
    (["--replays", "{a}", "--sweep", "{tmp}"], "not allowed with argument"),
    (["--sweep", "{tmp}", "--sku", "cpu"], "go with --replays"),
    (["--replays", "{a}", "--slo", "ttft=fast"], "not a number of seconds"),
    (["--replays", "{a}", "{a}"], "given twice"),
])
def test_bad_input_is_one_line(replays, tmp_path, extra, message):
    args = [a.format(tmp=tmp_path, a=replays / "a") for a in extra]
    proc = run_cli("slo", "check", *args, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_live_replay_needs_the_sku_its_steps_are_priced_on(tmp_path):
    live = ROOT / "results" / "slo" / "live-fcfs" / "jps-1-take-1"
    proc = run_cli("slo", "check", "--replays", str(live), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "give --sku" in proc.stderr


def test_committed_live_check_regenerates():
    """The model's side of results/slo/check-live (deterministic given the committed takes) comes back."""
    from scheduling.cli import load_jobs
    from scheduling.slo import parse_slo
    from scheduling.slo.check_replays import group_takes, limits_and_cost, parse_replay_command
    from scheduling.slo.model import predict

    committed = pd.read_csv(ROOT / "results" / "slo" / "check-live" / "check.csv")
    command = (ROOT / "results" / "slo" / "check-live" / "COMMAND").read_text().splitlines()[0]
    slo = parse_slo(command.split("--slo ")[1].split()[0])
    calibration = str(ROOT / command.split("--calibration ")[1].split()[0])
    row = committed[(committed["engine"] == "vllm") & (committed["jps"] == 1.0)].iloc[0]
    assert row["takes"] == 2
    setting = group_takes([str(ROOT / d) for d in row["dirs"].split()])[0]
    args = parse_replay_command(setting.command)
    lim, cost = limits_and_cost(setting.takes[0], "cpu", calibration)
    pred = predict(load_jobs(args), lim, cost, slo)
    assert pred.attainment["turn"] == pytest.approx(row["turn_model"], rel=1e-5, abs=1e-9)
    assert pred.percentiles["jct_mean_s"] == pytest.approx(row["jct_mean_s_model"], rel=1e-5)


def test_a_replay_under_another_policy_is_refused(tmp_path):
    out = tmp_path / "sjf"
    proc = run_cli("replay", *JOBS, "--jps", "1", *CPU, "--policy", "sjf", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    bad = run_cli("slo", "check", "--replays", str(out), "--out", str(tmp_path / "check"))
    assert bad.returncode == 2 and "the model prices fcfs" in bad.stderr and not (tmp_path / "check").exists()
