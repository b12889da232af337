"""Resume and corrupt rows, without timing anything: the STREAM worker runs in-process on a fake
kernel, killed (an exception past the point of no return) between two rows of one measurement."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.errors import ResultsFormatError
from gpubench import probe_worker, results

REPO = Path(__file__).resolve().parents[2]
RUN_SRC = REPO / "results/eval/cpu/probes/cpu/20261201T112057Z-vm"
KERNELS = ("copy", "scale", "add", "triad")


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


def _fake_stream(calls):
    def stream(n, num_reps, corrupt):
        calls.append(n)
        t = [1e-4 * 2 ** len(calls)] * num_reps  # each measurement's times differ: which one wrote a row shows
        return {"threads": 1, "valid": True, "reason": "", **{k: list(t) for k in KERNELS}}
    return stream


@pytest.fixture
def stream_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    m = json.loads((RUN_SRC / "manifest.json").read_text())
    m["config"]["options"] = {"stream.min_array_bytes": "131072", "stream.max_array_bytes": "262144"}
    m["probes"] = {"stream": {"status": "running"}}
    (run / "manifest.json").write_text(json.dumps(m))
    import common.procutil as procutil
    import gpubench._cpu as cpu

    calls = []
    monkeypatch.setattr(cpu, "stream", _fake_stream(calls))
    monkeypatch.setattr(procutil, "die_with_parent", lambda pid: None)
    monkeypatch.setattr(probe_worker, "_emit", lambda event: None)
    return run, calls


def _kill_after(monkeypatch, num_rows, torn=b""):
    real = results.RunWriter.append
    state = {"n": 0}

    def append(self, probe, row):
        if state["n"] == num_rows:
            with open(self.path(probe), "ab") as f:
                f.write(torn)  # killed mid-write: part of the next line, no newline
            raise Killed()
        state["n"] += 1
        real(self, probe, row)

    monkeypatch.setattr(results.RunWriter, "append", append)
    return real


@pytest.mark.parametrize("torn", [b"", b'{"key": "stream_add_fp6'], ids=["between-rows", "mid-row"])
def test_killed_between_the_rows_of_one_stream_measurement(stream_run, monkeypatch, torn):
    run, calls = stream_run
    real = _kill_after(monkeypatch, 6, torn)  # measurement 1: 4 rows; measurement 2: killed after 2 of 4
    with pytest.raises(Killed):
        probe_worker.worker_main(str(run), "stream", 0)
    before = (run / "stream.jsonl").read_bytes()
    assert before.count(b"\n") == 6 and before.endswith(torn)
    monkeypatch.setattr(results.RunWriter, "append", real)

    probe_worker.worker_main(str(run), "stream", 0)  # the resume
    rows = results.read_rows(run / "stream.jsonl")
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)) == 8, keys  # 2 sizes x 4 kernels: none lost, none doubled
    n1, n2 = sorted({r["n_elements"] for r in rows})
    assert sorted(keys) == sorted(f"stream_{k}_fp64_{n}" for k in KERNELS for n in (n1, n2))
    good = before[: len(before) - len(torn)]
    assert (run / "stream.jsonl").read_bytes().startswith(good)  # finished rows untouched, in place
    assert len(calls) == 3  # the first measurement is not redone; the interrupted one is measured again
    first_two = {r["key"]: r["times_s"][0] for r in rows[4:6]}
    last_two = {r["key"]: r["times_s"][0] for r in rows[6:]}
    assert set(first_two.values()) == {4e-4} and set(last_two.values()) == {8e-4}  # completed, not replaced


def test_a_corrupt_middle_line_of_a_rows_file_is_one_error_naming_file_and_line(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN_SRC, run)
    lines = (run / "stream.jsonl").read_text().splitlines(keepends=True)
    lines[5] = lines[5][: len(lines[5]) // 2] + "\n"  # line 6 of 24 cut in half
    (run / "stream.jsonl").write_text("".join(lines))
    with pytest.raises(ResultsFormatError, match=r"stream\.jsonl:6: malformed JSON"):
        results.load(run)
    with pytest.raises(ResultsFormatError, match=r"stream\.jsonl:6: malformed JSON"):
        results.RunWriter(run).measured_keys("stream")  # a resume refuses it too: no row is dropped or redone
    assert (run / "stream.jsonl").read_text() == "".join(lines)  # and the file is left as it was

    from gpubench.cli import main

    for argv in (["show", str(run)], ["fit", str(run), "-o", str(tmp_path / "c.json")]):
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 2
        lines_out = err.getvalue().splitlines()
        assert len(lines_out) == 1 and "stream.jsonl:6: malformed JSON" in lines_out[0], err.getvalue()
    assert not (tmp_path / "c.json").exists()
