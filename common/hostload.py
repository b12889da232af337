"""The one rule for whether a measurement on this host shared it with other work (every package's
timings: probes, engine-step rows, the file connector's rate), so that nothing judges it twice.

A measurement is contended when the 1-minute load exceeded the logical CPUs by more than one, or
when it got under :data:`MIN_CPU_SHARE` of the CPU time its threads asked for.
"""
from __future__ import annotations

# A measurement that got less than this share of the CPU time it asked for was shared with other
# work (the same threshold for probe rows and vLLM engine-step rows).
MIN_CPU_SHARE = 0.8


def is_contended(*, load_1m: float | None, num_cpus: int, cpu_share: float | None = None) -> bool:
    """Load above the core count + 1, or a CPU share under MIN_CPU_SHARE."""
    return bool((load_1m is not None and load_1m > num_cpus + 1)
                or (cpu_share is not None and cpu_share < MIN_CPU_SHARE))
