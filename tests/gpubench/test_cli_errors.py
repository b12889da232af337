"""Every user error of run/show/compare: exit 2, one line on stderr, no traceback (real console script)."""
from __future__ import annotations

import pytest

from .conftest import run_cli


def _one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("gpubench: error: ") and "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_unknown_sku_suggests(tmp_path):
    res = run_cli("run", "--device", "cpu", "--sku", "h10", "--out", str(tmp_path))
    _one_line_error(res, "unknown SKU 'h10'", "did you mean", "h100")
    assert not list(tmp_path.iterdir())  # nothing created


def test_sku_contradicting_the_cpu(tmp_path):
    res = run_cli("run", "--device", "cpu", "--sku", "h100", "--out", str(tmp_path))
    line = _one_line_error(res, "h100-sxm", "no NVIDIA H100", "gpubench predict --sku h100-sxm")
    assert "--force" not in line


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_gpu_sku_on_this_cpu_points_to_predict_and_run_device_cpu(tmp_path, device):
    """`run --sku l40s` on a machine without that GPU: it has no L40S; predict prices a step on one,
    run --device cpu characterizes this host. --force does not file CPU rows under l40s/."""
    for extra in ([], ["--force"]):
        res = run_cli("run", "--device", device, "--sku", "l40s", "--out", str(tmp_path), *extra)
        line = _one_line_error(res, "this machine has no NVIDIA L40S", "gpubench predict --sku l40s",
                               "gpubench run --device cpu")
        assert "--force" not in line
        assert not list(tmp_path.iterdir())  # nothing created


def test_unknown_probe_and_bad_options(tmp_path):
    _one_line_error(run_cli("run", "--device", "cpu", "--probes", "stram", "--out", str(tmp_path)),
                    "unknown probe 'stram'", "stream")
    _one_line_error(run_cli("run", "--device", "cpu", "--set", "nodot", "--out", str(tmp_path)), "PROBE.NAME=VALUE")
    _one_line_error(run_cli("run", "--device", "tpu", "--out", str(tmp_path)), "unknown --device 'tpu'")
    _one_line_error(run_cli("run", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path)), "--repeats")


def test_cuda_without_a_device(tmp_path):
    _one_line_error(run_cli("run", "--device", "cuda:0", "--out", str(tmp_path)))


@pytest.mark.parametrize("cmd", [["show"], ["compare", "."]])
def test_bad_run_dir(tmp_path, cmd):
    res = run_cli(*cmd, str(tmp_path / "nope")) if cmd == ["show"] else run_cli("compare", str(tmp_path / "nope"), str(tmp_path))
    _one_line_error(res, "not a run directory")


def test_show_malformed_rows_names_file_and_line(tmp_path):
    import json

    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 1, "sku": "cpu", "probes": {}}))
    (tmp_path / "stream.jsonl").write_text('{"key": "a", "valid": true}\n{oops\n')
    _one_line_error(run_cli("show", str(tmp_path)), "stream.jsonl:2", "malformed JSON")


def test_resume_rejects_new_options(tmp_path):
    import json

    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 1, "sku": "cpu", "probes": {}}))
    _one_line_error(run_cli("run", "--resume", str(tmp_path), "--probes", "stream"), "--resume")
    _one_line_error(run_cli("run", "--resume", str(tmp_path)), "no 'config'")


def test_help_lists_options():
    res = run_cli("run", "--help")
    assert res.returncode == 0
    for opt in ("--sku", "--device", "--probes", "--quick", "--out", "--resume", "--force"):
        assert opt in res.stdout


@pytest.mark.parametrize("cmd", [("sweep",), ("replay",), ("view",), ("evaluate",), ("kvcomm", "eval")])
def test_help_names_each_default_once(cmd):
    res = run_cli(*cmd, "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    for line in res.stdout.split("\n  -")[1:]:
        assert " ".join(line.split()).count("(default:") <= 1, line
