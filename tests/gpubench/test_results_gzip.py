"""Committed runs keep their large rows files gzipped (`gzip -9 <probe>.jsonl`): loading reads them
as the plain files, and a run holding a probe both ways, a truncated gzip or a resume of a
compressed run is one line."""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from common.errors import ResultsFormatError
from gpubench.results import load, rows_files
from gpubench.runner import _check_resumable

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "results" / "eval" / "cpu" / "probes" / "cpu" / "20261204T154125Z-vm"


def _plain_copy(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("manifest.json", "stream.jsonl", "l2.jsonl"):
        shutil.copy(COMMITTED / name, run / name)
    return run


def test_a_gzipped_rows_file_loads_as_the_plain_one(tmp_path):
    run = _plain_copy(tmp_path)
    plain = load(run)
    with open(run / "l2.jsonl", "rb") as src, gzip.open(run / "l2.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    (run / "l2.jsonl").unlink()
    packed = load(run)
    assert set(packed.frames) == {"stream", "l2"} and packed["l2"].equals(plain["l2"])
    # the committed run keeps torch_ops and vllm_ops gzipped: every probe loads
    assert {"torch_ops", "vllm_ops", "gemm", "stream"} <= set(load(COMMITTED).frames)


def test_bad_compressed_runs_are_one_line(tmp_path):
    run = _plain_copy(tmp_path)
    shutil.copy(run / "l2.jsonl", tmp_path / "l2.jsonl")
    with open(tmp_path / "l2.jsonl", "rb") as src, gzip.open(run / "l2.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    with pytest.raises(ResultsFormatError, match="both l2.jsonl and l2.jsonl.gz"):
        rows_files(run)
    (run / "l2.jsonl").unlink()
    with pytest.raises(ResultsFormatError, match="compressed"):
        _check_resumable(run)
    data = (run / "l2.jsonl.gz").read_bytes()
    (run / "l2.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ResultsFormatError, match="not a complete gzip file"):
        load(run)
