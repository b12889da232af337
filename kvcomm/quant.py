"""Reversible asymmetric 8-bit KV quantization (KIVI-style grouping).

Grouping (``[batch, kv_heads, tokens, head_dim]`` caches):

- keys per channel: for each (batch, kv head, channel), groups of ``group_size`` consecutive tokens
  (default 128). Keys have outlier *channels*, so each channel gets its own range.
- values per token: for each (batch, token), groups of ``value_group_size`` consecutive channels of
  the token's flattened ``kv_heads·head_dim`` vector (default ``None``: the whole vector, 192 for
  SmolLM2).

Each group stores ``zero = min`` and ``scale = (max − min)/255``, both **float32**, and a uint8
payload ``q = round((x − min)/scale)``; ``x̂ = min + q·scale``. Hence ``|x − x̂| ≤ scale/2 =
(max − min)/510`` per group (up to fp32 rounding of the reconstruction, ~1 ulp of |x|). fp32
parameters keep that bound for groups whose offset dwarfs their range (slow-rotating key channels),
which fp16 parameters cannot. Storage per group is ``G + 8`` bytes, so at the default group sizes the
ratio is 4·128/136 = 3.76× vs fp32 and 1.88× vs bf16 for keys (when tokens fill whole groups), and
4·192/200 = 3.84× / 1.92× for SmolLM2's values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.errors import KVCommError
from kvcomm.cache import KVCache

DEFAULT_GROUP_SIZE = 128
PARAM_DTYPE = torch.float32
_LEVELS = 255


@dataclass
class QuantizedTensor:
    """A tensor quantized in groups along its last dim (``payload`` is in that grouped layout)."""

    payload: torch.Tensor  # uint8 [..., n]
    scale: torch.Tensor  # fp32 [..., num_groups]
    zero: torch.Tensor  # fp32 [..., num_groups] (the group minimum)
    group_size: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.payload, self.scale, self.zero))

    @property
    def numel(self) -> int:
        return self.payload.numel()


def quantize_groups(x: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Quantize ``x`` in groups of ``group_size`` along its last dim (a shorter last group if needed)."""
    if group_size < 1:
        raise KVCommError(f"group size must be >= 1 (got {group_size})")
    xf = x.to(torch.float32)
    n = xf.shape[-1]
    num_groups = math.ceil(n / group_size)
    pad = num_groups * group_size - n
    if pad:
        # replicate the last element: it does not change the last group's min or max
        xf = torch.cat([xf, xf[..., -1:].expand(*xf.shape[:-1], pad)], dim=-1)
    groups = xf.reshape(*xf.shape[:-1], num_groups, group_size)
    lo = groups.amin(dim=-1)
    hi = groups.amax(dim=-1)
    scale = (hi - lo) / _LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: q = 0, x̂ = min
    q = torch.round((groups - lo[..., None]) / safe[..., None]).clamp_(0, _LEVELS).to(torch.uint8)
    payload = q.reshape(*xf.shape[:-1], num_groups * group_size)[..., :n].contiguous()
    return QuantizedTensor(payload=payload, scale=scale.to(PARAM_DTYPE), zero=lo.to(PARAM_DTYPE),
                           group_size=group_size, dtype=x.dtype)


def dequantize_groups(qt: QuantizedTensor) -> torch.Tensor:
    """Inverse of ``quantize_groups`` (in fp32, cast to the original dtype)."""
    n = qt.payload.shape[-1]
    scale = qt.scale.to(torch.float32).repeat_interleave(qt.group_size, dim=-1)[..., :n]
    zero = qt.zero.to(torch.float32).repeat_interleave(qt.group_size, dim=-1)[..., :n]
    return (zero + qt.payload.to(torch.float32) * scale).to(qt.dtype)


def _keys_layout(k: torch.Tensor) -> torch.Tensor:
    """[b, h, t, d] -> [b, h, d, t]: groups run along tokens, per channel."""
    return k.transpose(-1, -2)


def _values_layout(v: torch.Tensor) -> torch.Tensor:
    """[b, h, t, d] -> [b, t, h·d]: groups run along a token's channels."""
    b, h, t, d = v.shape
    return v.permute(0, 2, 1, 3).reshape(b, t, h * d)


@dataclass
class QuantizedKVCache:
    """An 8-bit ``KVCache``: per layer, quantized keys ([b, h, d, t] grouped on t) and values ([b, t, h·d])."""

    keys: list[QuantizedTensor]
    values: list[QuantizedTensor]
    positions: torch.Tensor
    token_ids: torch.Tensor | None
    kv_heads: int
    head_dim: int

    @property
    def nbytes(self) -> int:
        """Payload + scales + zero points, every layer."""
        return sum(q.nbytes for q in (*self.keys, *self.values))

    @property
    def num_elements(self) -> int:
        return sum(q.numel for q in (*self.keys, *self.values))

    def compression_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        """Bytes the cache takes in ``dtype`` divided by the bytes it takes quantized."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_elements * itemsize / self.nbytes


def quantize(cache: KVCache, group_size: int = DEFAULT_GROUP_SIZE,
             value_group_size: int | None = None) -> QuantizedKVCache:
    """Quantize every layer of ``cache`` (keys per channel, values per token); see module docstring."""
    _, kv_heads, _, head_dim = cache.keys[0].shape
    vgs = value_group_size or kv_heads * head_dim
    return QuantizedKVCache(
        keys=[quantize_groups(_keys_layout(k), group_size) for k in cache.keys],
        values=[quantize_groups(_values_layout(v), vgs) for v in cache.values],
        positions=cache.positions.clone(),
        token_ids=None if cache.token_ids is None else cache.token_ids.clone(),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
    )


def dequantize(qcache: QuantizedKVCache) -> KVCache:
    """Back to a ``KVCache`` in the original dtype."""
    keys = [dequantize_groups(q).transpose(-1, -2).contiguous() for q in qcache.keys]
    values = []
    for q in qcache.values:
        flat = dequantize_groups(q)
        b, t, _ = flat.shape
        values.append(flat.reshape(b, t, qcache.kv_heads, qcache.head_dim).permute(0, 2, 1, 3).contiguous())
    return KVCache(keys=keys, values=values, positions=qcache.positions.clone(), token_ids=qcache.token_ids)


@dataclass(frozen=True)
class QuantReport:
    """Accuracy and size of one quantization round trip."""

    mse_keys: float
    mse_values: float
    max_abs_error: float
    quantized_bytes: int
    ratio_vs_fp32: float
    ratio_vs_bf16: float
    bits_per_element: float


def quant_report(cache: KVCache, qcache: QuantizedKVCache | None = None, **quantize_kw) -> QuantReport:
    """MSE, max error and compression of ``cache`` quantized (with ``quantize_kw`` if ``qcache`` is None)."""
    qcache = qcache if qcache is not None else quantize(cache, **quantize_kw)
    back = dequantize(qcache)

    def mse(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        num = sum(float(((x.float() - y.float()) ** 2).sum()) for x, y in zip(a, b))
        return num / sum(x.numel() for x in a)

    max_err = max(float((x.float() - y.float()).abs().max())
                  for x, y in zip((*cache.keys, *cache.values), (*back.keys, *back.values)))
    return QuantReport(
        mse_keys=mse(cache.keys, back.keys),
        mse_values=mse(cache.values, back.values),
        max_abs_error=max_err,
        quantized_bytes=qcache.nbytes,
        ratio_vs_fp32=qcache.compression_ratio(torch.float32),
        ratio_vs_bf16=qcache.compression_ratio(torch.bfloat16),
        bits_per_element=8.0 * qcache.nbytes / qcache.num_elements,
    )
