"""A probe that segfaults, aborts, raises or hangs fails alone; the other probes keep their rows."""
from __future__ import annotations

import json

from gpubench.results import load

from .conftest import only_run_dir, run_cli, tiny_args


def test_crashing_probes_leave_others_intact(tmp_path):
    res = run_cli("run", "--device", "cpu", "--probes", "stream,debug_crash,debug_abort,debug_error,l2",
                  "--out", str(tmp_path), *tiny_args())
    assert res.returncode == 1, res.stderr[-2000:]
    run = load(only_run_dir(tmp_path))
    probes = run.manifest["probes"]
    assert probes["stream"]["status"] == "done" and probes["l2"]["status"] == "done"
    assert probes["debug_crash"]["status"] == "failed" and "SIGSEGV" in probes["debug_crash"]["reason"]
    assert probes["debug_abort"]["status"] == "failed" and "SIGABRT" in probes["debug_abort"]["reason"]
    assert probes["debug_error"]["status"] == "failed" and "debug_error" in probes["debug_error"]["reason"]
    # rows measured before each crash are kept; the probes after it ran in full
    for name in ("debug_crash", "debug_abort", "debug_error"):
        assert list(run[name]["key"]) == [f"{name}_ok"]
    assert run["stream"]["valid"].all() and len(run["stream"]) == 4 * 3
    assert run["l2"]["valid"].all() and len(run["l2"]) > 0
    assert "SIGSEGV" in res.stdout  # the summary says what failed


def test_time_budget_overrun_is_a_failure(tmp_path):
    res = run_cli("run", "--device", "cpu", "--probes", "debug_hang", "--probe-budget-s", "4",
                  "--out", str(tmp_path), timeout=120)
    assert res.returncode == 1
    m = json.loads((only_run_dir(tmp_path) / "manifest.json").read_text())
    entry = m["probes"]["debug_hang"]
    assert entry["status"] == "failed" and "time budget of 4 s" in entry["reason"]
    assert entry["num_rows"] == 1 and entry["wall_s"] < 60


def test_validation_failure_is_reported_never_silent(tmp_path):
    res = run_cli("run", "--device", "cpu", "--probes", "stream", "--set", "stream.debug_corrupt=b",
                  "--out", str(tmp_path), *tiny_args())
    assert res.returncode == 1
    run = load(only_run_dir(tmp_path))
    assert not run["stream"]["valid"].any()
    assert run["stream"]["invalid_reason"].str.contains("STREAM validation failed").all()
    entry = run.manifest["probes"]["stream"]
    assert entry["status"] == "failed" and "failed validation" in entry["reason"]
    show = run_cli("show", str(run.run_dir), "--json")
    s = json.loads(show.stdout)
    assert not [h for h in s["headlines"] if h["probe"] == "stream"]  # no figure from invalid rows
    assert len(s["invalid"]) == len(run["stream"])
