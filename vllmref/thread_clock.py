"""The repetition loop every CPU op probe times with: the calling thread's CPU time per call.

Shared by ``gpubench``'s torch_ops probe and ``vllmref.worker_ops`` (which runs inside the vLLM
environment, where only this package is importable, so the loop lives here and imports nothing).

Why a reading of exactly zero is retaken: ``time.thread_time`` reads Linux's per-thread runtime
accounting (CLOCK_THREAD_CPUTIME_ID). On a virtual machine that accounting can stand still across
a call of a few microseconds: a CI run on a 2-vCPU VM read 0 for one of ~40 repetitions of a
~15 us RMSNorm, once in 403 rows, while this clock's reported resolution is 1 ns. Such a reading
says nothing about the op, so the repetition is taken again (with its untimed ``before()``, so
the cold context stays the same) up to ``ZERO_READ_RETAKES`` times; the count is returned so a
row can say how often it happened. A repetition that still reads zero stays zero and the row is
refused as before (a kernel that truly takes no time is broken).
"""
from __future__ import annotations

import time
from typing import Callable

ZERO_READ_RETAKES = 4


def time_once(call: Callable[[], object], before: Callable[[], object] | None = None) -> tuple[float, int]:
    """Thread-CPU seconds of one ``call()`` (``before()`` untimed ahead of it) and the zero readings retaken."""
    zero_reads = 0
    while True:
        if before is not None:
            before()
        t0 = time.thread_time()
        call()
        seconds = time.thread_time() - t0
        if seconds > 0 or zero_reads >= ZERO_READ_RETAKES:
            return seconds, zero_reads
        zero_reads += 1


def repeat(call: Callable[[], object], *, min_reps: int, max_reps: int, min_timed_s: float,
           before: Callable[[], object] | None = None) -> tuple[list[float], int]:
    """Thread-CPU seconds per repetition, at least ``min_reps`` and more until ``min_timed_s`` was
    timed (at most ``max_reps``), and the zero readings retaken along the way.

    The first repetition is the warm-up: it is kept (the statistics discard it) and not counted
    towards ``min_timed_s``.
    """
    times: list[float] = []
    zero_reads = 0
    timed = 0.0
    while len(times) < min_reps or (timed < min_timed_s and len(times) < max_reps):
        seconds, retaken = time_once(call, before)
        times.append(seconds)
        zero_reads += retaken
        if len(times) > 1:
            timed += seconds
    return times, zero_reads
