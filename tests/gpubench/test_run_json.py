"""`gpubench run --json`: one JSON object on stdout at the end, the progress on stderr."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpubench.results import load

from .conftest import only_run_dir, run_cli

STREAM_TINY = ["--set", "stream.min_array_bytes=131072", "--set", "stream.max_array_bytes=524288"]


def test_run_json_is_the_whole_stdout_and_matches_the_run(tmp_path):
    res = run_cli("run", "--device", "cpu", "--probes", "stream", "--json", "--out", str(tmp_path), *STREAM_TINY)
    assert res.returncode == 0, res.stderr[-2000:]
    # strict JSON: NaN or Infinity would reach parse_constant
    doc = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in run --json"))
    run_dir = only_run_dir(tmp_path)
    assert Path(doc["run_dir"]) == run_dir and doc["ok"] is True
    assert "run dir:" in res.stderr  # progress and the run directory line go to stderr
    manifest = load(run_dir).manifest
    assert [p["name"] for p in doc["probes"]] == ["stream"]
    (probe,) = doc["probes"]
    assert probe["status"] == manifest["probes"]["stream"]["status"] == "done"
    assert probe["num_rows"] == len(load(run_dir)["stream"]) > 0
    show = json.loads(run_cli("show", str(run_dir), "--json").stdout)
    assert [h["key"] for h in doc["summary"]["headlines"]] == [h["key"] for h in show["headlines"]]
    assert {h["probe"] for h in doc["summary"]["headlines"]} == {"stream"}


def test_run_json_reports_a_failed_probe_and_exits_1(tmp_path):
    res = run_cli("run", "--device", "cpu", "--probes", "stream,debug_error", "--json", "--out", str(tmp_path),
                  *STREAM_TINY)
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    status = {p["name"]: (p["status"], p["reason"]) for p in doc["probes"]}
    assert doc["ok"] is False and status["stream"][0] == "done"
    assert status["debug_error"][0] == "failed" and "debug_error" in status["debug_error"][1]



def test_run_without_out_writes_under_gpubench_results_in_the_working_directory(tmp_path):
    # a user's run from a checkout must not land among its committed results/
    res = run_cli("run", "--device", "cpu", "--probes", "stream", "--json", *STREAM_TINY, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    run_dir = Path(json.loads(res.stdout)["run_dir"])
    assert not run_dir.is_absolute() or tmp_path in run_dir.parents
    assert only_run_dir(tmp_path / "gpubench-results").resolve() == (tmp_path / run_dir).resolve()
    assert not (tmp_path / "results").exists()
