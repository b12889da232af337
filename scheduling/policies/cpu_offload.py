"""``cpu-offload``: a host-DRAM block pool behind the GPU prefix cache (vLLM's CPU offloading).

Modelled on vLLM's ``OffloadingConnector`` / ``SimpleCPUOffloadConnector`` (project reference):
- the pool holds whole GPU blocks keyed by block hash, sized in GiB (default 8 GiB, the simple
  connector's), LRU;
- **stores cost link time and hold GPU blocks.** A turn's new full blocks are copied device to
  host over the SKU's host link (one direction, its own queue). ``store="eager"`` (write-through)
  starts the copy while the turn runs, from its first scheduled step, so little is left at its
  finish; ``store="lazy"`` copies at the finish. Either way the finished request's GPU blocks
  are freed only when its copy has ended (vLLM's connector delays the free), so a slow link
  shrinks the GPU cache;
- **loads cost per-transfer latency plus bytes / bandwidth**: at admission, after the GPU prefix
  hit, consecutive blocks found in the pool are loaded host to device *asynchronously* (the
  request waits while others run); loads queue on their own link direction;
- link bandwidth = SKU ``host_link_gbs`` × ``link_efficiency`` (pinned-memory DMA reaches ~80 %
  of a PCIe link's per-direction peak).
An undersized pool thrashes: a job's early blocks are the least recently stored, so they are
evicted first and the chained prefix lookup stops at the first missing block; meanwhile every
turn still pays its stores.

Approximations (docs/scheduling.md): vLLM's lazy mode stores a block when the GPU is about to
reuse it; here lazy means at the request's finish. A block counts as in the pool from the start
of its copy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from common.errors import ConfigError
from scheduling.engine.kv_cache import HashLRU
from scheduling.engine.request import Request
from scheduling.policies.base import ExternalLoad, KVPolicy, check_params

if TYPE_CHECKING:
    from scheduling.policies.base import PolicyContext

GIB = 1 << 30
STORE_MODES = ("eager", "lazy")


@dataclass(frozen=True)
class CPUOffloadParams:
    """Args:
        cpu_gib: host pool size in GiB (vLLM SimpleCPUOffloadConnector default: 8 GiB).
        link_gbs: host-link bandwidth per direction in GB/s; None takes the SKU's ``host_link_gbs``.
        link_efficiency: share of the link a pinned DMA copy reaches (0.8: ~25 GB/s on PCIe Gen4 x16).
        store: ``eager`` (write-through while the turn runs) or ``lazy`` (copy at the turn's finish).
        transfer_latency_s: fixed cost of one transfer (a request's load or a turn's store): DMA
            setup, the copy kernels' launches, completion polling by the scheduler (50 us).
    """

    cpu_gib: float = 8.0
    link_gbs: float | None = None
    link_efficiency: float = 0.8
    store: str = "eager"
    transfer_latency_s: float = 50e-6

    def __post_init__(self) -> None:
        if self.store not in STORE_MODES:
            raise ConfigError(f"cpu-offload store must be one of {', '.join(STORE_MODES)}, got {self.store!r}")
        check_params("cpu-offload", self, positive=("cpu_gib", "link_efficiency"), non_negative=("transfer_latency_s",),
                     optional_positive=("link_gbs",))
        if self.link_efficiency > 1:
            raise ConfigError(f"cpu-offload link_efficiency must be in (0, 1], got {self.link_efficiency}")


class HostBlockPool:
    """The host pool and its two link directions: what cpu-offload and continuum+offload share."""

    def __init__(self, params: CPUOffloadParams) -> None:
        self.p = params
        self._pool = HashLRU(0)  # block hashes, LRU first; sized in attach()
        self.capacity_blocks = 0
        self._bytes_per_s = 0.0
        self._block_bytes = 0
        self._block_size = 1
        self._load_free_s = 0.0   # host -> device direction busy until
        self._store_free_s = 0.0  # device -> host direction busy until
        self.num_stored_blocks = self.num_evicted_blocks = self.num_loaded_blocks = 0
        self.store_busy_s = self.load_busy_s = 0.0
        # NOTE(perf): a queue head is looked up every step until admitted; the answer only changes
        # when the pool's membership does, so it is memoized per request on a membership version.
        self._version = 0
        self._memo: dict[int, tuple] = {}

    def attach(self, ctx: PolicyContext) -> None:
        self._block_bytes = ctx.config.block_bytes
        self._block_size = ctx.config.block_size
        self.capacity_blocks = int(self.p.cpu_gib * GIB // self._block_bytes)
        self._pool = HashLRU(self.capacity_blocks)
        gbs = self.p.link_gbs if self.p.link_gbs is not None else ctx.config.host_link_gbs
        self._bytes_per_s = gbs * 1e9 * self.p.link_efficiency

    def _transfer_s(self, num_blocks: int) -> float:
        return self.p.transfer_latency_s + num_blocks * self._block_bytes / self._bytes_per_s

    def store(self, req: Request, now_s: float) -> float:
        """Copy the turn's full blocks the pool lacks; returns when the copy ends (<= now: done).

        Counters are net: ``stored`` counts blocks the pool did not hold, ``evicted`` the blocks
        that left it.
        """
        pool = self._pool
        before = len(pool)
        num_new = pool.store(req.job_state.hashes, req.num_cached_blocks)
        self.num_stored_blocks += num_new
        self.num_evicted_blocks += before + num_new - len(pool)
        if not num_new:
            return now_s
        self._version += 1
        began_s = req.first_scheduled_s if self.p.store == "eager" and req.first_scheduled_s is not None else now_s
        start_s = max(began_s, self._store_free_s)
        transfer_s = self._transfer_s(num_new)
        self._store_free_s = start_s + transfer_s
        self.store_busy_s += transfer_s
        return self._store_free_s

    def hit(self, req: Request, gpu_hit_tokens: int, max_tokens: int) -> int:
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

    def load(self, req: Request, gpu_hit_tokens: int, num_tokens: int, now_s: float) -> ExternalLoad:
        self._memo.pop(req.seq, None)
        first = gpu_hit_tokens // self._block_size
        n = num_tokens // self._block_size
        self._pool.refresh(req.job_state.hashes, first, n)
        self.num_loaded_blocks += n
        transfer_s = self._transfer_s(n)
        start_s = max(now_s, self._load_free_s)  # one link direction: loads queue behind each other
        self._load_free_s = start_s + transfer_s
        self.load_busy_s += transfer_s
        return ExternalLoad(load_s=self._load_free_s - now_s)

    def reload_s(self, num_tokens: int) -> float:
        """Seconds to load ``num_tokens`` of KV over an idle link."""
        return self._transfer_s(num_tokens // self._block_size)

    def __len__(self) -> int:
        return len(self._pool)

    def stats(self) -> dict:
        return {"pool_stored_blocks": self.num_stored_blocks, "pool_evicted_blocks": self.num_evicted_blocks,
                "pool_loaded_blocks": self.num_loaded_blocks, "store_link_busy_s": self.store_busy_s,
                "load_link_busy_s": self.load_busy_s}


class HostPoolMixin:
    """The KVPolicy hooks a policy with a :class:`HostBlockPool` behind it shares (cpu-offload,
    continuum-offload): connector lookups and loads, the pool's size, and freeing a finished
    request's GPU blocks only once its store has copied them out."""

    host: HostBlockPool
    num_delayed_frees: int = 0
    # From the KVPolicy it is mixed into: the context it is attached to and the policy's parameters.
    ctx: PolicyContext | None
    p: Any

    def free_when_stored(self, req: Request, now_s: float, stored_s: float) -> bool:
        """True: free the blocks now (the copy is done). Else free them at ``stored_s``."""
        if stored_s <= now_s:
            return True
        from scheduling.engine.events import BlocksReleaseEvent

        self.num_delayed_frees += 1
        assert self.ctx is not None  # attached before the engine runs
        self.ctx.push(BlocksReleaseEvent, stored_s, list(req.blocks))
        return False

    def external_hit(self, req: Request, gpu_hit_tokens: int, max_tokens: int) -> int:
        return self.host.hit(req, gpu_hit_tokens, max_tokens)

    def load_external(self, req: Request, gpu_hit_tokens: int, num_tokens: int, now_s: float) -> ExternalLoad:
        return self.host.load(req, gpu_hit_tokens, num_tokens, now_s)

    def pool_used_blocks(self) -> int:
        return len(self.host)

    def pool_total_blocks(self) -> int:
        return self.host.capacity_blocks

    def params(self) -> dict:
        return asdict(self.p)

    def host_stats(self) -> dict:
        return {**self.host.stats(), "delayed_frees": self.num_delayed_frees}


class CPUOffloadPolicy(HostPoolMixin, KVPolicy):
    name = "cpu-offload"
    asynchronous_load = True

    def __init__(self, params: CPUOffloadParams | None = None) -> None:
        super().__init__()
        self.p = params or CPUOffloadParams()
        self.host = HostBlockPool(self.p)

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        self.host.attach(ctx)

    def on_turn_finish(self, req: Request, now_s: float) -> bool:
        """Store the turn's blocks; free them now if the copy is done, else when it ends."""
        return self.free_when_stored(req, now_s, self.host.store(req, now_s))

    def stats(self) -> dict:
        return self.host_stats()
