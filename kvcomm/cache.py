"""A plain KV container and the one adapter to the transformers cache API.

Layout (per layer, as transformers stores it)::

    keys[layer], values[layer] : [batch, kv_heads, tokens, head_dim]   (keys already RoPE-rotated)
    positions                  : [tokens] int64, the position each token was encoded at
    token_ids                  : [tokens] int64 or None (needed to recompute tokens, e.g. CacheBlend)

Everything that depends on the installed transformers release (pinned: 5.24.0) lives in the
"adapter" section below: building a ``DynamicCache``, reading its layers, and the name of the forward
keyword that takes it. ``prefill`` and ``continue_from`` always pass explicit ``position_ids``
and a (possibly empty) cache object: with a cache present, transformers builds an index-based causal
mask (query i sees cache slots <= cache_len + i) and uses ``position_ids`` only for RoPE, so a cache
whose tokens sit at arbitrary positions is attended exactly like the model's own cache. (Without a
cache object, non-contiguous ``position_ids`` are read as packed sequences: we never do that.)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from common.errors import KVCommError

PINNED_TRANSFORMERS = "5.24.0"


@dataclass
class KVCache:
    """Per-layer K and V of a token sequence, with the positions the tokens were encoded at."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    token_ids: torch.Tensor | None = field(default=None)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise KVCommError(f"need the same non-zero number of K and V layers (got {len(self.keys)}, {len(self.values)})")
        self.positions = torch.as_tensor(self.positions, dtype=torch.long).reshape(-1)
        n = self.keys[0].shape[-2]
        for k, v in zip(self.keys, self.values):
            if k.dim() != 4 or k.shape[-2] != n or v.shape[-2] != n:
                raise KVCommError(f"every layer's K/V must be [batch, kv_heads, {n}, head_dim]; got {tuple(k.shape)}, {tuple(v.shape)}")
        if self.positions.numel() != n:
            raise KVCommError(f"{self.positions.numel()} positions for {n} cached tokens")
        if self.token_ids is not None:
            self.token_ids = torch.as_tensor(self.token_ids, dtype=torch.long).reshape(-1)
            if self.token_ids.numel() != n:
                raise KVCommError(f"{self.token_ids.numel()} token ids for {n} cached tokens")

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[-2])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def next_position(self) -> int:
        """Position the next appended token gets by default (last position + 1, or 0 when empty)."""
        return int(self.positions[-1]) + 1 if self.num_tokens else 0

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage (positions and token ids are not counted)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def slice(self, start: int, end: int | None = None) -> "KVCache":
        """Tokens [start, end) of every layer (views; positions and token ids sliced alike)."""
        sl = slice(start, end)
        return KVCache(
            keys=[k[:, :, sl] for k in self.keys],
            values=[v[:, :, sl] for v in self.values],
            positions=self.positions[sl],
            token_ids=None if self.token_ids is None else self.token_ids[sl],
        )

    @staticmethod
    def concat(caches: Sequence["KVCache"]) -> "KVCache":
        """Caches one after another along tokens; positions are kept as they are (re-rotate first if needed)."""
        if not caches:
            raise KVCommError("concat needs at least one cache")
        num_layers = caches[0].num_layers
        if any(c.num_layers != num_layers for c in caches):
            raise KVCommError(f"cannot concat caches with {[c.num_layers for c in caches]} layers")
        has_ids = all(c.token_ids is not None for c in caches)
        return KVCache(
            keys=[torch.cat([c.keys[i] for c in caches], dim=-2) for i in range(num_layers)],
            values=[torch.cat([c.values[i] for c in caches], dim=-2) for i in range(num_layers)],
            positions=torch.cat([c.positions for c in caches]),
            token_ids=torch.cat([c.token_ids for c in caches if c.token_ids is not None]) if has_ids else None,
        )

    def to(self, dtype: torch.dtype) -> "KVCache":
        """The same cache with K and V cast to ``dtype``."""
        return replace(self, keys=[k.to(dtype) for k in self.keys], values=[v.to(dtype) for v in self.values])

    def clone(self) -> "KVCache":
        return replace(self, keys=[k.clone() for k in self.keys], values=[v.clone() for v in self.values],
                       positions=self.positions.clone())

    # ---- adapter (the only transformers-version-specific code) -------------------------------------
    def to_hf(self, model=None):
        """A transformers ``DynamicCache`` holding copies of this cache's tensors."""
        return _make_hf_cache(model, [(k.clone(), v.clone()) for k, v in zip(self.keys, self.values)])

    @classmethod
    def from_hf(cls, hf_cache, positions=None, token_ids=None) -> "KVCache":
        """Read a transformers cache; ``positions`` default to ``arange(tokens)``."""
        keys, values = _read_hf_cache(hf_cache)
        if positions is None:
            positions = torch.arange(keys[0].shape[-2])
        return cls(keys=keys, values=values, positions=positions, token_ids=token_ids)


# ---- adapter: transformers 5.24 ---------------------------------------------------------------------
# 5.x: DynamicCache(ddp_cache_data, config=...), cache.layers[i].keys/.values, forward kwarg `cache`
# (`past_key_values` is deprecated in 5.24). Keep every such call in these three functions.
_CACHE_KWARG = "cache"


def _make_hf_cache(model, layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    from transformers import DynamicCache

    config = None if model is None else model.config
    if layers:
        return DynamicCache(layers, config=config)
    return DynamicCache(config=config)


def _read_hf_cache(hf_cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = getattr(hf_cache, "layers", None)
    if layers is None:
        raise KVCommError(f"unsupported cache object {type(hf_cache).__name__} (transformers {PINNED_TRANSFORMERS} API)")
    return [layer.keys for layer in layers], [layer.values for layer in layers]


def hf_cache_kwargs(hf_cache) -> dict:
    """Keyword arguments that hand ``hf_cache`` to ``model(...)`` or ``model.generate(...)``."""
    return {_CACHE_KWARG: hf_cache}


def hf_forward(model, ids: torch.Tensor, position_ids: torch.Tensor, hf_cache, *, last_only: bool = False):
    """One forward of ``ids`` [1, n] at ``position_ids`` [1, n], appending to ``hf_cache``; returns logits
    ([1, n, vocab], or [1, 1, vocab] with ``last_only``: what a serving engine's prefill computes, the
    last row only; for SmolLM2 the lm_head over every prompt row is ~27 % more work per token)."""
    device = model.get_input_embeddings().weight.device
    keep = {"logits_to_keep": 1} if last_only else {}
    out = model(input_ids=ids.to(device), position_ids=position_ids.to(device), use_cache=True,
                **{_CACHE_KWARG: hf_cache}, **keep)
    return out.logits


# ---- helpers ------------------------------------------------------------------------------------------
def _as_ids(ids) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).cpu()  # bookkeeping on CPU; hf_forward moves to the model
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[0] != 1:
        raise KVCommError(f"token ids must be [n] or [1, n] (batch 1); got shape {tuple(t.shape)}")
    return t


def _as_positions(positions, start: int, n: int) -> torch.Tensor:
    if positions is None:
        return torch.arange(start, start + n)
    p = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    if p.numel() != n:
        raise KVCommError(f"{p.numel()} positions for {n} tokens")
    return p


@torch.no_grad()
def prefill(model, ids, positions=None) -> tuple[KVCache, torch.Tensor]:
    """Encode ``ids`` from scratch at ``positions`` (default ``0..n-1``).

    Returns:
        ``(cache, logits)`` with logits [1, n, vocab].
    """
    ids = _as_ids(ids)
    pos = _as_positions(positions, 0, ids.shape[1])
    hf = _make_hf_cache(model)  # an (empty) cache object keeps the mask index-causal, see module doc
    logits = hf_forward(model, ids, pos.unsqueeze(0), hf)
    return KVCache.from_hf(hf, positions=pos, token_ids=ids[0]), logits


@torch.no_grad()
def continue_from(model, cache: KVCache, ids, positions=None, *, last_only: bool = False) -> tuple[KVCache, torch.Tensor]:
    """Append ``ids`` after ``cache`` (positions default to ``cache.next_position + 0..n-1``).

    ``cache`` is not modified. Returns ``(extended cache, logits [1, n, vocab])``, or [1, 1, vocab] with
    ``last_only`` (the last row: all a receiver's prefill needs).
    """
    ids = _as_ids(ids)
    pos = _as_positions(positions, cache.next_position, ids.shape[1])
    hf = cache.to_hf(model)
    logits = hf_forward(model, ids, pos.unsqueeze(0), hf, last_only=last_only)
    token_ids = None if cache.token_ids is None else torch.cat([cache.token_ids, ids[0]])
    return KVCache.from_hf(hf, positions=torch.cat([cache.positions, pos]), token_ids=token_ids), logits


@torch.no_grad()
def greedy_generate(model, cache: KVCache, ids, max_new_tokens: int,
                    eos_token_id: int | None = None) -> tuple[list[int], KVCache, torch.Tensor]:
    """Greedy decoding: feed ``ids`` after ``cache``, then up to ``max_new_tokens`` argmax tokens.

    One transformers cache object is kept for the whole decode (no per-token copies).

    Returns:
        ``(new token ids, final cache, logits [num_new, vocab])`` where row i is the distribution the
        i-th new token was drawn from. The final cache holds every fed token (the last new token is
        not fed).
    """
    if max_new_tokens < 1:
        raise KVCommError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    ids = _as_ids(ids)
    next_pos = cache.next_position
    hf = cache.to_hf(model)
    fed_positions = [cache.positions]
    fed_ids = [cache.token_ids] if cache.token_ids is not None else None
    step_ids = ids
    new_tokens: list[int] = []
    rows = []
    for _ in range(max_new_tokens):
        pos = torch.arange(next_pos, next_pos + step_ids.shape[1])
        logits = hf_forward(model, step_ids, pos.unsqueeze(0), hf, last_only=True)
        fed_positions.append(pos)
        if fed_ids is not None:
            fed_ids.append(step_ids[0])
        next_pos += step_ids.shape[1]
        row = logits[0, -1]
        rows.append(row)
        token = int(row.argmax())
        new_tokens.append(token)
        if eos_token_id is not None and token == eos_token_id:
            break
        step_ids = torch.tensor([[token]])
    final = KVCache.from_hf(hf, positions=torch.cat(fed_positions),
                            token_ids=None if fed_ids is None else torch.cat(fed_ids))
    return new_tokens, final, torch.stack(rows) if rows else torch.empty(0)
