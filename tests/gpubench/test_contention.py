"""`show` and `compare` say when a run was taken under contention, by the judgement `fit` refuses it
with (gpubench.contention), on committed runs of this project: one taken at load 12.5 while other
jobs held the two cores, one taken on a quiet machine."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from gpubench.contention import judge_run, run_contention
from gpubench.results import load
from tests.conftest import gpubench

ROOT = Path(__file__).resolve().parents[2]
CONTENDED = ROOT / "results/cpu/20261129T174152Z-vm"  # load 12.5 at start, 0.34 CPUs per row
QUIET = ROOT / "results/cpu/20261204T065713Z-vm"  # load 0.41, nothing else running
QUIET2 = ROOT / "results/eval/cpu/probes/cpu/20261204T154125Z-vm"


def test_show_says_the_run_was_contended_and_marks_its_figures():
    res = gpubench("show", str(CONTENDED))
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())  # the line may wrap
    assert "CONTENDED: this run was taken under contention (1-minute load up to 12.7 on 2 CPUs" in text
    assert "110 of 110 judged rows got under 80% of the CPU" in text
    marked = [ln for ln in res.stdout.splitlines() if ln.startswith("│ stream") and " !" in ln]
    assert len(marked) == 4  # copy, scale, add, triad
    quiet = gpubench("show", str(QUIET))
    assert quiet.returncode == 0 and "CONTENDED" not in quiet.stdout


def test_show_json_carries_the_judgement():
    doc = json.loads(gpubench("show", str(CONTENDED), "--json").stdout)
    c = doc["contention"]
    assert c["contended"] and c["rows_flagged"] == c["rows_judged"] == 110 and c["num_cpus"] == 2
    assert c["load_1m_max"] == pytest.approx(12.69) and c["worst_probe"] == "stream"
    assert {h["probe"] for h in doc["headlines"] if h["contended"]} == {"stream", "l2", "peak"}
    quiet = json.loads(gpubench("show", str(QUIET), "--json").stdout)
    assert quiet["contention"]["contended"] is False and quiet["contention"]["reason"] is None


def test_compare_states_each_run_and_marks_ratios_that_involve_a_contended_run(tmp_path):
    res = gpubench("compare", str(QUIET), str(CONTENDED), "--all", "--csv", str(tmp_path / "c.csv"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "- quiet (1-minute load up to 1.0 on 2 CPUs" in lines[0]
    assert "- CONTENDED: taken under contention (1-minute load up to 12.7 on 2 CPUs" in lines[1]
    assert "c: the ratio involves a run taken under contention (run 1)" in " ".join(res.stdout.split())
    ratios = [ln for ln in lines if ln.startswith("│ ") and ("GB/s" in ln or "TFLOP/s" in ln or " us " in ln)]
    assert ratios and all(ln.rstrip(" │").endswith(" c") for ln in ratios)
    rows = list(csv.DictReader((tmp_path / "c.csv").open()))
    assert {r["contended"] for r in rows if r["run_index"] == "1"} == {"True"}
    assert {r["contended"] for r in rows if r["run_index"] == "0"} == {"False"}


def test_compare_json_and_the_gate_say_which_ratios_are_contended():
    res = gpubench("compare", str(QUIET), str(CONTENDED), "--json", "--fail-above", "50")
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["any_contended"] and [r["contention"]["contended"] for r in doc["runs"]] == [False, True]
    assert all(f["contended"] == [False, True] for f in doc["figures"])
    assert doc["regressions"] and all(r["contended"] for r in doc["regressions"])
    quiet = json.loads(gpubench("compare", str(QUIET2), str(QUIET), "--json").stdout)
    assert not quiet["any_contended"] and not any(any(f["contended"]) for f in quiet["figures"])
    plain = gpubench("compare", str(QUIET2), str(QUIET), "--all")
    assert " c │" not in plain.stdout and "CONTENDED" not in plain.stdout


def test_fit_show_and_compare_share_one_judgement():
    import predictor.host_match as hm

    assert hm.run_contention is run_contention  # predictor calls gpubench's judgement, not a copy
    runs = sorted(ROOT.glob("results/cpu/2*-*")) + sorted(ROOT.glob("results/eval/cpu/probes/cpu/2*-*"))
    seen = set()
    for d in runs:
        run = load(d)
        j = judge_run(run)
        assert j.reason == hm.run_contention(run) and j.contended == (j.reason is not None)
        seen.add(j.contended)
    assert seen == {True, False}
