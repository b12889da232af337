"""scripts/bench_compare.sh on stored pytest-benchmark JSON files (no timing run): it fails past
the threshold, passes within it, warns when the machines differ, and refuses bad input in one line."""
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_compare.sh"
BASELINE = REPO / "results" / "predictor" / "bench.json"  # committed: the predictor bench's figures
SLOWED = "benchmarks/test_predictor_bench.py::test_predict_time_single_batch"
TIME_FIELDS = ("min", "max", "mean", "stddev", "median", "iqr", "q1", "q3", "ld15iqr", "hd15iqr", "total")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


def stored_run(tmp_path, factor: float, name: str = "current.json", cpu: str | None = None) -> Path:
    """The committed baseline with SLOWED's times multiplied by ``factor`` (the other benchmarks
    unchanged), as a later run would store it."""
    doc = json.loads(BASELINE.read_text())
    doc = copy.deepcopy(doc)
    for bench in doc["benchmarks"]:
        if bench["fullname"] == SLOWED:
            for field in TIME_FIELDS:
                bench["stats"][field] *= factor
            bench["stats"]["ops"] /= factor
    if cpu is not None:
        doc["machine_info"]["cpu"]["brand_raw"] = cpu
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def compare(*args, baselines=None):
    env = {**os.environ, "PYTHON": sys.executable}
    if baselines is not None:
        env["BENCH_BASELINES"] = " ".join(map(str, baselines))
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def test_a_mean_past_the_threshold_fails_and_one_within_it_passes(tmp_path):
    current = stored_run(tmp_path, 1.25)  # 25 % slower
    over = compare(10, current)
    assert over.returncode == 1, over.stderr
    assert "1 regression(s)" in over.stderr and SLOWED in over.stderr and "PercentageRegressionCheck" in over.stderr
    assert "REGRESSION" in over.stdout and "+25.0%" in over.stdout
    within = compare(30, current)
    assert within.returncode == 0, within.stderr
    assert "4 benchmark(s) within mean:30% of the baseline" in within.stdout
    assert "warning" not in within.stderr  # same machine: no warning


def test_a_faster_run_passes_even_at_zero_percent(tmp_path):
    assert compare(0, stored_run(tmp_path, 0.5)).returncode == 0


def test_another_machine_is_named_in_a_warning(tmp_path):
    proc = compare(10, stored_run(tmp_path, 1.0, cpu="Some Other CPU"), baselines=[BASELINE])
    assert proc.returncode == 0
    assert "warning: the baseline was timed on Intel(R) Xeon(R) Processor" in proc.stderr
    assert "for 4 of 4 benchmark(s)" in proc.stderr and "Some Other CPU" in proc.stderr


@pytest.mark.parametrize("order", ["same-machine-last", "same-machine-first"])
def test_the_baseline_from_the_runs_own_machine_is_the_one_judged(tmp_path, order):
    """Two baselines of the same benchmarks: the slower machine's own one is used for its run, in
    either order; against the other machine's it would be a regression."""
    slower_machine = stored_run(tmp_path, 2.0, name="slower-machine.json", cpu="Slower CPU")
    current = stored_run(tmp_path, 2.2, cpu="Slower CPU")  # 10 % slower than its own machine's baseline
    baselines = [BASELINE, slower_machine] if order == "same-machine-last" else [slower_machine, BASELINE]
    within = compare(15, current, baselines=baselines)
    assert within.returncode == 0, within.stderr
    assert "warning" not in within.stderr and "+10.0%" in within.stdout
    over = compare(5, current, baselines=baselines)
    assert over.returncode == 1 and "1 regression(s)" in over.stderr and SLOWED in over.stderr
    against_other = compare(15, current, baselines=[BASELINE])
    assert against_other.returncode == 1 and "+120.0%" in against_other.stdout


def test_a_machine_baseline_covering_only_some_benchmarks_warns_for_the_rest(tmp_path):
    doc = json.loads(BASELINE.read_text())
    doc["machine_info"]["cpu"]["brand_raw"] = "Partial CPU"
    doc["benchmarks"] = [b for b in doc["benchmarks"] if b["fullname"] == SLOWED]
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(doc))
    proc = compare(50, stored_run(tmp_path, 1.0, cpu="Partial CPU"), baselines=[BASELINE, partial])
    assert proc.returncode == 0, proc.stderr
    assert "for 3 of 4 benchmark(s)" in proc.stderr and "Intel(R) Xeon(R) Processor" in proc.stderr


@pytest.mark.exclusive  # it times benchmarks with speed floors, which a neighbour's load can break
def test_bench_baseline_keeps_the_median_take_whole(tmp_path):
    """scripts/bench_baseline.sh times the files TAKES times and writes the median take, unmixed.
    The CPU op-table benchmark is left out (BENCH_SELECT): it runs at 1.0-1.9x its 20,000/s floor on
    the 2-vCPU Zen 3 VM depending on the machine's phase, and this test checks the takes, not the floor."""
    out = tmp_path / "machine.json"
    env = {**os.environ, "PYTHON": sys.executable, "BENCH_FILES": "benchmarks/test_predictor_bench.py",
           "BENCH_SELECT": "not cpu_op_tables"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "bench_baseline.sh"), str(out), "3"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert {b["fullname"].split("::")[0] for b in doc["benchmarks"]} == {"benchmarks/test_predictor_bench.py"}
    assert len(doc["benchmarks"]) == 3 and not any("cpu_op_tables" in b["name"] for b in doc["benchmarks"])
    line = next(x for x in proc.stderr.splitlines() if "kept the median take" in x)
    takes = [float(v) for v in line.split("means ")[1].split(";")[0].replace(" ms", "").split(", ")]
    kept = float(line.split("median take (")[1].split(" ms")[0])
    assert len(takes) == 3 and takes == sorted(takes) and kept == takes[1]
    means = [b["stats"]["mean"] for b in doc["benchmarks"]]
    geomean_ms = 1e3 * float(np.exp(np.mean(np.log(means))))
    assert geomean_ms == pytest.approx(kept, abs=1e-3)  # the file is that take, not a mix
    assert compare(1000, out, baselines=[out]).returncode == 0  # and bench_compare reads it


@pytest.mark.parametrize("args", [[], ["x.json", "0"], ["/nonexistent-dir/x.json"], ["a", "b", "c"]])
def test_bench_baseline_bad_input_is_one_line_exit_2(args):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "bench_baseline.sh"), *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_every_committed_baseline_is_a_pytest_benchmark_file():
    """The script's default baselines exist and name benchmark files that exist."""
    proc = subprocess.run(["bash", "-c", f"grep -o 'results/[a-z/_]*bench.json' {SCRIPT} | sort -u"],
                          capture_output=True, text=True, check=True)
    baselines = proc.stdout.split()
    assert len(baselines) == 3
    figure_benchmarks = set()
    for path in baselines:
        doc = json.loads((REPO / path).read_text())
        assert doc["benchmarks"]
        for bench in doc["benchmarks"]:
            assert (REPO / bench["fullname"].split("::")[0]).is_file(), bench["fullname"]
            figure_benchmarks.add(bench["fullname"])
    machine_files = sorted((REPO / "results" / "bench-baselines").glob("*.json"))
    assert machine_files  # at least the AMD host's
    for path in machine_files:  # each machine's baseline covers every benchmark the figures do
        names = {b["fullname"] for b in json.loads(path.read_text())["benchmarks"]}
        assert figure_benchmarks <= names, (path.name, sorted(figure_benchmarks - names))


@pytest.mark.parametrize("case", ["pct-not-a-number", "not-json", "missing-current", "missing-baseline",
                                  "no-common-benchmark"])
def test_bad_input_is_one_line_exit_2(tmp_path, case):
    current = stored_run(tmp_path, 1.0)
    baselines = None
    if case == "pct-not-a-number":
        args = ["ten", current]
    elif case == "not-json":
        (tmp_path / "bad.json").write_text("{not json")
        args = [10, tmp_path / "bad.json"]
    elif case == "missing-current":
        args = [10, tmp_path / "nothere.json"]
    elif case == "missing-baseline":
        args, baselines = [10, current], [tmp_path / "nothere.json"]
    else:
        args, baselines = [10, current], [REPO / "results" / "scheduling" / "bench" / "bench.json"]
    proc = compare(*args, baselines=baselines)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
