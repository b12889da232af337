"""What a real vLLM engine runs with besides the model: one definition for every caller.

``profile --engine vllm`` and ``replay --engine vllm`` (and the scheduler comparison) send vLLM
the same settings; they are checked here, once, before anything starts, and turned into the
``engine`` block of a worker spec (see :mod:`vllmref.engine`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError


def max_model_len(longest_tokens: int, block_size: int) -> int:
    """A power of two that holds the longest sequence and one more block (at least 2048)."""
    return max(2048, 1 << math.ceil(math.log2(longest_tokens + block_size)))


@dataclass(frozen=True)
class EngineSettings:
    """vLLM's CPU defaults where vLLM has one.

    Args:
        block_size: tokens per KV block (vLLM's CPU default 128; its CPU attention needs a
            multiple of 32).
        max_num_batched_tokens: the token budget per step (4096 for vLLM's offline CPU engine).
        max_num_seqs: most running requests.
        threads: OpenMP threads of the engine.
        seed: seed of the engine and of generated prompt token ids.
    """

    block_size: int = 128
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    threads: int = 2
    seed: int = 0

    def check(self) -> None:
        """One-line ConfigError for a setting vLLM would refuse or misuse."""
        if self.block_size < 32 or self.block_size % 32:
            raise ConfigError(f"--block-size {self.block_size}: vLLM's CPU attention needs a multiple of 32")
        for name in ("max_num_batched_tokens", "max_num_seqs", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    def engine_spec(self, model_dir: Path, *, real_weights: bool, longest_tokens: int,
                    num_gpu_blocks: int | None = None) -> dict:
        """The ``engine`` block of a worker spec (prefix caching on)."""
        return {"model": str(model_dir), "real_weights": real_weights, "block_size": self.block_size,
                "max_num_batched_tokens": self.max_num_batched_tokens, "max_num_seqs": self.max_num_seqs,
                "max_model_len": max_model_len(longest_tokens, self.block_size), "num_gpu_blocks": num_gpu_blocks,
                "enable_prefix_caching": True, "seed": self.seed}
