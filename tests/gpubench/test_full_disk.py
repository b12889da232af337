"""A full disk: one line, exit 2, and no empty or partial file left behind to break the next run.

The output goes to a 256 KiB tmpfs filled up to its last few KiB; after the filler is removed the
same command must succeed in the same place (the lock file left behind is reusable by design)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .badinput import invoke

CASES = {
    "replay": lambda out: ["replay", "--jobs", "4", "--jps", "2", "--no-progress", "--out", str(out / "r")],
    "trace-swesmith": lambda out: ["trace", "swesmith", "--jobs", "5", "--out", str(out / "t.jsonl")],
}


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(p.stderr or p.stdout).strip() or p.returncode}): needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path, leave: int) -> Path:
    filler = mnt / "filler"
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name", ["replay", "trace-swesmith"])
def test_full_disk_is_one_line_and_leaves_nothing_half_written(small_fs, tmp_path, name):
    argv = CASES[name](small_fs)
    filler = _fill(small_fs, leave=12 * 1024)
    o = invoke(argv, tmp_path, timeout_s=120)
    lines = [ln for ln in o.stderr.splitlines() if ln.strip()]
    assert o.rc == 2 and len(lines) == 1 and "Traceback" not in o.stderr, o.stderr[-1500:]
    assert lines[0].startswith("gpubench: error: ") and "No space left on device" in lines[0], lines[0]
    assert str(small_fs) in lines[0], lines[0]  # names the file that did not fit
    left = {k: v for k, v in _files(small_fs).items() if k != "filler"}
    # No temporary file and no empty or truncated output: only the (empty, by design) lock file,
    # and whole files an earlier step finished.
    assert not [k for k in left if k.endswith(".tmp")], left
    assert not [k for k, v in left.items() if v == 0 and not k.endswith(".gpubench.lock")], left

    kept = {k: (small_fs / k).read_bytes() for k in left if not k.endswith(".gpubench.lock")}
    if name == "trace-swesmith":
        assert not kept, kept.keys()  # one file: whole or absent
    filler.unlink()  # space again: the same command in the same place now works
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_fs)], check=True)
    o = invoke(argv, tmp_path, timeout_s=120)
    assert o.rc == 0, o.stderr[-1500:]
    after = _files(small_fs)
    for k, data in kept.items():  # what the full disk let through was whole: the rerun writes the same bytes
        assert (small_fs / k).read_bytes() == data, k
    if name == "replay":
        for f in ("steps.csv", "jobs.csv", "turns.csv", "summary.json"):
            assert after.get(f"r/{f}", 0) > 0, after
    else:
        text = (small_fs / "t.jsonl").read_text()
        assert text.count("\n") == 5 and text.endswith("\n")
