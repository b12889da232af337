#!/usr/bin/env python
"""Feed every sub-command each malformed input of tests/gpubench/badinput.py and count outcomes.

    python scripts/bad_input_audit.py [--timeout-s 30] [--only SUBSTRING] [-v]

Each case runs ``gpubench.cli.main`` in a forked child of this process (imports are paid once),
in a scratch directory holding the fixture files; a case that passes its timeout is killed and
counted as hung. Outcomes: handled cleanly (exit 2, one line on stderr, no traceback, nothing
written), traceback, silently accepted (exit 0), wrong exit code or not one line, hung, wrote
files. Exit status 0 only when every case was handled cleanly.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("COLUMNS", "200")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.gpubench import badinput as bi  # noqa: E402


def run_forked(argv: list[str], cwd: Path, timeout_s: float) -> bi.Outcome:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            o = bi.invoke(argv, cwd, timeout_s=timeout_s)
            data = pickle.dumps(o)
        except BaseException as e:  # noqa: BLE001
            data = pickle.dumps(bi.Outcome(1, "", f"Traceback (harness): {e!r}"))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout_s + 10
    chunks = []
    os.set_blocking(r, False)
    while True:
        try:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                break
            time.sleep(0.01)
    os.close(r)
    os.waitpid(pid, 0)
    try:
        return pickle.loads(b"".join(chunks))
    except Exception:  # killed (hard hang in C code, or the alarm never fired)
        return bi.Outcome(None, "", "", hung=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout-s", type=float, default=30.0, help="per-case limit (default 30)")
    ap.add_argument("--only", default=None, help="run only cases whose label contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case that was not handled cleanly")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = ap.parse_args()

    import numpy  # noqa: E401,F401

    import gpubench.cli  # noqa: F401  - loaded once, before the forks

    counts: Counter = Counter()
    bad = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpubench-audit-") as tmp:
        d = Path(tmp) / "in"
        bi.make_fixtures(d)
        cases = [c for c in bi.all_cases(d) if args.only is None or args.only in c[0]]
        for i, (label, template) in enumerate(cases):
            work = Path(tmp) / "work"
            work.mkdir()
            argv = bi.fill(template, d, work / "out")
            before = bi.snapshot(Path(tmp))
            o = run_forked(argv, work, args.timeout_s)
            after = bi.snapshot(Path(tmp))
            v = bi.verdict(o, before, after)
            counts[v] += 1
            if v != bi.CLEAN:
                bad.append((v, label, argv, bi.describe(o, before, after)))
                if args.verbose:
                    print(f"[{v}] {label}\n    {' '.join(argv)}\n    {bi.describe(o, before, after)}", file=sys.stderr)
            shutil.rmtree(work)
            if v in (bi.WROTE, bi.ACCEPTED):  # a case that wrote into the fixtures must not taint the next
                shutil.rmtree(d)
                bi.make_fixtures(d)
    total = sum(counts.values())
    order = [bi.CLEAN, bi.TRACEBACK, bi.ACCEPTED, bi.WRONG_EXIT, bi.HUNG, bi.WROTE]
    if args.json:
        print(json.dumps({"cases": total, **{k: counts[k] for k in order}, "seconds": round(time.monotonic() - t0, 1)}))
    else:
        print(f"{total} malformed-input cases in {time.monotonic() - t0:.0f} s")
        for k in order:
            print(f"  {k:34s} {counts[k]}")
        for v, label, argv, _ in bad[:50]:
            print(f"  [{v}] {label}")
    return 0 if counts[bi.CLEAN] == total else 1


if __name__ == "__main__":
    sys.exit(main())
