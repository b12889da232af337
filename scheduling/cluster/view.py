"""What a router knows when it routes a turn (scheduling.cluster.routers decide from this alone).

A real router sees three things, and so does this one:

- **its own traffic**, exactly: the turns it sent to each replica that have not finished
  (``outstanding``) and their prompt blocks (``inflight_blocks``);
- **the replicas' load as last scraped** (:class:`ReplicaLoad`: waiting and running requests, KV
  blocks in use): fresh at every routing, or refreshed every ``stats_interval_s`` (a metrics
  endpoint polled, stats published on a timer), so that a burst is routed on stale numbers;
- **the prefixes it sent where** (:class:`PrefixIndex`): an approximate per-replica record of the
  prompt blocks it routed, not the replica's real cache (SGLang's approximate radix tree, the
  production-stack's hash trie, llm-d's approximate prefix scorer and Dynamo's event-less mode all
  keep such a record). Entries expire after ``prefix_ttl_s`` (Dynamo's event-less default: 120 s)
  and the oldest go first beyond ``prefix_capacity_blocks`` (default: the replica's pool).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load when it was last scraped."""

    waiting: int      # queued requests (vLLM's num_requests_waiting)
    running: int      # requests in the running batch (num_requests_running)
    used_blocks: int  # KV blocks held by requests
    total_blocks: int

    @property
    def kv_usage(self) -> float:
        """vLLM's kv_cache_usage_perc, as a share."""
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True)
class TurnToRoute:
    """A turn as the router sees its request: whose session it is and its prompt's blocks."""

    session: str         # the agent job's id: its turns are one session
    turn: int
    prompt_tokens: int
    block_hashes: list   # the hash chain of the prompt's full blocks (vLLM's block hashes)


class PrefixIndex:
    """The prompt blocks a router sent to one replica, newest last.

    A prompt's blocks are recorded head last, so the head of every chain is at least as new as its
    tail: what survives expiry and eviction of one chain is always a prefix of it, and the longest
    match is found by bisection.
    """

    def __init__(self, capacity_blocks: int, ttl_s: float) -> None:
        self.capacity = capacity_blocks
        self.ttl_s = ttl_s
        self._seen: OrderedDict = OrderedDict()  # block hash -> last time it was routed here

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, hashes: list, now_s: float) -> None:
        seen = self._seen
        for h in reversed(hashes):
            seen[h] = now_s
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def matched_blocks(self, hashes: list, now_s: float) -> int:
        """The blocks of ``hashes``' longest prefix recorded here and not expired."""
        seen, oldest = self._seen, now_s - self.ttl_s
        lo, hi = 0, len(hashes)  # hashes[:lo] match; hashes[hi:] do not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            t = seen.get(hashes[mid - 1])
            if t is not None and t >= oldest:
                lo = mid
            else:
                hi = mid - 1
        return lo


class ClusterView:
    """The router's knowledge of ``num_replicas`` replicas (module docstring)."""

    def __init__(self, num_replicas: int, *, prefix_capacity_blocks: list[int], prefix_ttl_s: float = 120.0,
                 stats_interval_s: float = 0.0) -> None:
        self.num_replicas = num_replicas
        self.outstanding = [0] * num_replicas
        self.inflight_blocks = [0] * num_replicas
        self.prefixes = [PrefixIndex(c, prefix_ttl_s) for c in prefix_capacity_blocks]
        self.stats_interval_s = stats_interval_s
        self.loads: list[ReplicaLoad] = []
        self.scraped_s = -math.inf

    def needs_scrape(self, now_s: float) -> bool:
        return not self.loads or now_s - self.scraped_s >= self.stats_interval_s

    def set_loads(self, loads: list[ReplicaLoad], now_s: float) -> None:
        self.loads, self.scraped_s = loads, now_s

    def matched(self, turn: TurnToRoute, now_s: float) -> list[int]:
        """Per replica: the turn's prompt blocks the router last sent there (its longest prefix)."""
        return [p.matched_blocks(turn.block_hashes, now_s) for p in self.prefixes]

    def sent(self, replica: int, turn: TurnToRoute, now_s: float) -> None:
        self.outstanding[replica] += 1
        self.inflight_blocks[replica] += len(turn.block_hashes)
        self.prefixes[replica].record(turn.block_hashes, now_s)

    def finished(self, replica: int, num_blocks: int) -> None:
        self.outstanding[replica] -= 1
        self.inflight_blocks[replica] -= num_blocks
