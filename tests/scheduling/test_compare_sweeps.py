"""scripts/compare_sweeps.py: the check that a grid on Ray gave the local pool's rows, on real sweeps."""
import subprocess
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from compare_sweeps import compare  # noqa: E402


def _sweep(out: Path, workers: str) -> None:
    done = subprocess.run([sys.executable, "-m", "gpubench", "sweep", "--policies", "fcfs@replicas=2+router=load-aware",
                           "fcfs@replicas=2+prefill_replicas=1+router=session", "--skus", "h100-sxm", "--jps", "4",
                           "--jobs", "8", "--workers", workers, "--no-plots", "--no-progress", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_two_runs_of_a_grid_give_the_same_rows_and_a_changed_or_doubled_row_is_found(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _sweep(a, "1")
    _sweep(b, "2")
    same = compare(a, b)
    assert same["same_rows"] and same["rows_a"] == 2 and same["columns_compared"] > 50
    table = pd.read_csv(b / "sweep.csv")
    table.loc[0, "ttft_p50_s"] = table.loc[0, "ttft_p50_s"] + 1e-6
    table.to_csv(b / "sweep.csv", index=False)
    changed = compare(a, b)
    assert not changed["same_rows"] and changed["differences"][0]["column"] == "ttft_p50_s"
    pd.concat([table, table.iloc[:1]]).to_csv(b / "sweep.csv", index=False)
    doubled = compare(a, b)
    assert not doubled["same_rows"] and doubled["duplicate_keys_b"] == 1
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_sweeps.py"), str(a), str(b)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "DIFFERENT" in out.stdout
