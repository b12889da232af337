#!/usr/bin/env python3
"""Count what the compute and bandwidth loops compile to, per architecture; fail on a loop that
does not run on the unit its row claims.

A peak row divides counted FLOPs by time. If ptxas emulates the instruction (fp8 mma.sync on
Hopper becomes unpack + fp16 HMMA + FADD), hoists the product out of the loop, or moves an FMA
chain to the uniform datapath (UFFMA: one lane's work per warp), the row reports work the device
never did. This compiles csrc/cuda/{peak,wgmma,stream,l2}.cu for every architecture the build ships,
disassembles them (cuobjdump + nvdisasm: the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels
of the dev extra, or a toolkit's), counts opcodes per kernel and checks:

  mma_loop_k<bf16/fp16/tf32>  >= 16 HMMA per loop body, fewer FADD than HMMA      every arch
  mma_loop_k<fp8>             >= 16 QMMA, no HMMA                                 8.9, 12.x (native)
                              emulated elsewhere: the probe must skip it there     (peak.cu says so)
  fma_loop_k                  >= 64 FFMA, no UFFMA                                every arch
  wgmma_loop_k<bf16>          >= 16 HGMMA                                         sm_90a
  wgmma_loop_k<fp8>           >= 16 QGMMA (fp8's only native path on Hopper)      sm_90a
  stream copy/triad           128-bit loads and stores (LDG.E.128 / STG.E.128)     every arch
  l2 read_k                   4 loads in flight: 4 LDG.128 issued before a DADD    every arch
                              reads one (without launch bounds ptxas kept two)

Usage: scripts/check_sass.py [--archs 80,86,89,90a,100,120] [--json] [--objects DIR]
Exit status 0 when every check holds, 1 otherwise, 2 when the tools are missing.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ARCHS = ("80", "86", "89", "90a", "100", "120")
FILES = ("peak.cu", "wgmma.cu", "stream.cu", "l2.cu")
# peak.cu's template argument -> dtype (enum Dtype { BF16, FP16, TF32, FP8, FP32 })
MMA_DTYPES = {"0": "bf16", "1": "fp16", "2": "tf32", "3": "fp8"}
_FUNC_RE = re.compile(r"Function : (\S+)")
_OPCODE_RE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")


def fp8_native(arch: str) -> bool:
    """Where fp8 mma.sync is a tensor-core QMMA: the rule the probe plans with (gpubench.backends.cuda,
    mirrored by fp8_mma_native in peak.cu), so an arch where it is emulated but still planned fails."""
    cc = int(arch.rstrip("af"))
    try:
        from gpubench.backends.cuda import fp8_mma_native
    except ImportError:  # run without the package installed: the same rule, written out
        return cc == 89 or cc // 10 == 12
    return fp8_mma_native(cc)


def find_tool(name: str) -> str | None:
    """A CUDA binary from PATH, CUDA_HOME, or the nvidia-* wheels' bin directories."""
    found = shutil.which(name)
    if found:
        return found
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / name).exists():
        return str(Path(home) / "bin" / name)
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec and spec.submodule_search_locations else []):
        for candidate in sorted(Path(base).glob(f"*/bin/{name}")):
            return str(candidate)
    return None


@functools.cache
def _newest_source_mtime() -> float:
    """When a file under csrc/cuda last changed (asked once per run, not per object)."""
    return max(f.stat().st_mtime for f in (REPO / "csrc" / "cuda").iterdir())


def compiled_object(cu: str, arch: str, nvcc: str, tmp: Path, objects: Path | None) -> Path:
    """``cu`` compiled for ``arch``: the object scripts/check_cuda_build.sh kept in ``objects`` (its
    flags: the same SASS) when it is newer than every source under csrc/cuda, else compiled here."""
    if objects is not None:
        kept = objects / f"{cu}.{arch}.o"
        if kept.is_file() and kept.stat().st_mtime >= _newest_source_mtime():
            return kept
    obj = tmp / f"{cu}.{arch}.o"
    subprocess.run([nvcc, "-c", str(REPO / "csrc" / "cuda" / cu), "-o", str(obj), "-O3", "-std=c++17",
                    "-I", str(REPO / "csrc" / "cuda"), "-gencode", f"arch=compute_{arch},code=sm_{arch}"],
                   check=True, capture_output=True, text=True)
    return obj


def disassemble(cu: str, arch: str, nvcc: str, cuobjdump: str, tmp: Path,
                objects: Path | None = None) -> dict[str, Counter]:
    """``{kernel mangled name: Counter(opcode -> count)}`` of one file for one architecture."""
    obj = compiled_object(cu, arch, nvcc, tmp, objects)
    env = dict(os.environ, PATH=f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    sass = subprocess.run([cuobjdump, "-sass", str(obj)], check=True, capture_output=True, text=True, env=env).stdout
    kernels: dict[str, Counter] = {}
    current = None
    run = 0  # global loads issued since the last floating-point add read a register
    for line in sass.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            current = kernels.setdefault(m.group(1), Counter())
            run = 0
            continue
        if current is None:
            continue
        m = _OPCODE_RE.search(line)
        if m:
            op, mods = m.group(1), m.group(2)
            current[op] += 1
            if op in ("LDG", "STG") and ".128" in mods:
                current[op + ".128"] += 1
            # loads in flight: the longest run of LDGs with no DADD/FADD between them (a sum that
            # reads a load's register makes the thread wait for it)
            run = run + 1 if op == "LDG" else (0 if op in ("DADD", "FADD") else run)
            current["LDG_RUN"] = max(current["LDG_RUN"], run)
    return kernels


def check(arch: str, per_file: dict[str, dict[str, Counter]]) -> list[tuple[str, str, bool, str]]:
    """(arch, kernel, ok, what was counted) for every rule that applies to this architecture."""
    out = []

    def find(file: str, needle: str) -> Counter | None:
        for name, counts in per_file.get(file, {}).items():
            if needle in name:
                return counts
        return None

    for arg, dtype in MMA_DTYPES.items():
        c = find("peak.cu", f"mma_loop_kILi{arg}E")
        if c is None:
            out.append((arch, f"mma_loop_k<{dtype}>", False, "kernel not found"))
            continue
        hmma, qmma, fadd = c["HMMA"], c["QMMA"], c["FADD"]
        counted = f"HMMA {hmma}, QMMA {qmma}, FADD {fadd}"
        if dtype != "fp8":
            out.append((arch, f"mma_loop_k<{dtype}>", hmma >= 16 and fadd < hmma, counted))
        elif fp8_native(arch):
            out.append((arch, "mma_loop_k<fp8>", qmma >= 16 and hmma == 0, counted))
        elif int(arch.rstrip("a")) >= 89:
            # Emulated here: fine only because the probe skips fp8 on this arch (fp8_mma_native).
            out.append((arch, "mma_loop_k<fp8> (emulated: skipped at run time)", qmma == 0, counted))
        else:
            out.append((arch, "mma_loop_k<fp8> (no fp8 before 8.9: compiled out)", hmma + qmma == 0, counted))
    c = find("peak.cu", "fma_loop_k")
    out.append((arch, "fma_loop_k", c is not None and c["FFMA"] >= 64 and c["UFFMA"] == 0,
                f"FFMA {c['FFMA']}, UFFMA {c['UFFMA']}" if c is not None else "kernel not found"))
    if arch == "90a":
        for tag, dtype, op in (("Bf16", "bf16", "HGMMA"), ("E4m3", "fp8", "QGMMA")):
            c = find("wgmma.cu", f"wgmma_loop_kINS0_{len(tag)}{tag}E")
            out.append((arch, f"wgmma_loop_k<{dtype}>", c is not None and c[op] >= 16,
                        f"{op} {c[op]}" if c is not None else "kernel not found"))
    c = find("l2.cu", "read_k")
    out.append((arch, "l2 read_k", c is not None and c["LDG_RUN"] >= 4 and c["LDG.128"] >= 4,
                f"longest LDG run {c['LDG_RUN']}, LDG.128 {c['LDG.128']}" if c is not None else "kernel not found"))
    for kernel in ("copy_k", "triad_k"):
        c = find("stream.cu", kernel)
        out.append((arch, f"stream {kernel}", c is not None and c["LDG.128"] >= 1 and c["STG.128"] >= 1,
                    f"LDG.128 {c['LDG.128']}, STG.128 {c['STG.128']}, LDG {c['LDG']}" if c is not None
                    else "kernel not found"))
    return out


def run(archs: tuple[str, ...], jobs: int, objects: Path | None = None) -> list[tuple[str, str, bool, str]]:
    nvcc, cuobjdump, nvdisasm = find_tool("nvcc"), find_tool("cuobjdump"), find_tool("nvdisasm")
    missing = [n for n, t in (("nvcc", nvcc), ("cuobjdump", cuobjdump), ("nvdisasm", nvdisasm)) if t is None]
    if missing:
        raise FileNotFoundError(f"check_sass: {', '.join(missing)} not found (pip install nvidia-cuda-cuobjdump "
                                "nvidia-cuda-nvdisasm, or put a CUDA toolkit's bin on PATH)")
    if Path(nvdisasm).parent != Path(cuobjdump).parent:
        os.environ["PATH"] = f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    with tempfile.TemporaryDirectory() as tmp:
        tasks = [(cu, a) for a in archs for cu in FILES]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(lambda t: disassemble(t[0], t[1], nvcc, cuobjdump, Path(tmp), objects), tasks))
    by_arch: dict[str, dict[str, dict[str, Counter]]] = {}
    for (cu, a), kernels in zip(tasks, results):
        by_arch.setdefault(a, {})[cu] = kernels
    rows = []
    for a in archs:
        rows += check(a, by_arch[a])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(DEFAULT_ARCHS), help="comma-separated SM architectures")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compiles")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--objects", type=Path, default=None,
                    help="a directory of FILE.ARCH.o that scripts/check_cuda_build.sh kept (KEEP_OBJECTS=DIR): "
                         "disassembled instead of compiled again when newer than the sources")
    args = ap.parse_args(argv)
    try:
        rows = run(tuple(a.strip() for a in args.archs.split(",") if a.strip()), max(1, args.jobs), args.objects)
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"check_sass: {' '.join(err.cmd[:3])}... failed:\n{err.stderr}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{"arch": a, "kernel": k, "ok": ok, "counted": c} for a, k, ok, c in rows], indent=1))
    else:
        for a, k, ok, c in rows:
            print(f"sm_{a:<4} {k:<50} {'ok  ' if ok else 'FAIL'} {c}")
    bad = [r for r in rows if not r[2]]
    print(f"check_sass: {len(rows) - len(bad)} of {len(rows)} checks hold", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
