"""Malformed options and files across the sub-commands: each is exactly one line on stderr, exit 2,
no traceback, no hang, and nothing written where the output was to go."""
import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "bin.jsonl").write_bytes(b"\xff\xfe\x00\x01binary")
    (d / "bad.json").write_text("not json")
    (d / "list.json").write_text("[1, 2]")
    (d / "badtrace.jsonl").write_text(json.dumps({"job_id": "a", "system_tokens": -1, "turns": []}) + "\n")
    (d / "rundir").mkdir()
    (d / "rundir" / "manifest.json").write_text(json.dumps({"schema_version": "1", "probes": [], "sku": "cpu"}))
    (d / "rundir2").mkdir()
    (d / "rundir2" / "manifest.json").write_text(json.dumps({"schema_version": 1, "probes": [], "sku": "cpu"}))
    (d / "afile").write_text("x")
    return d


CASES = [
    "predict --batch 0", "predict --context nan", "predict --sku h100 --batch 10000000000",
    "predict --calibration {d}/bad.json", "predict --calibration {d}/list.json", "predict --calibration {d}/bin.jsonl",
    "predict --model {d}/bin.jsonl", "predict --sku h100 --calibration {d}/nothere.json",
    "replay --trace {d}/bin.jsonl --out {d}/o", "replay --trace {d}/badtrace.jsonl --out {d}/o",
    "replay --jobs 2 --jps nan --out {d}/o", "replay --jobs 2 --jps 1 --max-num-batched-tokens 0 --out {d}/o",
    "replay --jobs 2 --jps 1 --gpu-memory-utilization nan --out {d}/o",
    "replay --jobs 2 --jps 1 --activation-reserve-gib -5 --out {d}/o",
    "replay --jobs 2 --jps 1 --out {d}/afile", "replay --jobs 2 --jps 1 --policy continuum --ttl-s nan --out {d}/o",
    "replay --jobs 2 --jps 1 --policy lmcache --lmcache-chunk-tokens 0 --out {d}/o",
    "replay --jobs 2 --jps 1 --policy cpu-offload --cpu-gib -1 --out {d}/o",
    "replay --jobs 2 --jps 1 --policy fcfs --cpu-gib 8 --out {d}/o",
    "show {d}/rundir", "show {d}/rundir2", "fit {d}/rundir", "fit {d}/nothere", "show {d}/bin.jsonl",
    "sweep --jps nan --out {d}/o", "sweep --jobs 0 --out {d}/o", "sweep --workers 0 --out {d}/o",
    "sweep --skus h999 --out {d}/o", "sweep --model llama-9000 --out {d}/o", "sweep --policies fcfs@ttl_s=1 --out {d}/o",
    "sweep --set max_num_seqz=3 --out {d}/o", "sweep --jps x --out {d}/o",
    "trace stats {d}/bin.jsonl", "trace stats --jobs -1", "trace swesmith --jobs 5 --out {d}/x.txt",
    "trace swesmith --jobs 0 --out {d}/x.parquet",
    "evaluate {d}/bin.jsonl --out {d}/o", "run --device cpu --probes nope --out {d}/o",
    "run --device cpu --probe-budget-s nan --out {d}/o", "run --device cpu --repeats 1 --out {d}/o",
    "compare-replay {d} {d} --out {d}/o", "view {d}/rundir --export {d}/v.html",
    "kvcomm eval --n 0 --out {d}/o", "profile --model nope --out {d}/p.parquet", "skus --nope",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2(bad, case):
    argv = [a.format(d=bad) for a in case.split()]
    before = sorted(p.name for p in bad.iterdir())
    p = subprocess.run([sys.executable, "-m", "gpubench", *argv], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, (case, p.stderr[-500:])
    assert "Traceback" not in p.stderr and len(lines) == 1, (case, p.stderr[-800:])
    assert "error" in lines[0]
    after = sorted(p.name for p in bad.iterdir())
    assert after == before or set(after) - set(before) <= {"o"} and not any((bad / "o").iterdir()), (case, after)


def test_a_run_measured_twice_is_refused_on_read(tmp_path):
    """Two writers on one run used to double every row, and show/fit averaged over both."""
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "results/eval/cpu/probes/cpu/20261201T112057Z-vm"
    run = tmp_path / "run"
    shutil.copytree(src, run)
    lines = (run / "stream.jsonl").read_text().splitlines()
    (run / "stream.jsonl").write_text("\n".join(lines + lines[:1]) + "\n")
    p = subprocess.run([sys.executable, "-m", "gpubench", "show", str(run)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "duplicates line 1" in p.stderr and "Traceback" not in p.stderr


def test_compare_matches_two_machines_by_what_was_measured_and_warns(tmp_path):
    """Two committed CPU runs of two different machines (AMD EPYC 32 MiB L3, Intel Xeon 300 MiB L3):
    their STREAM keys share no byte size, but the figures match at the same multiple of each LLC."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "results/eval/cpu/probes/cpu"
    amd, intel = root / "20261129T171339Z-vm", root / "20261201T112057Z-vm"
    p = subprocess.run([sys.executable, "-m", "gpubench", "compare", str(amd), str(intel), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    a, b = (r["device"] for r in out["runs"])
    assert a["name"].startswith("AMD") and b["name"].startswith("Intel") and out["same_device"] is False
    assert a["caches"]["L3"] == 32 * 2**20 and b["caches"]["L3"] == 300 * 2**20 and a["cores"] == b["cores"] == 2
    assert "2 different devices" in p.stderr and "L3 32 MiB" in p.stderr and "L3 300 MiB" in p.stderr
    triad = {f["label"]: f for f in out["figures"] if f["probe"] == "stream"}["STREAM triad fp64 at 4x LLC"]
    assert all(v > 0 for v in triad["values"])
    gate = subprocess.run([sys.executable, "-m", "gpubench", "compare", str(amd), str(intel), "--fail-above", "5"],
                          capture_output=True, text=True, timeout=60)
    assert gate.returncode == 1 and "FAIL:" in gate.stdout
    # the same measurements with another host name and a later stamp: the same device, no warning
    copy = tmp_path / "20261202T000000Z-other"
    shutil.copytree(intel, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["host"] = "other"
    (copy / "manifest.json").write_text(json.dumps(m))
    same = subprocess.run([sys.executable, "-m", "gpubench", "compare", str(intel), str(copy), "--fail-above", "0"],
                          capture_output=True, text=True, timeout=60)
    assert same.returncode == 0 and "warning" not in same.stderr and "host other" in same.stdout
    for bad in (["compare", str(intel)], ["compare", str(intel), str(copy), "--fail-above", "-1"]):
        r = subprocess.run([sys.executable, "-m", "gpubench", *bad], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
