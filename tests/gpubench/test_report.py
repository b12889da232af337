"""`gpubench show` and `gpubench compare` on a real tiny run (and a copy of it with slower rows)."""
from __future__ import annotations

import json
import shutil

import pytest

from gpubench.compare import compare_runs
from gpubench.report import summarize_run
from gpubench.results import load
from vllmref import env as vllm_env

from .conftest import run_cli

# vllm_ops runs in the vLLM environment (`gpubench vllm setup`, which CI runs before the tests);
# without it the probe is skipped with that command as its reason.
VLLM_READY = vllm_env.is_ready()
HEADLINE_PROBES = {"stream", "l2", "launch", "peak", "gemm", "torch_ops"} | ({"vllm_ops"} if VLLM_READY else set())


def test_tiny_run_is_complete(tiny_run):
    run = load(tiny_run)
    probes = run.manifest["probes"]
    assert set(probes) == {"stream", "l2", "launch", "peak", "gemm", "torch_ops", "vllm_ops"}
    assert all(p["status"] == "done" for name, p in probes.items() if name != "vllm_ops")
    if VLLM_READY:
        assert probes["vllm_ops"]["status"] == "done"
    else:
        assert probes["vllm_ops"]["status"] == "skipped" and "gpubench vllm setup" in probes["vllm_ops"]["reason"]
    for probe, df in run.frames.items():
        assert df["valid"].all(), probe
        assert {"key", "probe", "backend", "timer", "times_s", "n_reps", "t_min_s", "t_median_s", "cv",
                "telemetry_samples", "clock_mhz_mean", "energy_j", "telemetry_null_reason"} <= set(df.columns)
        assert (df["telemetry_samples"] >= 2).all()
    dev = run.manifest["device"]
    assert dev["backend"] == "cpu" and dev["properties"]["llc_bytes"] > 0
    assert run.manifest["telemetry"]["source"] == "CpuTelemetry"


def test_show_headlines(tiny_run):
    s = summarize_run(load(tiny_run))
    probes = {h.probe for h in s.headlines}
    assert probes == HEADLINE_PROBES
    triad = [h for h in s.headlines if h.probe == "stream" and h.label.startswith("triad")][0]
    assert triad.unit == "GB/s" and triad.lo <= triad.median <= triad.hi == triad.value
    fp64 = [h for h in s.headlines if h.probe == "peak" and "fp64" in h.label][0]
    assert fp64.pct is not None and "lanes" in fp64.pct_of
    res = run_cli("show", str(tiny_run))
    assert res.returncode == 0
    for text in ("triad", "fork_join", "fma fp64", "telemetry", "% of spec"):
        assert text in res.stdout, text
    js = json.loads(run_cli("show", str(tiny_run), "--json").stdout)
    assert js["sku"] == "cpu" and js["probes"]["stream"]["status"] == "done"


def _slow_copy(tiny_run, dst, factor=10.0):
    """A copy of the run with every stream repetition ``factor`` x slower."""
    shutil.copytree(tiny_run, dst)
    rows = [json.loads(ln) for ln in (dst / "stream.jsonl").read_text().splitlines()]
    with open(dst / "stream.jsonl", "w") as f:
        for r in rows:
            for k in ("t_min_s", "t_p20_s", "t_median_s", "t_p80_s", "t_max_s", "t_mean_s"):
                r[k] *= factor
            r["times_s"] = [factor * t for t in r["times_s"]]
            f.write(json.dumps(r) + "\n")
    return rows


def test_compare_flags_real_changes_only(tiny_run, tmp_path):
    same = compare_runs([load(tiny_run), load(tiny_run)])
    assert same["same_device"] and same["figures"]
    assert all(f["speed_ratio"][1] == pytest.approx(1.0, abs=1e-12) and not f["flagged"][1] for f in same["figures"])
    # run 2 = the run with every stream repetition 10x slower: ratio 0.1, flagged wherever the spread is < 90 %.
    rows = _slow_copy(tiny_run, tmp_path / "slow")
    out = compare_runs([load(tiny_run), load(tiny_run), load(tmp_path / "slow")])
    stream = [f for f in out["figures"] if f["probe"] == "stream"]
    assert len(stream) == len(rows) and all(f["label"].startswith("STREAM ") and "x LLC" in f["label"] for f in stream)
    assert all(f["speed_ratio"][2] == pytest.approx(0.1) and f["regression_pct"][2] == pytest.approx(90.0) for f in stream)
    expected = sum((r["t_p80_s"] - r["t_p20_s"]) / r["t_median_s"] < 0.9 for r in rows)
    assert sum(f["flagged"][2] for f in stream) == expected > 0
    assert not any(f["flagged"][2] for f in out["figures"] if f["probe"] != "stream")
    launch = [f for f in out["figures"] if f["probe"] == "launch"]
    assert launch and all(not f["higher_is_better"] and f["unit"] == "us" for f in launch)
    res = run_cli("compare", str(tiny_run), str(tmp_path / "slow"))
    assert res.returncode == 0 and "flagged figures" in res.stdout and "STREAM triad fp64 at" in res.stdout
    assert "warning" not in res.stderr  # one machine


def test_compare_gate_json_and_csv(tiny_run, tmp_path):
    _slow_copy(tiny_run, tmp_path / "slow")
    gate = run_cli("compare", str(tiny_run), str(tiny_run), str(tmp_path / "slow"), "--fail-above", "50")
    assert gate.returncode == 1 and "FAIL:" in gate.stdout and "STREAM" in gate.stdout
    ok = run_cli("compare", str(tiny_run), str(tmp_path / "slow"), "--fail-above", "95", "--json")
    assert ok.returncode == 0, ok.stderr  # 10x slower is 90 % less GB/s: under a 95 % gate
    doc = json.loads(ok.stdout)
    assert doc["regressions"] == [] and doc["fail_above_pct"] == 95 and len(doc["runs"]) == 2
    dev = doc["runs"][0]["device"]
    assert dev["backend"] == "cpu" and dev["cores"] and "L1d" in dev["caches"] and "cores" in dev["text"]
    csv_path = tmp_path / "cmp.csv"
    res = run_cli("compare", str(tiny_run), str(tiny_run), str(tmp_path / "slow"), "--csv", str(csv_path), "--json")
    assert res.returncode == 0
    doc = json.loads(res.stdout)
    import csv

    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 3 * len(doc["figures"])
    triad = [r for r in rows if r["id"] == doc["figures"][0]["id"]]
    assert [r["run_index"] for r in triad] == ["0", "1", "2"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_show_handles_rows_with_only_schema_fields(tmp_path):
    """A run written by another backend (e.g. CUDA peak rows without the CPU's clock fields)."""
    from gpubench.results import RunWriter

    w = RunWriter.create(tmp_path, sku="h100-sxm", host="h", device={"backend": "cuda", "name": "H100"},
                         probes=["peak", "gemm"])
    common = {"valid": True, "times_s": [1e-3] * 4, "n_reps": 3, "t_min_s": 1e-3, "t_median_s": 1e-3,
              "t_p20_s": 1e-3, "t_p80_s": 1e-3, "t_max_s": 1e-3, "cv": 0.0}
    w.append("peak", {"key": "peak_mma_bf16", "dtype": "bf16", "unit": "tensor_core", "flops": 8e11,
                      "tflops_best": 800.0, "tflops_median": 800.0, "spec_tflops": 989.4, **common})
    w.append("peak", {"key": "peak_mma_fp8", "dtype": "fp8", "unit": "tensor_core", "flops": 1e12,
                      "tflops_best": 1000.0, "tflops_median": 1000.0, **common})
    w.append("gemm", {"key": "gemm_qkv_bf16_1x6144x4096", "dtype": "bf16", "m": 1, "n": 6144, "k": 4096,
                      "flops": 2 * 6144 * 4096, "bytes": 2 * (4096 + 6144 * 4096 + 6144), "tflops_best": 0.05,
                      "shape_source": "llama-3.1-8b:qkv", **common})
    s = summarize_run(load(w.run_dir))
    bf16 = [h for h in s.headlines if "bf16" in h.label and h.probe == "peak"][0]
    assert bf16.value == 800e3 and abs(bf16.pct - 100 * 800 / 989.4) < 1e-9
    fp8 = [h for h in s.headlines if "fp8" in h.label][0]
    assert fp8.pct is None
    assert [h for h in s.headlines if h.probe == "gemm"]


def _png_size(path):
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG."""
    import struct

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    assert data[-12:-4] == b"\x00\x00\x00\x00IEND", path  # complete: ends with the IEND chunk
    return struct.unpack(">II", data[16:24])


def test_show_plots_of_a_committed_run(tmp_path):
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "results/eval/cpu/probes/cpu/20261201T152015Z-vm"
    run = tmp_path / "run"
    shutil.copytree(src, run)  # the default writes next to the run: a copy keeps the committed one as is
    res = run_cli("show", str(run), "--plots")
    assert res.returncode == 0, res.stderr
    names = ("bandwidth.png", "gemm.png", "launch.png", "torch_linear.png")
    for name in names:
        assert f"wrote {run / name}" in res.stdout
        w, h = _png_size(run / name)
        assert w >= 400 and h >= 300 and (run / name).stat().st_size > 10_000
    out = tmp_path / "plots"
    js = json.loads(run_cli("show", str(src), "--plots", "--out", str(out), "--json").stdout)
    assert sorted(Path(p).name for p in js["plots"]) == sorted(names)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left
    # a run without torch_ops rows has no torch_linear plot
    res = run_cli("show", str(src.parent / "20261201T112057Z-vm"), "--plots", "--out", str(tmp_path / "p2"))
    assert res.returncode == 0 and sorted(p.name for p in (tmp_path / "p2").iterdir()) == sorted(names[:3])
    bad = run_cli("show", str(src), "--out", str(tmp_path / "p3"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "p3").exists()
