"""Re-rotation of cached keys to new positions (RoPE is a rotation, and rotations compose).

HF convention, per rotated pair (i, i + rotary_dim/2) of a head::

    k_m = k·cos(m·θ) + rotate_half(k)·sin(m·θ),   rotate_half(x) = cat(-x2, x1),  θ = inv_freq

so moving a key from position m to m + Δ is ``k·cos(Δθ) + rotate_half(k)·sin(Δθ)``. Values are not
rotated; GQA changes nothing (we operate on the KV heads as stored). With partial rotary
(``rotary_dim < head_dim``) only the leading ``rotary_dim`` dims rotate, the rest pass through.

The angle Δ·θ is formed in float64 (Δ can be thousands, θ small) and the rotation itself runs in
fp32 whatever the cache dtype, then casts back. This is exact where the model's angle is linear in
position with a position-independent ``inv_freq``: ``default``, ``linear``, ``llama3`` and ``yarn``
(which rescale ``inv_freq`` once). yarn and longrope also multiply cos/sin by a constant attention
factor s; the rotation tables here are unscaled, and a rotation commutes with s, so the stored key
s·R(mθ)k moves to s·R((m+Δ)θ)k exactly. ``dynamic`` and ``longrope`` change ``inv_freq`` once the
sequence passes a length (``RopeInfo.switch_position``): re-rotation is exact while every source
and target position stays below it, and refused with ``KVCommError`` past it (or when the
positions cannot be checked, on a bare keys tensor).
"""
from __future__ import annotations

import torch

from common.errors import KVCommError
from kvcomm.cache import KVCache
from kvcomm.models import RELATIVE_ROPE_TYPES, SWITCHING_ROPE_TYPES, RopeInfo, rope_info


def check_relative(rope_type: str, max_position: int | None = None, switch_position: int | None = None) -> None:
    """Raise ``KVCommError`` unless re-rotating by Δ is exact for this rope type and these positions.

    ``max_position``: the largest source or target position involved (None: not known);
    ``switch_position``: the sequence length past which a ``dynamic``/``longrope`` model changes
    ``inv_freq`` (positions 0 .. switch_position - 1 use the regime re-rotation is given).
    """
    if rope_type in RELATIVE_ROPE_TYPES:
        return
    supported = ", ".join(RELATIVE_ROPE_TYPES + tuple(f"{t} (below its switch point)" for t in SWITCHING_ROPE_TYPES))
    if rope_type not in SWITCHING_ROPE_TYPES:
        raise KVCommError(f"rope type '{rope_type}' is not known to be relative-position invariant; "
                          f"re-rotation supports {supported}")
    if switch_position is None or max_position is None:
        raise KVCommError(f"rope type '{rope_type}' changes inv_freq with the sequence length: re-rotation needs "
                          f"the cache's positions and the model's switch point to check them (pass a KVCache and RopeInfo)")
    if max_position >= switch_position:
        raise KVCommError(f"rope type '{rope_type}' switches inv_freq past sequence length {switch_position}: "
                          f"position {max_position} is past it, so re-rotating there is not exact")


def _delta_tensor(delta, num_tokens: int) -> torch.Tensor:
    d = torch.as_tensor(delta, dtype=torch.long).reshape(-1)
    if d.numel() == 1:
        return d.expand(num_tokens)
    if d.numel() != num_tokens:
        raise KVCommError(f"need one Δ per token: {d.numel()} deltas for {num_tokens} tokens")
    return d


def rotation_tables(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of Δ·θ as fp32 [tokens, rotary_dim // 2] (angles formed in float64)."""
    angles = delta.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply half-width rotation tables to keys [batch, kv_heads, tokens, head_dim], computing in fp32.

    Per pair (x1, x2) = (k[i], k[i + rotary_dim/2]): (x1·cos − x2·sin, x2·cos + x1·sin), which is
    ``k·cos + rotate_half(k)·sin`` written without materializing ``rotate_half(k)``.
    """
    half = cos.shape[-1]
    k = keys.to(torch.float32)
    x1, x2 = k[..., :half], k[..., half: 2 * half]
    out = torch.empty_like(k)
    torch.mul(x1, cos, out=out[..., :half])
    out[..., :half].addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out[..., half: 2 * half])
    out[..., half: 2 * half].addcmul_(x1, sin)
    if k.shape[-1] > 2 * half:
        out[..., 2 * half:] = k[..., 2 * half:]  # partial rotary: the rest passes through
    return out.to(keys.dtype)


def rerotate(cache_or_keys, delta, inv_freq, *, rope_type: str = "default", switch_position: int | None = None):
    """Move cached keys by ``delta`` positions (a scalar or one Δ per token).

    Args:
        cache_or_keys: a ``KVCache`` (every layer's keys rotated, values untouched, positions += Δ) or
            a keys tensor [batch, kv_heads, tokens, head_dim].
        delta: int, or a [tokens] tensor of per-token shifts (may be negative).
        inv_freq: the model's own inverse frequencies, a ``RopeInfo`` (its rope type is checked), or
            the model itself. Its length sets the rotary dim (partial rotary rotates the leading dims).
        rope_type, switch_position: checked when ``inv_freq`` is a bare tensor.

    Returns:
        The same kind of object as ``cache_or_keys``, with keys in their original dtype.

    Raises:
        KVCommError: a rope type where relative invariance breaks, or mismatched shapes.
    """
    if isinstance(inv_freq, torch.nn.Module):
        inv_freq = rope_info(inv_freq)
    if isinstance(inv_freq, RopeInfo):
        rope_type, switch_position, inv_freq = inv_freq.rope_type, inv_freq.switch_position, inv_freq.inv_freq
    is_cache = isinstance(cache_or_keys, KVCache)
    first_keys = cache_or_keys.keys[0] if is_cache else cache_or_keys
    num_tokens, head_dim = first_keys.shape[-2], first_keys.shape[-1]
    if 2 * inv_freq.numel() > head_dim:
        raise KVCommError(f"rotary dim {2 * inv_freq.numel()} exceeds head_dim {head_dim}")
    d = _delta_tensor(delta, num_tokens)
    max_position = None
    if is_cache and num_tokens:
        max_position = int(max(cache_or_keys.positions.max(), (cache_or_keys.positions + d).max()))
    check_relative(rope_type, max_position, switch_position)
    cos, sin = rotation_tables(d.cpu(), inv_freq.cpu())  # tiny tables: build on CPU, then move
    cos, sin = cos.to(first_keys.device), sin.to(first_keys.device)
    if not is_cache:
        return rotate_keys(cache_or_keys, cos, sin)
    return KVCache(
        keys=[rotate_keys(k, cos, sin) for k in cache_or_keys.keys],
        values=list(cache_or_keys.values),
        positions=cache_or_keys.positions + d,
        token_ids=cache_or_keys.token_ids,
    )


def reposition(cache: KVCache, new_positions, inv_freq) -> KVCache:
    """Re-rotate ``cache`` so its tokens sit at ``new_positions`` (an int start, or one per token)."""
    if isinstance(new_positions, int):
        new_positions = torch.arange(new_positions, new_positions + cache.num_tokens)
    target = torch.as_tensor(new_positions, dtype=torch.long).reshape(-1)
    if target.numel() != cache.num_tokens:
        raise KVCommError(f"{target.numel()} new positions for {cache.num_tokens} cached tokens")
    return rerotate(cache, target - cache.positions, inv_freq)
