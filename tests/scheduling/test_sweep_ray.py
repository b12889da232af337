"""Sweeps on a real Ray cluster: a head started with `ray start --head` on this machine, the sweep
connecting to its address as a user's would. Grids over replicas x routers x P:D x rates give the rows
the local process pool gives; a worker killed in the middle of a cell has that cell run again, once."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from scheduling.experiments.sweep import SweepSpec, run_sweep

RAY = str(Path(sys.executable).with_name("ray"))
CLUSTER_LABELS = ("fcfs@replicas=2+router=round-robin", "fcfs@replicas=2+router=load-aware",
                  "fcfs@replicas=1+prefill_replicas=1+router=load-aware")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on 127.0.0.1 with the two cores, no dashboard; stopped afterwards. Token auth is off
    for the head and for this process's client alike: a local `ray.init()` (`sweep --ray local`) leaves
    a token in ~/.ray/auth_token, and a head started after it would not take this client otherwise."""
    port = _free_port()
    saved_auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    start = subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
                            "--include-dashboard", "false", "--disable-usage-stats",
                            "--temp-dir", str(tmp_path_factory.mktemp("ray"))],
                           capture_output=True, text=True, timeout=120, env=env)
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=env)
        if saved_auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved_auth


def _outcomes(frame: pd.DataFrame) -> pd.DataFrame:
    drop = [c for c in frame.columns if c in ("wall_s", "cpu_s", "sim_wall_s", "steps_per_wall_s")]
    return frame.drop(columns=drop).sort_values("key").reset_index(drop=True)


def test_a_cluster_grid_on_ray_gives_the_local_pool_s_rows(ray_head, tmp_path):
    spec = SweepSpec(policies=CLUSTER_LABELS, skus=("l40s",), jps=(1.0, 3.0), seeds=(0,), num_jobs=8)
    on_ray = run_sweep(spec, tmp_path / "ray", ray_address=ray_head, progress=False, plots=False)
    local = run_sweep(spec, tmp_path / "pool", workers=2, progress=False, plots=False)
    assert len(on_ray) == 6 and (on_ray["error"].fillna("") == "").all()
    pd.testing.assert_frame_equal(_outcomes(on_ray), _outcomes(local))


def _kill_a_running_cell(deadline_s: float, killed: list) -> None:
    """SIGKILL the first Ray worker seen running a cell (Ray titles it ``ray::run_cell``)."""
    import psutil

    while time.monotonic() < deadline_s and not killed:
        for p in psutil.process_iter(["pid", "cmdline"]):
            if any("ray::run_cell" in part for part in (p.info["cmdline"] or [])):
                os.kill(p.info["pid"], signal.SIGKILL)
                killed.append(p.info["pid"])
                return
        time.sleep(0.05)


def test_a_killed_worker_s_cell_runs_again_and_is_written_once(ray_head, tmp_path):
    # cells of a second or more each, so that one is caught running
    spec = SweepSpec(policies=CLUSTER_LABELS[:2], skus=("h100-sxm",), jps=(2.0, 4.0), seeds=(0,), num_jobs=60)
    killed: list[int] = []
    killer = threading.Thread(target=_kill_a_running_cell, args=(time.monotonic() + 60, killed), daemon=True)
    killer.start()
    on_ray = run_sweep(spec, tmp_path / "ray", ray_address=ray_head, progress=False, plots=False)
    killer.join()
    assert killed, "no worker was seen running a cell"
    table = pd.read_csv(tmp_path / "ray" / "sweep.csv", dtype={"error": str}, keep_default_na=False)
    assert sorted(table["key"]) == sorted(c.key for c in spec.cells())  # every cell, none twice
    assert (table["error"] == "").all()
    serial = run_sweep(spec, tmp_path / "serial", workers=1, progress=False, plots=False)
    pd.testing.assert_frame_equal(_outcomes(on_ray), _outcomes(serial))
