"""Run the CUDA extension's stream and l2 measurements N times, each time in a fresh process, and say
how every run ended: the first H200 machine lost both probes to a SIGSEGV at their first measurement
and the second machine never did, so one clean run proves little and a crash must leave a trace.

Each child loads the extension (its format self-test included), measures one STREAM size and one
warm and one cold L2 working set, checks that the results are valid, and exits. A child that dies
of a signal is run once more under gdb (or cuda-gdb) when one is installed, and its C++ backtrace is
kept; Python's fault handler gives the Python side in every child.

    python scripts/stress_probes.py --runs 20 --out stress.txt       on a GPU machine
    python scripts/stress_probes.py --runs 3 --out s.txt --dry-run   no GPU: the children only import
                                                                      the extension module (rehearsal)
Exit status: 0 when every run was clean, 1 otherwise.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
from gpubench.backends.cuda.extension import load_extension
ext = load_extension()
s = ext.stream(0, 1 << 22, 20, 3)
bad = [k for k, r in s.items() if isinstance(r, dict) and not r.get("valid", True)]
for mode, passes in (("warm", 8), ("cold", 1)):
    r = ext.l2(0, 8 << 20, mode, passes, 5, 3)
    if not r.get("valid", True):
        bad.append("l2_" + mode)
print("stream+l2 ok" if not bad else "invalid: " + ",".join(bad))
raise SystemExit(1 if bad else 0)
"""
DRY_CHILD = "import gpubench.backends.cuda.extension; print('dry run: extension module imported')"


def ended(rc: int) -> str:
    if rc == 0:
        return "clean"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def backtrace(code: str, timeout_s: float) -> str:
    """The C++ backtrace of a crashing child under gdb, or why there is none."""
    gdb = shutil.which("cuda-gdb") or shutil.which("gdb")
    if gdb is None:
        return "no gdb or cuda-gdb here: Python's fault handler output above is all there is"
    cmd = [gdb, "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt", "--args", sys.executable,
           "-c", code]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"{Path(gdb).name} did not finish in {timeout_s:.0f} s"
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if not ln.startswith(("[New Thread", "[Thread"))]
    return "\n".join(lines[-40:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="fresh processes to run (default: 20)")
    ap.add_argument("--out", type=Path, required=True, help="summary file to write")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="limit per run (default: 30)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: children only import the extension module")
    args = ap.parse_args(argv)
    if args.runs < 1:
        print("stress_probes: --runs must be >= 1", file=sys.stderr)
        return 2
    code = DRY_CHILD if args.dry_run else CHILD
    lines: list[str] = []
    outcomes: list[str] = []
    crashed = None
    t0 = time.monotonic()
    for i in range(1, args.runs + 1):
        try:
            res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                                 timeout=args.timeout_s)
            how, tail = ended(res.returncode), (res.stdout + res.stderr).strip().splitlines()[-12:]
        except subprocess.TimeoutExpired:
            how, tail = f"timed out after {args.timeout_s:.0f} s", []
        outcomes.append(how)
        lines.append(f"run {i:2d}: {how}" + (f" ({tail[-1]})" if tail and how == "clean" else ""))
        if how != "clean":
            lines += ["    " + t for t in tail]
            if how.startswith("killed") and crashed is None:
                crashed = i
    clean = outcomes.count("clean")
    head = f"stress: {clean} of {args.runs} runs clean ({time.monotonic() - t0:.1f} s{', dry run' if args.dry_run else ''})"
    if crashed is not None:
        lines += [f"backtrace of a crashing run (run {crashed} repeated under a debugger):",
                  backtrace(code, 3 * args.timeout_s)]
    args.out.write_text("\n".join([head, *lines]) + "\n")
    print(head)
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
