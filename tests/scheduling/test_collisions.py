"""Two commands on one output directory, and error cells on resume: nothing lost or doubled."""
import subprocess
import sys

import pandas as pd
import pytest

from common.errors import ConfigError
from common.outdir import locked, write_bytes_atomic, write_text_atomic


def cli(*args):
    return subprocess.run([sys.executable, "-m", "gpubench", *args], capture_output=True, text=True, timeout=300)


def test_a_second_sweep_on_a_locked_directory_is_refused_with_the_holder(tmp_path):
    out = tmp_path / "sweep"
    with locked(out, "sweep directory"):
        p = cli("sweep", "--policies", "fcfs", "--skus", "h100", "--jps", "1", "--jobs", "2", "--out", str(out), "--no-progress")
        assert p.returncode == 2 and "in use by PID" in p.stderr and "Traceback" not in p.stderr
        q = cli("replay", "--jobs", "2", "--jps", "1", "--out", str(out), "--no-progress")
        assert q.returncode == 2 and "in use by PID" in q.stderr
    assert not (out / "sweep.csv").exists()
    p = cli("sweep", "--policies", "fcfs", "--skus", "h100", "--jps", "1", "--jobs", "2", "--out", str(out), "--no-progress")
    assert p.returncode == 0, p.stderr  # the lock went with its holder


def test_error_cells_are_rerun_on_resume_and_replaced_not_doubled(tmp_path):
    out = tmp_path / "sweep"
    args = ("sweep", "--policies", "fcfs", "--skus", "a100-40,h100", "--jps", "1", "--jobs", "2",
            "--model", "llama-3.1-70b", "--out", str(out), "--no-progress", "--no-plots")
    assert cli(*args).returncode == 0
    first = pd.read_csv(out / "sweep.csv", keep_default_na=False)
    assert len(first) == 2 and (first["error"] != "").all()  # 70B bf16 fits neither card
    assert cli(*args).returncode == 0  # resumed: the error cells run again
    again = pd.read_csv(out / "sweep.csv", keep_default_na=False)
    assert len(again) == 2 and sorted(again["key"]) == sorted(first["key"])


def test_duplicate_cells_in_a_table_are_refused(tmp_path):
    out = tmp_path / "sweep"
    args = ("sweep", "--policies", "fcfs", "--skus", "h100", "--jps", "1", "--jobs", "2", "--out", str(out),
            "--no-progress", "--no-plots")
    assert cli(*args).returncode == 0
    lines = (out / "sweep.csv").read_text().splitlines()
    (out / "sweep.csv").write_text("\n".join(lines + lines[1:]) + "\n")  # what two writers used to leave
    p = cli(*args)
    assert p.returncode == 2 and "appears more than once" in p.stderr


def test_atomic_write_leaves_no_partial_file(tmp_path):
    path = tmp_path / "a.json"
    write_text_atomic(path, "old")
    with pytest.raises(TypeError):
        write_text_atomic(path, None)  # refused before anything is written
    with pytest.raises(TypeError):
        write_bytes_atomic(path, None)  # fails while writing the temporary file
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    with locked(tmp_path / "d"):
        with pytest.raises(ConfigError, match="in use by PID"):
            with locked(tmp_path / "d"):
                pass


def test_a_killed_sweep_leaves_no_worker_running(tmp_path):
    import os
    import signal
    import time
    from pathlib import Path

    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "gpubench", "sweep", "--policies", "fcfs,continuum", "--skus",
                             "a100-40,h100,l40s", "--jps", "3,10", "--jobs", "200", "--workers", "2", "--out", str(out),
                             "--no-progress", "--no-plots"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def children():
        found = set()
        for task in Path(f"/proc/{proc.pid}/task").glob("*"):
            try:
                found |= {int(p) for p in (task / "children").read_text().split()}
            except OSError:
                pass
        return found

    deadline = time.time() + 60
    workers = set()
    while time.time() < deadline and len(workers) < 2:
        workers |= children()
        time.sleep(0.2)
    assert len(workers) >= 2, "the sweep did not start its workers"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.time() + 10
    alive = workers
    while alive and time.time() < deadline:
        alive = {p for p in alive if Path(f"/proc/{p}").exists() and "Z" not in
                 Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[:1]}
        time.sleep(0.2)
    assert not alive, f"workers {sorted(alive)} outlived the killed sweep"


def test_replay_and_sweep_print_json_when_asked(tmp_path):
    import json

    p = cli("replay", "--jobs", "2", "--jps", "1", "--out", str(tmp_path / "r"), "--no-progress", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["metrics"]["num_jobs"] == 2
    q = cli("sweep", "--policies", "fcfs", "--skus", "h100", "--jps", "1", "--jobs", "2", "--out", str(tmp_path / "s"),
            "--no-progress", "--no-plots", "--json")
    rows = json.loads(q.stdout)
    assert q.returncode == 0 and len(rows) == 1 and rows[0]["policy"] == "fcfs" and rows[0]["error"] == ""


def test_fresh_regenerates_instead_of_resuming(tmp_path):
    out = tmp_path / "sweep"
    args = ("sweep", "--policies", "fcfs", "--skus", "h100", "--jps", "1", "--jobs", "2", "--out", str(out),
            "--no-progress", "--no-plots")
    assert cli(*args).returncode == 0
    lines = (out / "sweep.csv").read_text().splitlines()
    (out / "sweep.csv").write_text("\n".join(lines + lines[1:]) + "\n")  # a table a resume would refuse
    p = cli(*args, "--fresh")
    assert p.returncode == 0, p.stderr
    assert len(pd.read_csv(out / "sweep.csv")) == 1


def test_rerunning_a_command_keeps_the_notes_of_its_command_file(tmp_path):
    from common.outdir import write_command

    (tmp_path / "COMMAND").write_text("gpubench sweep --out x\n# taken at load 0.4\n")
    write_command(tmp_path, "gpubench sweep --out x")
    assert (tmp_path / "COMMAND").read_text().endswith("# taken at load 0.4\n")
    write_command(tmp_path, "gpubench sweep --out x --jobs 5")
    assert (tmp_path / "COMMAND").read_text() == "gpubench sweep --out x --jobs 5\n"
