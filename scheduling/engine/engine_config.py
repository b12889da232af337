"""The replay engine's sizes and switches (``EngineConfig``), apart from the engine so that
policies, the CLI and the live comparison can build one without importing the simulation."""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError
from scheduling.engine.request import BLOCK_SIZE


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes (never mutated; derive a new one with ``dataclasses.replace``).

    Args:
        num_gpu_blocks: usable KV blocks on the GPU (the null block comes on top).
        max_num_batched_tokens: token budget per step (vLLM V1 server default on large GPUs: 8192).
        max_num_seqs: most running requests (vLLM default 256).
        kv_bytes_per_token: K+V bytes of one token over all layers (for host pools and loads).
        host_link_gbs: GPU<->host bandwidth in GB/s (connectors' default bandwidth).
        record_steps: keep the per-step log (the benchmark turns it off to time the core only).
        fast_path: use the decode-group fast path (identical results; off only to test that).
        block_size: tokens per KV block (vLLM's GPU default 16; its CPU build uses 128 and needs a
            multiple of 32).
        reserve_full_sequence: admit a waiting request only when the free blocks hold its whole
            known sequence (vLLM's ``scheduler_reserve_full_isl``, on by default in vLLM 0.32);
            False admits on its first chunk alone, as older vLLM did.
        prefix_caching: look a waiting request's prefix up in the cache (vLLM's
            ``enable_prefix_caching``, on by default); off, every prompt is computed (a connector's
            tokens still load).
    """

    num_gpu_blocks: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_bytes_per_token: int = 131072
    host_link_gbs: float = 64.0
    record_steps: bool = True
    fast_path: bool = True
    block_size: int = BLOCK_SIZE
    reserve_full_sequence: bool = True
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {self.block_size!r}")

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size
