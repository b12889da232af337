"""``cpu-offload``: a host-DRAM block pool behind the GPU prefix cache (vLLM's CPU offloading).

Modelled on vLLM's ``SimpleCPUOffloadConnector`` / ``OffloadingConnector`` (project reference):
- the pool holds whole GPU blocks keyed by block hash, sized in bytes (default 8 GiB), LRU;
- a finished turn stores its full blocks (the DMA copy runs on its own stream: no step time);
- at admission, after the GPU prefix hit, consecutive blocks found in the pool are loaded over
  the host link (SKU ``host_link_gbs``) *asynchronously*: the request waits while others run.
  Loads share one link, so they queue behind each other.
An undersized pool thrashes: a job's early blocks are the least recently stored, so they are
evicted first and the chained prefix lookup stops at the first missing block.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from scheduling.kv_cache import HashLRU
from scheduling.policies.base import ExternalLoad, KVPolicy
from scheduling.request import Request

GIB = 1 << 30


@dataclass(frozen=True)
class CPUOffloadParams:
    """Args:
        cpu_gib: host pool size in GiB (vLLM SimpleCPUOffloadConnector default: 8 GiB).
        link_gbs: host-link bandwidth in GB/s; None takes the SKU's ``host_link_gbs``.
        load_latency_s: fixed cost per load (transfer setup), added once per loaded request.
    """

    cpu_gib: float = 8.0
    link_gbs: float | None = None
    load_latency_s: float = 0.0


class CPUOffloadPolicy(KVPolicy):
    name = "cpu-offload"
    asynchronous_load = True

    def __init__(self, params: CPUOffloadParams | None = None) -> None:
        super().__init__()
        self.p = params or CPUOffloadParams()
        self._pool = HashLRU(0)  # block hashes, LRU first; sized in attach()
        self._capacity_blocks = 0
        self._link_bytes_per_s = 0.0
        self._block_bytes = 0
        self._link_free_s = 0.0
        self.num_stored_blocks = self.num_evicted_blocks = self.num_loaded_blocks = 0
        # NOTE(perf): a queue head is looked up every step until admitted; the answer only changes
        # when the pool's membership does, so it is memoized per request on a membership version.
        self._version = 0
        self._memo: dict[int, tuple] = {}

    def attach(self, engine) -> None:
        super().attach(engine)
        self._block_bytes = engine.config.block_bytes
        self._block_size = engine.config.block_size
        self._capacity_blocks = int(self.p.cpu_gib * GIB // self._block_bytes)
        self._pool = HashLRU(self._capacity_blocks)
        gbs = self.p.link_gbs if self.p.link_gbs is not None else engine.config.host_link_gbs
        self._link_bytes_per_s = gbs * 1e9

    def on_turn_finish(self, req: Request, now_s: float) -> bool:
        """Store the turn's full blocks in chain order (LRU refresh of those already held).

        Counters are net: ``stored`` counts blocks the pool did not hold when the turn ended,
        ``evicted`` the blocks that left it.
        """
        pool = self._pool
        before = len(pool)
        num_new = pool.store(req.job_state.hashes, req.num_cached_blocks)
        self.num_stored_blocks += num_new
        self.num_evicted_blocks += before + num_new - len(pool)
        if num_new:
            self._version += 1
        return True

    def external_hit(self, req: Request, gpu_hit_tokens: int, max_tokens: int) -> int:
        first, last = gpu_hit_tokens // self._block_size, max_tokens // self._block_size
        if last <= first:
            return 0
        key = (self._version, first, last)
        memo = self._memo.get(req.seq)
        if memo is not None and memo[0] == key:
            return memo[1]
        n = self._pool.count_prefix(req.job_state.block_hashes(last), first, last)
        self._memo[req.seq] = (key, n * self._block_size)
        return n * self._block_size

    def load_external(self, req: Request, gpu_hit_tokens: int, num_tokens: int, now_s: float) -> ExternalLoad:
        self._memo.pop(req.seq, None)
        first = gpu_hit_tokens // self._block_size
        n = num_tokens // self._block_size
        self._pool.refresh(req.job_state.hashes, first, n)
        self.num_loaded_blocks += n
        transfer_s = n * self._block_bytes / self._link_bytes_per_s + self.p.load_latency_s
        start_s = max(now_s, self._link_free_s)  # one host link: loads queue behind each other
        self._link_free_s = start_s + transfer_s
        return ExternalLoad(load_s=self._link_free_s - now_s)

    def pool_used_blocks(self) -> int:
        return len(self._pool)

    def pool_total_blocks(self) -> int:
        return self._capacity_blocks

    def params(self) -> dict:
        return asdict(self.p)

    def stats(self) -> dict:
        return {"pool_stored_blocks": self.num_stored_blocks, "pool_evicted_blocks": self.num_evicted_blocks,
                "pool_loaded_blocks": self.num_loaded_blocks}
