"""
gpubench CPU backend: compiled probes timed with steady_clock
"""
from __future__ import annotations

import typing

__all__: list[str] = ['cache_read_cold', 'cache_read_warm', 'debug_abort', 'debug_segfault', 'dependent_add_seconds', 'isa', 'max_threads', 'noop', 'omp_fork_join', 'peak_fma', 'stream', 'vector_bytes']
def cache_read_cold(working_set_bytes: typing.SupportsInt | typing.SupportsIndex, flush_bytes: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10) -> dict:
    """
    Cold read sweep point: a flush buffer of flush_bytes is written before each timed single pass.
    """
def cache_read_warm(working_set_bytes: typing.SupportsInt | typing.SupportsIndex, passes: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10) -> dict:
    """
    Warm read sweep point: per-rep seconds of `passes` passes over a buffer kept in cache; checksum checked.
    """
def debug_abort() -> None:
    """
    Calls abort() (fault-isolation tests only).
    """
def debug_segfault() -> None:
    """
    Raises SIGSEGV (fault-isolation tests only).
    """
def dependent_add_seconds(iters: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10) -> list[float]:
    """
    Per-rep seconds of 32*iters dependent integer adds on one thread (1 cycle each): the core clock.
    A negative time marks a rep whose chain result was wrong.
    """
def max_threads() -> int:
    """
    OpenMP threads a parallel region uses.
    """
def noop() -> None:
    """
    Does nothing: times the Python -> extension call.
    """
def omp_fork_join(count: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10) -> list[float]:
    """
    Per-rep seconds of `count` empty OpenMP parallel regions.
    """
def peak_fma(dtype: str, iters: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10) -> dict:
    """
    FMA-chain throughput on all threads: per-rep seconds, flops_per_rep, checksum vs closed form.
    """
def stream(n_elements: typing.SupportsInt | typing.SupportsIndex, num_reps: typing.SupportsInt | typing.SupportsIndex = 10, corrupt: typing.SupportsInt | typing.SupportsIndex = 0) -> dict:
    """
    STREAM copy/scale/add/triad on three fp64 arrays of n_elements; dict of per-rep seconds per kernel,
    valid (stream.c golden check), reason. corrupt=1|2|3 (debug) damages a/b/c before validation.
    """
__version__: str = '0.1.0'
isa: str  # the SIMD level this build uses on this host
vector_bytes: int
