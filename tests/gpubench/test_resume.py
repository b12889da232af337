"""A real `gpubench run` killed with SIGKILL mid-way, then resumed: no finished row lost, run completes."""
from __future__ import annotations

import json
import signal
import subprocess
import time

from gpubench.results import load

from .conftest import gpubench_exe, run_cli

SETS = ["--set", "l2.min_bytes=16384", "--set", "l2.max_bytes=4194304", "--set", "l2.factor=1.25",
        "--set", "l2.flush_bytes=4194304"]


def test_resume_after_sigkill(tmp_path):
    cmd = [*gpubench_exe(), "run", "--device", "cpu", "--probes", "l2,stream", "--out", str(tmp_path), *SETS,
           "--set", "stream.min_array_bytes=131072", "--set", "stream.max_array_bytes=262144"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    rows_file = None
    while time.monotonic() < deadline:
        found = list(tmp_path.glob("*/*/l2.jsonl"))
        if found and found[0].read_text().count("\n") >= 5:
            rows_file = found[0]
            break
        time.sleep(0.05)
    assert rows_file is not None, "the run never wrote 5 rows"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)  # the worker dies with its parent (PR_SET_PDEATHSIG)
    before = [ln for ln in rows_file.read_text().splitlines(keepends=True) if ln.endswith("\n")]
    run_dir = rows_file.parent
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["probes"]["l2"]["status"] == "running" and m["probes"]["stream"]["status"] == "pending"
    size_now = rows_file.stat().st_size
    time.sleep(0.5)
    assert rows_file.stat().st_size == size_now, "an orphan worker is still writing"

    res = run_cli("run", "--resume", str(run_dir), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    after = rows_file.read_text().splitlines(keepends=True)
    assert after[:len(before)] == before  # finished rows untouched, in place
    run = load(run_dir)
    keys = list(run["l2"]["key"])
    assert len(keys) == len(set(keys)), "a key was measured twice"
    assert len(keys) > len(before)
    modes = run["l2"]["mode"].value_counts()
    assert modes["warm"] == modes["cold"]  # the whole plan is there
    assert run.manifest["probes"]["l2"]["status"] == "done" and run.manifest["probes"]["stream"]["status"] == "done"
    assert len(run["stream"]) == 8
    assert "resuming" in res.stderr


def test_sigterm_records_the_interruption(tmp_path):
    cmd = [*gpubench_exe(), "run", "--device", "cpu", "--probes", "debug_hang", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(tmp_path.glob("*/*/debug_hang.jsonl")):
        time.sleep(0.05)
    assert list(tmp_path.glob("*/*/debug_hang.jsonl")), "no row was written"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "--resume" in err
    run_dir = next(tmp_path.glob("*/*/manifest.json")).parent
    entry = json.loads((run_dir / "manifest.json").read_text())["probes"]["debug_hang"]
    assert entry["status"] == "failed" and "interrupted" in entry["reason"]
