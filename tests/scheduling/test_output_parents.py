"""Output paths whose parent directories do not exist yet are created (README's own examples run in a
fresh directory); input paths are never created, and a path through a file is still one line, exit 2."""
from __future__ import annotations

import json

from tests.conftest import gpubench

FAST = ["--step-cost", "constant:0.01", "--no-progress"]


def test_readme_replay_example_runs_in_a_fresh_directory(tmp_path):
    # README / docs/scheduling.md, verbatim but for --no-progress
    proc = gpubench("replay", "--jobs", "20", "--jps", "1", "--policy", "continuum", "--out", "runs/c",
                    "--trace-out", "runs/c.json", "--no-progress", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs/c/summary.json").is_file()
    assert "traceEvents" in json.loads((tmp_path / "runs/c.json").read_text())


def test_file_and_directory_outputs_create_their_parents(tmp_path):
    run = "deep/a/run"
    assert gpubench("replay", "--jobs", "2", "--jps", "1", *FAST, "--out", run, "--trace-out", "deep/b/c/t.json",
                    cwd=tmp_path).returncode == 0
    assert (tmp_path / "deep/b/c/t.json").is_file()
    again = "deep/a/run-again"  # compare-replay takes two replays, not one twice
    assert gpubench("replay", "--jobs", "2", "--jps", "1", *FAST, "--out", again, cwd=tmp_path).returncode == 0
    outputs = {
        "sweep": (["sweep", "--policies", "fcfs", "--skus", "h100-sxm", "--jps", "1", "--jobs", "2", "--workers", "1",
                   "--no-progress", "--no-plots", "--out", "x/sweep"], "x/sweep/sweep.csv"),
        "compare-replay": (["compare-replay", run, again, "--out", "x/y/cmp"], "x/y/cmp/comparison.json"),
        "view --export": (["view", run, "--export", "x/z/page.html"], "x/z/page.html"),
        "trace stats --plot": (["trace", "stats", "--jobs", "3", "--plot", "x/p/q/t.png"], "x/p/q/t.png"),
        "trace swesmith --out": (["trace", "swesmith", "--jobs", "2", "--out", "x/s/t/jobs.jsonl"], "x/s/t/jobs.jsonl"),
    }
    for name, (args, written) in outputs.items():
        proc = gpubench(*args, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, (name, proc.stderr)
        assert (tmp_path / written).is_file(), name


def test_inputs_are_not_created_and_a_path_through_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = gpubench("replay", "--trace", "nothere/jobs.jsonl", "--out", "o", *FAST, cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "nothere").exists() and not (tmp_path / "o").exists()
    proc = gpubench("replay", "--jobs", "2", "--jps", "1", *FAST, "--out", "o", "--trace-out", "afile/x/t.json", cwd=tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "afile is not a directory" in err, err
    assert not (tmp_path / "o").exists()  # refused before the replay wrote anything
