"""`gpubench run` with stderr not a terminal (a CI log, `2>log`) prints one-line progress records
(probe i/n, name, elapsed), not carriage-return bars (which showed nothing there)."""
from __future__ import annotations

import io
import re
from types import SimpleNamespace

from gpubench.run_progress import BarProgress, PlainProgress, progress_for_stderr
from tests.conftest import gpubench

TINY = ["--set", "stream.min_array_bytes=131072", "--set", "stream.max_array_bytes=524288",
        "--set", "launch.max_count=100"]


def test_run_into_a_log_prints_plain_records(tmp_path):
    res = gpubench("run", "--device", "cpu", "--quick", "--probes", "stream,launch", "--out", str(tmp_path), *TINY,
                   timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "\r" not in res.stderr and "\x1b[" not in res.stderr
    lines = res.stderr.splitlines()
    assert lines[0].startswith("device: cpu") and lines[1].startswith("run dir: ")
    assert re.fullmatch(r"\[1/2\] stream: started, \d+ measurements", lines[2]), lines[2]
    assert re.fullmatch(r"\[1/2\] stream: done in \d+\.\d s, \d+ rows", lines[3]), lines[3]
    assert re.fullmatch(r"\[2/2\] launch: started, \d+ measurements", lines[4]), lines[4]
    assert re.fullmatch(r"\[2/2\] launch: done in \d+\.\d s, \d+ rows", lines[5]), lines[5]


def test_plain_records_of_progress_skips_and_failures():
    buf = io.StringIO()
    p = PlainProgress(buf, every_s=0.0)  # a record for every row
    p.on_start(SimpleNamespace(run_dir="R"), "device: cpu", ["a", "b", "c"])
    p.on_event("a", {"event": "probe_start"})
    p.on_event("a", {"event": "plan", "total": 3, "done": 1})
    p.on_event("a", {"event": "row", "valid": True})
    p.on_event("a", {"event": "row", "valid": False})
    p.on_event("a", {"event": "probe_end", "status": "failed", "reason": "1 of 2 rows failed validation",
                     "num_rows": 2, "wall_s": 1.25})
    p.on_event("b", {"event": "probe_start"})
    p.on_event("b", {"event": "probe_end", "status": "skipped", "reason": "needs torch"})
    lines = buf.getvalue().splitlines()
    assert lines[2] == "[1/3] a: started, 3 measurements (1 already on disk)"
    assert re.fullmatch(r"\[1/3\] a: 2/3 measurements, \d+\.\d s", lines[3])
    assert re.fullmatch(r"\[1/3\] a: 3/3 measurements, \d+\.\d s \(last one INVALID\)", lines[4])
    assert lines[5] == "[1/3] a: failed in 1.2 s, 2 rows - 1 of 2 rows failed validation"
    assert lines[6] == "[2/3] b: skipped - needs torch"


def test_bars_only_on_a_terminal(monkeypatch):
    import sys

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(progress_for_stderr(), PlainProgress)
    monkeypatch.setattr(sys, "stderr", Tty())
    assert isinstance(progress_for_stderr(), BarProgress)
