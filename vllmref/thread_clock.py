"""The repetition loop every CPU op probe times with: the calling thread's CPU time per call, or the
wall time when the op runs on more than one thread.

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

Why the wall clock at more than one thread (``use_threads``): the calling thread's CPU time is what
an op costs when it runs on that thread alone, and it leaves out a busy neighbour's share of the
core. At N threads the op's time is how long the calling thread waits for all N to finish, which
its own CPU time measures only when the other threads keep pace and it spins instead of sleeping
at the barrier; the wall time is the op's time there, as it is an engine step's.
"""
from __future__ import annotations

import time
from typing import Callable

ZERO_READ_RETAKES = 4
_wall = False  # set by use_threads: the wall clock instead of the thread's CPU clock


def use_threads(num_threads: int) -> str:
    """Time what follows with the thread's CPU clock (one thread) or the wall clock (more); returns
    the timer's name as rows record it."""
    global _wall
    _wall = int(num_threads) > 1
    return "wall" if _wall else "thread_cpu"


def _now() -> float:
    return time.perf_counter() if _wall else time.thread_time()


def time_once(call: Callable[[], object], before: Callable[[], object] | None = None) -> tuple[float, int]:
    """Seconds of one ``call()`` on the current clock (``before()`` untimed ahead of it) and the zero
    readings retaken."""
    zero_reads = 0
    while True:
        if before is not None:
            before()
        t0 = _now()
        call()
        seconds = _now() - t0
        if seconds > 0 or zero_reads >= ZERO_READ_RETAKES:
            return seconds, zero_reads
        zero_reads += 1


def repeat(call: Callable[[], object], *, min_reps: int, max_reps: int, min_timed_s: float,
           before: Callable[[], object] | None = None) -> tuple[list[float], int]:
    """Seconds per repetition on the current clock, at least ``min_reps`` and more until ``min_timed_s`` was
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
