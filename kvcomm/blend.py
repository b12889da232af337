"""CacheBlend: fuse independently precomputed chunk caches, recomputing only the tokens that matter.

Layout of the fused sequence (positions 0..S-1, causal by index)::

    [ prefix (optional, exact) | chunk 1 | chunk 2 | ... | chunk m | query ]
      <----------------- context: N tokens ------------------------>  <-Q->

1. Every chunk's cached K is re-rotated to its place in the fused sequence (``kvcomm.rope``); the
   prefix, if any, is already in place. These re-rotated caches are the *base* KV of every layer.
2. Selection pass: layers ``0 .. check_layer-1`` run in full over all chunk and query tokens (each
   attends to the fresh K/V of the computed tokens); at ``check_layer`` we project V for every token
   and rank chunk tokens by **value deviation**, ``Σ_heads,dims (V_fresh − V_cached)²``, as the
   CacheBlend reference code does (values need no re-rotation, so the comparison is exact).
3. Keep the top ``round(ratio · num_chunk_tokens)`` chunk tokens plus the whole query suffix.
4. Main pass: every layer recomputes Q/K/V, attention and MLP for the selected tokens only; they attend
   over all S tokens, with fresh K/V at the selected slots and the base (re-rotated cached) K/V
   everywhere else; the recomputed K/V are written into the fused cache.

So ``ratio = 1`` is a full prefill of the concatenated tokens, and ``ratio = 0`` is pure re-rotated
reuse (the query attends to re-rotated chunk caches at every layer), both exactly up to float
rounding. The decoder layers run by hand (embed, per-layer norms, q/k/v/o projections, rotary
embedding and MLP, all the model's own modules) because transformers has no "compute these rows,
attend to all" forward; supported families: Llama, Mistral, Qwen2 (full rotary, no sliding window).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.errors import KVCommError
from kvcomm.cache import KVCache
from kvcomm.models import rope_info
from kvcomm.rope import reposition

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class BlendResult:
    """What ``blend_prefill`` produced.

    Attributes:
        cache: fused KVCache of [prefix, chunks..., query] at positions 0..S-1 (continue decoding from it).
        logits: [1, Q, vocab] at the query tokens.
        recomputed_per_layer: per layer, tokens whose K/V were recomputed (selected chunk tokens + query).
        selected_indices: sorted fused-sequence indices of the recomputed chunk tokens.
        deviation: [num_chunk_tokens] value deviation at the check layer (chunk tokens in order).
        num_context_tokens: N (prefix + chunk tokens).
    """

    cache: KVCache
    logits: torch.Tensor
    recomputed_per_layer: list[int]
    selected_indices: torch.Tensor
    deviation: torch.Tensor
    num_context_tokens: int


def _check_model(model) -> None:
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise KVCommError(f"blend supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not '{config.model_type}'")
    if getattr(config, "use_sliding_window", False):
        raise KVCommError("blend does not support sliding-window attention")
    info = rope_info(model)
    if info.rotary_dim != info.head_dim:
        raise KVCommError(f"blend needs full rotary (rotary dim {info.rotary_dim} != head_dim {info.head_dim})")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _run_layer(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
               base_k: torch.Tensor, base_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer for the tokens at fused indices ``rows`` (hidden ``h`` [1, n, hidden]).

    Their fresh K/V replace the base K/V at ``rows``; their queries attend causally (by fused index)
    over all S tokens. Returns ``(h_out, k_all, v_all)`` with k_all/v_all [1, kv_heads, S, head_dim].
    """
    attn = layer.self_attn
    n, head_dim = h.shape[1], attn.head_dim
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(1, n, -1, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(1, n, -1, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(1, n, -1, head_dim).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k_all, v_all = base_k.clone(), base_v.clone()
    k_all[:, :, rows] = k.to(k_all.dtype)
    v_all[:, :, rows] = v.to(v_all.dtype)
    allowed = (torch.arange(k_all.shape[2])[None, :] <= rows[:, None]).to(q.device)  # [n, S]
    out = F.scaled_dot_product_attention(q, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask=allowed,
                                         scale=attn.scaling, enable_gqa=q.shape[1] != k_all.shape[1])
    h = h + attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, k_all, v_all


def _layout(chunk_caches: Sequence[KVCache], prefix: KVCache | None, info) -> tuple[KVCache, int]:
    """Base cache of the context: prefix as is, chunks re-rotated to follow one another."""
    for i, c in enumerate(chunk_caches):
        if c.token_ids is None:
            raise KVCommError(f"chunk cache {i} has no token ids (build it with kvcomm.cache.prefill)")
    pieces = [] if prefix is None else [prefix]
    start = 0 if prefix is None else prefix.num_tokens
    if prefix is not None and (prefix.token_ids is None or not torch.equal(prefix.positions, torch.arange(start))):
        raise KVCommError("the prefix cache must hold token ids and sit at positions 0..P-1")
    for c in chunk_caches:
        pieces.append(reposition(c, start, info))
        start += c.num_tokens
    return KVCache.concat(pieces), (0 if prefix is None else prefix.num_tokens)


@torch.no_grad()
def blend_prefill(model, chunk_caches: Sequence[KVCache], query_ids, ratio: float = 0.15,
                  check_layer: int = 1, *, prefix: KVCache | None = None) -> BlendResult:
    """Fused CacheBlend prefill of ``[prefix, chunks..., query]`` (see the module docstring).

    Args:
        model: a Llama/Mistral/Qwen2 causal LM.
        chunk_caches: each chunk's KVCache, encoded on its own (at positions from 0, or right after
            ``prefix``); must carry token ids.
        query_ids: the query suffix, [Q] or [1, Q]; always recomputed.
        ratio: fraction r of chunk tokens to recompute (0..1).
        check_layer: layer whose value deviation ranks tokens (0 <= check_layer < num_layers).
        prefix: an optional shared prefix cache at positions 0..P-1 (exact, never recomputed).

    Raises:
        KVCommError: unsupported model or rope type, bad ratio/check layer, caches without token ids.
    """
    _check_model(model)
    if not 0.0 <= ratio <= 1.0:
        raise KVCommError(f"ratio must be within [0, 1] (got {ratio})")
    layers = model.model.layers
    if not 0 <= check_layer < len(layers):
        raise KVCommError(f"check layer {check_layer} outside 0..{len(layers) - 1}")
    if not chunk_caches:
        raise KVCommError("blend needs at least one chunk cache")
    query = torch.as_tensor(query_ids, dtype=torch.long).reshape(-1)
    base, num_prefix = _layout(chunk_caches, prefix, rope_info(model))
    num_context, num_query = base.num_tokens, query.numel()
    if num_query == 0:
        raise KVCommError("the query suffix must hold at least one token")
    assert base.token_ids is not None  # _layout refuses a chunk without token ids
    ids = torch.cat([base.token_ids, query])
    positions = torch.arange(num_context + num_query)
    extend = base.keys[0].new_zeros(1, base.keys[0].shape[1], num_query, base.keys[0].shape[3])
    base_k = [torch.cat([k, extend], dim=2) for k in base.keys]  # query slots are always overwritten
    base_v = [torch.cat([v, extend], dim=2) for v in base.values]
    embed, rotary = model.model.embed_tokens, model.model.rotary_emb
    device = embed.weight.device  # index bookkeeping stays on CPU; activations live with the model

    def embed_rows(rows: torch.Tensor) -> torch.Tensor:
        return embed(ids[rows].unsqueeze(0).to(device))

    def rope_tables(rows: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(h, positions[rows].unsqueeze(0).to(device))

    # --- selection pass: layers < check_layer in full, V at the check layer for every computed token
    computed = torch.arange(num_prefix, num_context + num_query)
    h = embed_rows(computed)
    cos, sin = rope_tables(computed, h)
    for layer_idx in range(check_layer):
        h, _, _ = _run_layer(layers[layer_idx], h, cos, sin, computed, base_k[layer_idx], base_v[layer_idx])
    check = layers[check_layer]
    v_fresh = check.self_attn.v_proj(check.input_layernorm(h))
    v_fresh = v_fresh.view(1, h.shape[1], -1, check.self_attn.head_dim).transpose(1, 2)
    num_chunk = num_context - num_prefix
    cached_v = base.values[check_layer][:, :, num_prefix:]
    deviation = ((v_fresh[:, :, :num_chunk].float() - cached_v.float().to(device)) ** 2).sum(dim=(0, 1, 3)).cpu()
    num_keep = int(round(ratio * num_chunk))
    top = torch.topk(deviation, num_keep).indices if num_keep else torch.empty(0, dtype=torch.long)
    selected = torch.sort(top + num_prefix).values

    # --- main pass: recompute selected chunk tokens + query at every layer
    rows = torch.cat([selected, torch.arange(num_context, num_context + num_query)])
    h = embed_rows(rows)
    cos, sin = rope_tables(rows, h)
    fused_k, fused_v = [], []
    for layer_idx, layer in enumerate(layers):
        h, k_all, v_all = _run_layer(layer, h, cos, sin, rows, base_k[layer_idx], base_v[layer_idx])
        fused_k.append(k_all)
        fused_v.append(v_all)
    logits = model.lm_head(model.model.norm(h[:, -num_query:]))
    cache = KVCache(keys=fused_k, values=fused_v, positions=positions, token_ids=ids)
    return BlendResult(cache=cache, logits=logits, recomputed_per_layer=[int(rows.numel())] * len(layers),
                       selected_indices=selected, deviation=deviation, num_context_tokens=num_context)


def reuse_prefill(model, chunk_caches: Sequence[KVCache], query_ids, *,
                  prefix: KVCache | None = None) -> tuple[KVCache, torch.Tensor]:
    """Pure re-rotated reuse (no recompute), through transformers' own forward: the r = 0 reference.

    Returns ``(fused cache, query logits [1, Q, vocab])``.
    """
    from kvcomm.cache import continue_from

    base, _ = _layout(chunk_caches, prefix, rope_info(model))
    return continue_from(model, base, query_ids)
