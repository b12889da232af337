#!/usr/bin/env python3
"""A real engine's step-to-step noise on this host, for ``gpubench replay --step-jitter``.

    python scripts/step_noise_cv.py PROBE_RUN_DIR

PROBE_RUN_DIR is a CPU probe run (``gpubench run --device cpu --probes ...,vllm_ops``; the directory
holding ``vllm_ops.jsonl``). Its engine rows (families ``engine_step`` and ``engine_layers``) each
time one real vLLM engine running the same batch for a few dozen steps. Per row, the noise is the
standard deviation of the differences of successive steps' log wall times over sqrt(2): a difference
of neighbours cancels the slow drift of the context growing by a token a step, and the log makes it
a coefficient of variation. Prints the median over the rows (and, on stderr, each row's). Exit 2
with one line on bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

FAMILIES = ("engine_step", "engine_layers")
MIN_STEPS = 5


def row_noise(wall_times_s: list[float]) -> float:
    """The step-to-step coefficient of variation of one row's repeated steps."""
    logs = [math.log(t) for t in wall_times_s]
    diffs = [b - a for a, b in zip(logs, logs[1:])]
    return statistics.pstdev(diffs) / math.sqrt(2)


def noise_of_run(run_dir: Path) -> tuple[float, list[tuple[str, float]]]:
    path = run_dir if run_dir.name == "vllm_ops.jsonl" else run_dir / "vllm_ops.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no vllm_ops.jsonl (a CPU probe run with --probes ...,vllm_ops)")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
            times = row.get("wall_times_s") or []
            if row.get("family") in FAMILIES and row.get("valid", True) and len(times) >= MIN_STEPS:
                if any(not isinstance(t, (int, float)) or t <= 0 for t in times):
                    raise ValueError("a wall time that is not a positive number")
                rows.append((str(row.get("key", f"line {n}")), row_noise(times)))
        except ValueError as e:  # json.JSONDecodeError is one
            raise ValueError(f"{path} line {n}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no engine rows with {MIN_STEPS}+ timed steps (families {', '.join(FAMILIES)})")
    return statistics.median(v for _, v in rows), rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a CPU probe run's directory (with vllm_ops.jsonl), or that file")
    args = p.parse_args(argv)
    if not args.run_dir.strip():
        p.error("give a probe run's directory")
    try:
        cv, rows = noise_of_run(Path(args.run_dir))
    except (ValueError, OSError) as e:
        print(f"step_noise_cv: error: {e}", file=sys.stderr)
        return 2
    for key, v in rows:
        print(f"{key}: {v:.3f}", file=sys.stderr)
    print(f"{cv:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
