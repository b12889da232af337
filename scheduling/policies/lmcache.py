"""``lmcache``: an external KV chunk store with a CPU tier (LMCache behind vLLM).

Modelled on LMCache's vLLM connector (project reference):
- KV is stored in chunks of 256 tokens keyed by the chained hash of the chunk's last block (so a
  key identifies the whole prefix); partial chunks are never stored;
- after a request's prefill completes, every full chunk of its prompt that the store lacks is
  written: ``chunk bytes / store bandwidth + per-chunk cost``, paid inside that step (LMCache's
  save is synchronous with the forward by default);
- at admission, the longest stored chunk prefix beyond the GPU hit is retrieved:
  ``bytes of the chunks touched / retrieve bandwidth + per-chunk cost``, also inside the step;
- the CPU tier is sized in GiB (default 5, LMCache's ``max_local_cpu_size``) and evicts chunks LRU.

Per-chunk costs (``store_chunk_s`` 0.5 ms, ``retrieve_chunk_s`` 0.2 ms) are our estimates of
LMCache's fixed work per 256-token chunk: hashing the chunk's tokens, allocating from its CPU
memory pool, and the gather/scatter kernels that move a chunk between vLLM's paged layout and
LMCache's contiguous one (one launch per layer). No published figure isolates them; they are
parameters so a measured value can replace them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

from scheduling.engine.request import Request
from scheduling.policies.base import ExternalLoad, KVPolicy, PolicyContext, check_params


@dataclass(frozen=True)
class LMCacheParams:
    """Args:
        chunk_tokens: LMCache ``chunk_size`` (default 256), a multiple of the block size.
        cpu_gib: CPU tier size in GiB (LMCache ``max_local_cpu_size``, default 5.0, which LMCache
            multiplies by 1024**3).
        store_gbs / retrieve_gbs: GB/s of a store / retrieve; None takes the SKU's host link.
        store_chunk_s / retrieve_chunk_s: fixed per-chunk cost (hashing, allocation, launch).
    """

    chunk_tokens: int = 256
    cpu_gib: float = 5.0
    store_gbs: float | None = None
    retrieve_gbs: float | None = None
    store_chunk_s: float = 0.5e-3
    retrieve_chunk_s: float = 0.2e-3

    def __post_init__(self) -> None:
        check_params("lmcache", self, positive=("cpu_gib",), non_negative=("store_chunk_s", "retrieve_chunk_s"),
                     counts=("chunk_tokens",), optional_positive=("store_gbs", "retrieve_gbs"))


class LMCachePolicy(KVPolicy):
    name = "lmcache"

    def __init__(self, params: LMCacheParams | None = None) -> None:
        super().__init__()
        self.p = params or LMCacheParams()
        self._blocks_per_chunk = 0  # known once attached: the engine sets the block size
        self._store: OrderedDict = OrderedDict()  # chunk key -> None, LRU first
        self._capacity_chunks = 0
        self._chunk_bytes = 0
        self.num_stored_chunks = self.num_evicted_chunks = self.num_retrieved_chunks = 0
        self.store_s = self.retrieve_s = 0.0
        self._version = 0  # store membership changes (memo of lookups, as in cpu_offload)
        self._memo: dict[int, tuple] = {}

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        block_size = ctx.config.block_size
        if self.p.chunk_tokens % block_size:
            from common.errors import ConfigError

            raise ConfigError(f"lmcache chunk_tokens must be a multiple of the block size {block_size}, "
                              f"got {self.p.chunk_tokens}")
        self._blocks_per_chunk = self.p.chunk_tokens // block_size
        self._chunk_bytes = ctx.config.kv_bytes_per_token * self.p.chunk_tokens
        self._capacity_chunks = int(self.p.cpu_gib * (1 << 30) // self._chunk_bytes)
        link = ctx.config.host_link_gbs
        self._store_bps = (self.p.store_gbs or link) * 1e9
        self._retrieve_bps = (self.p.retrieve_gbs or link) * 1e9

    def _key(self, hashes, chunk: int):
        return hashes[(chunk + 1) * self._blocks_per_chunk - 1]

    def on_prefill_complete(self, req: Request, num_computed: int) -> float:
        num_chunks = num_computed // self.p.chunk_tokens
        if num_chunks == 0:
            return 0.0
        hashes = req.job_state.block_hashes(num_chunks * self._blocks_per_chunk)
        store, cap = self._store, self._capacity_chunks
        num_new = 0
        for c in range(num_chunks):
            k = self._key(hashes, c)
            if k in store:
                store.move_to_end(k)
                continue
            store[k] = None
            num_new += 1
            self._version += 1
            if len(store) > cap:
                store.popitem(last=False)
                self.num_evicted_chunks += 1
        self.num_stored_chunks += num_new
        cost_s = num_new * (self._chunk_bytes / self._store_bps + self.p.store_chunk_s)
        self.store_s += cost_s
        return cost_s

    def _num_stored_prefix_chunks(self, req: Request) -> int:
        bpc = self._blocks_per_chunk
        max_chunks = req.num_tokens // self.p.chunk_tokens  # only full chunks exist in the store
        hashes = req.job_state.block_hashes(max_chunks * bpc)
        store = self._store
        n = 0
        while n < max_chunks and hashes[(n + 1) * bpc - 1] in store:
            n += 1
        return n

    def external_hit(self, req: Request, gpu_hit_tokens: int, max_tokens: int) -> int:
        key = (self._version, req.num_tokens)
        memo = self._memo.get(req.seq)
        if memo is not None and memo[0] == key:
            num_chunks = memo[1]
        else:
            num_chunks = self._num_stored_prefix_chunks(req)
            self._memo[req.seq] = (key, num_chunks)
        hit_tokens = min(num_chunks * self.p.chunk_tokens, max_tokens)
        return max(0, hit_tokens - gpu_hit_tokens)

    def load_external(self, req: Request, gpu_hit_tokens: int, num_tokens: int, now_s: float) -> ExternalLoad:
        self._memo.pop(req.seq, None)
        ct = self.p.chunk_tokens
        first_chunk = gpu_hit_tokens // ct
        end_chunk = -(-(gpu_hit_tokens + num_tokens) // ct)  # whole chunks are retrieved
        hashes = req.job_state.hashes
        for c in range(first_chunk, end_chunk):
            self._store.move_to_end(self._key(hashes, c))
        touched = end_chunk - first_chunk
        self.num_retrieved_chunks += touched
        cost_s = touched * (self._chunk_bytes / self._retrieve_bps + self.p.retrieve_chunk_s)
        self.retrieve_s += cost_s
        return ExternalLoad(load_s=cost_s)

    def pool_used_blocks(self) -> int:
        return len(self._store) * self._blocks_per_chunk

    def pool_total_blocks(self) -> int:
        return self._capacity_chunks * self._blocks_per_chunk

    def params(self) -> dict:
        return asdict(self.p)

    def stats(self) -> dict:
        return {"store_chunks": self.num_stored_chunks, "evicted_chunks": self.num_evicted_chunks,
                "retrieved_chunks": self.num_retrieved_chunks, "store_s": self.store_s, "retrieve_s": self.retrieve_s}
