"""``gpubench vllm kv-file-rate``: what a KV hand-off through vLLM's ExampleConnector costs on this
host, measured apart from any replay (``vllmref.worker_kvfile`` times the connector's own
safetensors calls on the model's KV shape).

A hand-off is the producer's write of the prompt's whole-block KV (a folder, one file per layer)
and the consumer's read of all of it back into its paged cache. Each half's median over the repeats
is fitted as ``latency + bytes / bandwidth`` over the sizes measured (Theil-Sen, ``fit_half``), the form in
which the simulator prices them (``replay --prefill-replicas P --kv-link file --kv-file-rate
DIR/kv_file_rate.json``).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass

import numpy as np

from common.errors import ConfigError

DEFAULT_TOKENS = (256, 512, 1024, 2048, 3072)


@dataclass(frozen=True)
class Half:
    """One half of the hand-off: seconds = ``latency_s + bytes / (gbs * 1e9)``."""

    gbs: float
    latency_s: float


@dataclass(frozen=True)
class FileRate:
    write: Half
    read: Half
    rows: list[dict]
    kv_dir: str = ""  # the directory the files went under, and its medium (tmpfs or disk)
    medium: str = ""

    def to_dict(self) -> dict:
        return {"write": vars(self.write), "read": vars(self.read), "sizes": self.rows, "kv_dir": self.kv_dir,
                "medium": self.medium}


def fit_half(rows: list[dict], key: str) -> Half:
    """``key`` (the median seconds per size) against bytes, at least two sizes, by Theil-Sen: the
    median of the slopes between every two sizes and the median intercept under it. A least-squares
    line would follow one size that the kernel's writeback throttled (the page cache's dirty data
    passing its limit shows as one size taking several times the others), which a replay writing a
    few tens of MB a second does not meet in the same way."""
    points = sorted({(float(r["bytes"]), float(r[key])) for r in rows})
    slopes = [(yj - yi) / (xj - xi) for i, (xi, yi) in enumerate(points) for xj, yj in points[i + 1:] if xj > xi]
    if not slopes:
        raise ConfigError("kv-file-rate needs at least two sizes (--tokens) to separate the fixed cost from the rate")
    slope = float(np.median(slopes))
    if slope <= 0:
        raise ConfigError(f"kv-file-rate: the {key[:-2]} did not take longer for more bytes; the host is too noisy")
    intercept = float(np.median([y - slope * x for x, y in points]))
    return Half(gbs=1.0 / slope / 1e9, latency_s=max(intercept, 0.0))


def fit(rows: list[dict]) -> FileRate:
    return FileRate(fit_half(rows, "write_s"), fit_half(rows, "read_s"), rows)


def measure(model: str, *, tokens: tuple[int, ...] = DEFAULT_TOKENS, repeats: int = 5, block_size: int = 128,
            on_line=None, kv_dir: str = "auto") -> FileRate:
    """Time the connector's write and read of ``tokens``-token prompts of ``model``'s float32 KV, in a
    directory under ``kv_dir`` (``vllmref.env.kv_exchange_parent``: where a live pair exchanges them)."""
    from common.model_config import load_model_config
    from vllmref import env

    if repeats < 1 or any(t < 1 for t in tokens):
        raise ConfigError("--repeats and every --tokens must be >= 1")
    cfg = load_model_config(model)
    parent, medium = env.kv_exchange_parent(kv_dir)
    with tempfile.TemporaryDirectory(prefix="gpubench-kvfile-", dir=parent) as tmp:
        spec = {"layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "dtype_bytes": 4,
                "block_size": block_size, "tokens": list(tokens), "repeats": repeats, "dir": tmp}
        rows = env.run_worker("worker_kvfile", spec, threads=1, on_line=on_line)
    rate = fit(rows)
    return FileRate(rate.write, rate.read, rate.rows, kv_dir=parent, medium=medium)
