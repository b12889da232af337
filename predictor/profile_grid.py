"""Which engine steps ``gpubench profile`` times: the grid (GridSpec, GRIDS), its points
(GridPoint) and the analytic descriptors a step row carries of its batch (``point_features``).

Separate from predictor.profile because none of it needs torch or a clock: predictor.vllm_profile
describes vLLM's steps with the same GridPoint and ``point_features``, and the evaluation reads
rows by these descriptors.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from common.model_config import ModelConfig


@dataclass(frozen=True)
class GridSpec:
    """Which steps to time. Points over a cap are dropped, so one grid fits small and big models.

    ``max_kv_bytes`` caps the preallocated cache (memory on a shared host); ``max_step_gflop`` caps
    the FLOPs of one step, which keeps prefill steps of a 1B model on a 2-core CPU to seconds.
    """
    name: str
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    prefill_batch_sizes: tuple[int, ...] = (1, 4)
    max_kv_bytes: int = 3 << 29  # 1.5 GiB
    max_step_gflop: float = 40.0
    num_warmup: int = 2
    num_repeats: int = 5      # minimum timed steps per point
    min_time_s: float = 0.5   # keep repeating until this much was timed (fast steps get more repeats)
    max_repeats: int = 50


GRIDS = {
    "quick": GridSpec("quick", batch_sizes=(1, 4, 16), contexts=(64, 512), prefill_tokens=(16, 64),
                      prefill_batch_sizes=(1, 2), max_kv_bytes=1 << 28, max_step_gflop=10.0,
                      num_warmup=1, num_repeats=5, min_time_s=0.1, max_repeats=20),
    "default": GridSpec("default", batch_sizes=(1, 2, 4, 8, 16, 32, 64), contexts=(64, 256, 1024, 4096),
                        prefill_tokens=(16, 64, 256, 1024)),
    # The default grid with a GPU's caps: up to 48 GiB of KV (64 x 4K context of an 8B model is 32 GiB)
    # and no FLOP cap that binds (4 x 1,024 prefill tokens of an 8B model are 66 TFLOP, ~0.1 s on an
    # H100-class part); fewer repeats per point, since a GPU step's spread is far below a shared CPU's.
    "gpu": GridSpec("gpu", batch_sizes=(1, 2, 4, 8, 16, 32, 64), contexts=(64, 256, 1024, 4096),
                    prefill_tokens=(16, 64, 256, 1024), max_kv_bytes=48 << 30, max_step_gflop=1e6,
                    num_warmup=3, num_repeats=10, min_time_s=0.2, max_repeats=30),
    # The graph engine on a GPU (--engine torch-graph): decode shapes a serving engine captures, from one
    # sequence to 64, at three contexts, plus a few prefill and chunked-prefill (mixed) points, small
    # enough that five models fit a short device window.
    "graph": GridSpec("graph", batch_sizes=(1, 4, 16, 64), contexts=(256, 1024, 4096), prefill_tokens=(256, 1024),
                      prefill_batch_sizes=(1,), max_kv_bytes=40 << 30, max_step_gflop=1e6,
                      num_warmup=3, num_repeats=10, min_time_s=0.2, max_repeats=30),
}


@dataclass(frozen=True)
class GridPoint:
    """One batch to time: per sequence ``(num_new_tokens, num_cached_tokens)``, decodes first."""
    phase: str
    batch: tuple[tuple[int, int], ...]

    @property
    def key(self) -> str:
        # Run-length encoded so a 64-sequence decode batch stays a short key.
        parts, prev, count = [], None, 0
        for seq in self.batch + ((None, None),):
            if seq == prev:
                count += 1
                continue
            if prev is not None:
                parts.append(f"{count}x{prev[0]}+{prev[1]}")
            prev, count = seq, 1
        return f"{self.phase}:{','.join(parts)}"

    @property
    def num_new_tokens(self) -> int:
        return sum(n for n, _ in self.batch)

    @property
    def kv_tokens(self) -> int:
        """Cache positions the step needs: rows x longest sequence (the cache is a dense view)."""
        return len(self.batch) * max(n + c for n, c in self.batch)


def step_flops(cfg: ModelConfig, batch: Iterable[tuple[int, int]]) -> float:
    """FLOPs of one step: 2 per weight per new token, attention QK^T and PV, lm_head per sequence."""
    batch = list(batch)
    dense = cfg.num_layers * cfg.layer_params()
    num_new = sum(n for n, _ in batch)
    # Causal pairs: token j of n new tokens over c cached sees c + j + 1 keys.
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in batch)
    attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
    return 2.0 * dense * num_new + attn + 2.0 * cfg.vocab_size * cfg.hidden_size * len(batch)


def _all_points(spec: GridSpec) -> list[GridPoint]:
    """Every decode, prefill and mixed point of ``spec``, caps not applied, in run order."""
    pts: list[GridPoint] = []
    for b in spec.batch_sizes:
        for ctx in spec.contexts:
            pts.append(GridPoint("decode", ((1, ctx),) * b))
    for b in spec.prefill_batch_sizes:
        for n in spec.prefill_tokens:
            for cached in (0, spec.contexts[len(spec.contexts) // 2]):
                pts.append(GridPoint("prefill", ((n, cached),) * b))
    # Mixed: a chunked prefill over half the context plus (b-1) decodes, as a chunked-prefill engine runs.
    for b in spec.batch_sizes[1:]:
        for n in spec.prefill_tokens[:2]:
            for ctx in spec.contexts[:: max(1, len(spec.contexts) // 2)]:
                pts.append(GridPoint("mixed", ((1, ctx),) * (b - 1) + ((n, ctx // 2),)))
    return list(dict.fromkeys(pts))  # drop duplicates, keep order


def build_grid(spec: GridSpec, cfg: ModelConfig, *, dtype_bytes: int) -> list[GridPoint]:
    """Decode, prefill and mixed points of ``spec`` that fit its memory and FLOP caps, in run order."""
    kv_per_token = cfg.kv_bytes_per_token(dtype_bytes)
    return [p for p in _all_points(spec) if p.kv_tokens * kv_per_token <= spec.max_kv_bytes
            and step_flops(cfg, p.batch) <= spec.max_step_gflop * 1e9]


def num_dropped(spec: GridSpec, cfg: ModelConfig, *, dtype_bytes: int) -> int:
    """How many of ``spec``'s points its caps drop for ``cfg``."""
    return len(_all_points(spec)) - len(build_grid(spec, cfg, dtype_bytes=dtype_bytes))


def default_grid(device: str) -> str:
    """The grid ``gpubench profile`` times when none is named: a GPU's caps on a GPU, else the CPU's."""
    return "gpu" if device.startswith("cuda") else "default"


def point_features(cfg: ModelConfig, point: GridPoint, dtype_bytes: int) -> dict:
    """Batch descriptors and the analytic quantities a predictor uses."""
    b = point.batch
    cached = [c for _, c in b]
    return {
        "num_seqs": len(b), "num_decode_seqs": sum(1 for n, c in b if n == 1 and c > 0),
        "num_prefill_seqs": sum(1 for n, c in b if not (n == 1 and c > 0)),
        "num_new_tokens": point.num_new_tokens, "context_sum": int(sum(cached)), "context_max": int(max(cached)),
        "kv_len_sum": int(sum(n + c for n, c in b)), "batch_json": json.dumps([list(s) for s in b]),
        "step_flops": step_flops(cfg, b), "weight_bytes": cfg.weight_bytes(dtype_bytes),
        "kv_read_bytes": int(sum(n + c for n, c in b)) * cfg.kv_bytes_per_token(dtype_bytes),
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "param_count": cfg.param_count(),
    }

