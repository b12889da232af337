"""The results store: rows round-trip through RunWriter and load(); malformed input is named."""
from __future__ import annotations

import json

import pytest

from common.errors import ResultsFormatError
from gpubench.results import RunWriter, load, read_manifest


def _writer(tmp_path):
    return RunWriter.create(tmp_path, sku="cpu", host="testhost", device={"backend": "cpu", "name": "x"},
                            probes=["stream"], argv=["gpubench", "run"])


def test_round_trip(tmp_path):
    w = _writer(tmp_path)
    rows = [{"key": f"k{i}", "probe": "stream", "times_s": [0.1, 0.2 + i], "valid": True, "gbps_best": 1.5 * i,
             "energy_j": None} for i in range(3)]
    for r in rows:
        w.append("stream", r)
    w.set_probe_status("stream", "done", num_rows=3)
    run = load(w.run_dir)
    assert run.sku == "cpu" and run.backend == "cpu"
    assert run.manifest["probes"]["stream"]["status"] == "done"
    assert run.manifest["command"] == ["gpubench", "run"]
    df = run["stream"]
    assert list(df["key"]) == ["k0", "k1", "k2"]
    assert df["times_s"].tolist() == [r["times_s"] for r in rows]
    assert df["gbps_best"].tolist() == [0.0, 1.5, 3.0]
    assert w.measured_keys("stream") == {"k0", "k1", "k2"}
    assert w.run_dir.parent.name == "cpu" and w.run_dir.name.endswith("-testhost")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    w = _writer(tmp_path)
    w.append("stream", {"key": "a", "valid": True})
    with open(w.path("stream"), "a") as f:
        f.write('{"key": "b", "valid": tru\n')
    with pytest.raises(ResultsFormatError, match=r"stream\.jsonl:2: malformed JSON"):
        load(w.run_dir)


def test_row_without_key_and_non_object(tmp_path):
    w = _writer(tmp_path)
    w.path("stream").write_text('{"key": "a"}\n[1, 2]\n')
    with pytest.raises(ResultsFormatError, match=r"stream\.jsonl:2: expected a JSON object"):
        load(w.run_dir)
    w.path("stream").write_text('{"valid": true}\n')
    with pytest.raises(ResultsFormatError, match=r"stream\.jsonl:1: row has no 'key'"):
        load(w.run_dir)


def test_torn_last_line_is_dropped_on_resume(tmp_path):
    w = _writer(tmp_path)
    w.append("stream", {"key": "a", "valid": True})
    with open(w.path("stream"), "a") as f:
        f.write('{"key": "b", "val')  # killed mid-write
    assert w.measured_keys("stream") == {"a"}
    assert w.path("stream").read_text().count("\n") == 1


def test_not_a_run_dir(tmp_path):
    with pytest.raises(ResultsFormatError, match="not a run directory"):
        read_manifest(tmp_path / "missing")
    with pytest.raises(ResultsFormatError, match="manifest.json: missing"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{\n  \"sku\": \n")
    with pytest.raises(ResultsFormatError, match=r"manifest\.json:\d+: malformed JSON"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"sku": "cpu", "probes": {}}))
    with pytest.raises(ResultsFormatError, match="no 'schema_version'"):
        read_manifest(tmp_path)
