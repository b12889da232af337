"""scripts/stress_probes.py: every run's end is written down, a crash gets a backtrace under a
debugger, and the exit status says whether all runs were clean. The children here are stand-ins
(no GPU): one that exits cleanly and one that dies of SIGSEGV, as stream and l2 did on one H200."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stress_probes.py"


@pytest.fixture()
def stress():
    spec = importlib.util.spec_from_file_location("stress_probes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_clean_runs_are_counted_and_exit_zero(stress, tmp_path, monkeypatch):
    monkeypatch.setattr(stress, "CHILD", "print('stream+l2 ok')")
    assert stress.main(["--runs", "3", "--out", str(tmp_path / "s.txt")]) == 0
    text = (tmp_path / "s.txt").read_text().splitlines()
    assert text[0].startswith("stress: 3 of 3 runs clean") and text[1] == "run  1: clean (stream+l2 ok)"


def test_a_crash_is_named_by_its_signal_and_gets_a_backtrace(stress, tmp_path, monkeypatch):
    monkeypatch.setattr(stress, "CHILD", "import ctypes; ctypes.string_at(0)")  # a read of address 0
    assert stress.main(["--runs", "2", "--out", str(tmp_path / "s.txt")]) == 1
    text = (tmp_path / "s.txt").read_text()
    assert text.startswith("stress: 0 of 2 runs clean") and "run  1: killed by SIGSEGV" in text
    assert "Fatal Python error: Segmentation fault" in text  # the fault handler's Python side
    assert "backtrace of a crashing run (run 1 repeated under a debugger):" in text
    if shutil.which("gdb") or shutil.which("cuda-gdb"):
        assert "SIGSEGV" in text.split("repeated under a debugger):", 1)[1]


def test_bad_run_count_is_one_line_exit_2(stress, tmp_path, capsys):
    assert stress.main(["--runs", "0", "--out", str(tmp_path / "s.txt")]) == 2
    assert capsys.readouterr().err.strip() == "stress_probes: --runs must be >= 1"
