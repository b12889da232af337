"""``fcfs``: vLLM V1's default. A finished turn frees its blocks into the LRU free queue; the next
turn of the job hits only what survived eviction during the tool gap."""
from __future__ import annotations

from scheduling.policies.base import KVPolicy


class FCFSPolicy(KVPolicy):
    """All hooks are the base defaults: FCFS queue, last-running preemption, free on finish."""

    name = "fcfs"
