"""When a timed kvcomm run (``kvcomm serve-exchange``, ``kvcomm ttft``) is not for quoting: one rule
for both, standard library only (the CLI reads ``LOAD_FLAG`` for its help text)."""
from __future__ import annotations

from collections.abc import Sequence

# 1-minute load average above which a timed run is flagged (before it starts; while it runs, the
# run's own threads are added): on the 2-core machine this means another job competes for the cores
LOAD_FLAG = 1.5


def load_flags(load_before: float | None, loads_during: Sequence[float], num_threads: int,
               whose: str = "its") -> list[str]:
    """Why a run's timings are not for quoting (empty: not flagged). ``whose`` names the threads the
    run itself adds to the load ("its", "the backend's")."""
    flags = []
    if load_before is not None and load_before > LOAD_FLAG:
        flags.append(f"load average {load_before:.2f} before the run (> {LOAD_FLAG})")
    during = max(loads_during)
    if during > LOAD_FLAG + num_threads:
        flags.append(f"load average up to {during:.2f} during the run (> {LOAD_FLAG} + {whose} {num_threads} thread(s))")
    return flags
