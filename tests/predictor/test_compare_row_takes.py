"""scripts/compare_row_takes.py on real committed step rows: the take-to-take figures it prints."""
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
ROWS = REPO / "results" / "steps" / "cpu-llama-60m.parquet"
sys.path.insert(0, str(REPO / "scripts"))
from compare_row_takes import take_to_take  # noqa: E402


@pytest.fixture
def takes(tmp_path):
    """The committed llama-60m rows as a first take, and a second take in which every decode step
    took 1.2x and every other step took the same time."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    rows = pd.read_parquet(ROWS)
    rows.to_parquet(first / ROWS.name)
    slower = rows.copy()
    decode = slower.phase == "decode"
    slower.loc[decode, "thread_cpu_s"] *= 1.2
    slower.to_parquet(second / ROWS.name)
    return first, second, rows


def test_each_phase_reports_the_second_take_against_the_first(takes):
    first, second, rows = takes
    table = take_to_take(first, second, "thread_cpu_s").set_index("phase")
    assert set(table.index) == set(rows.phase)
    assert table.loc["decode", "n"] == (rows.phase == "decode").sum()
    assert table.loc["decode", "median"] == pytest.approx(1.2)
    assert table.loc["decode", "mean_abs_diff_pct"] == pytest.approx(20.0)
    for phase in set(rows.phase) - {"decode"}:
        assert table.loc[phase, "median"] == pytest.approx(1.0) and table.loc[phase, "mean_abs_diff_pct"] == 0


def test_unpaired_take_is_one_line_exit_2(takes, tmp_path):
    first, _, _ = takes
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_row_takes.py"), str(first), str(empty)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "to pair with" in proc.stderr
    assert "Traceback" not in proc.stderr
