"""Anchor offsets for composing several senders' caches (KVComm-style).

A later sender's message, re-encoded in B's frame (``protocols.reencode_in_receiver_frame``), did not
attend to the earlier senders' messages that precede it in B's prompt, so its K/V deviate from what
B's own prefill would compute. KVComm's observation is that such deviations are similar for similar
tokens in similar places, so they can be estimated from *anchors*: examples, never the scored ones,
for which both the re-encoded span and B's exact prefill were computed once.

The pool keeps, per layer and KV head, every anchor token's re-encoded key and its exact deviation
(key deviation and key both rotated back to position 0, so that anchors at other positions compare;
values are not rotated). For a span to import, each token's deviation is the softmax-weighted mean
of its ``k`` nearest anchor tokens' deviations (L2 distance between keys at position 0; temperature:
the median distance of those neighbours), added to the re-encoded K/V at B's positions. Layer 0 has
no deviation (its K/V depend on the token alone) and gets none. The first sender's span needs no
offset: B's frame is exactly what precedes it.

The search is what costs: every layer compares each imported token with every anchor token. Anchor
tokens are the same tokens at every layer, so ``search_once`` finds each token's neighbours at the
middle layer only and every layer gathers its own deviations at those indices
(``kv-own-anchored-once``): one search per span instead of one per layer, and the same search
decides the prefill fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import KVCommError
from kvcomm.cache import KVCache, prefill
from kvcomm.models import RopeInfo, rope_info
from kvcomm.rope import reposition, rerotate, rotate_keys, rotation_tables

DEFAULT_NEIGHBOURS = 8
# kv-own-anchored's prefill fallback: a span whose tokens sit farther from their nearest anchors than
# this quantile of the anchor examples' own spans (each measured against the other examples) is
# prefilled by B instead (KVCOMM falls back to prefill when no anchor matches).
FALLBACK_QUANTILE = 0.95


@dataclass(frozen=True)
class AnchorPool:
    """Anchor tokens per layer: keys at position 0 [kv_heads, M, d], their key and value deviations."""

    keys: list[torch.Tensor | None]  # None at layer 0
    key_offsets: list[torch.Tensor | None]
    value_offsets: list[torch.Tensor | None]
    num_examples: int
    num_tokens: int
    neighbours: int = DEFAULT_NEIGHBOURS
    # own-cache pools only: the mean nearest-anchor distance above which a span falls back to prefill
    fallback_distance: float | None = None


def span_deviations(model, layout, senders, rope, own: bool = False):
    """For each sender after the first (``own``: every sender): (shipped keys at position 0, key
    deviation at position 0, value deviation), per layer, against B's exact prefill of ``layout``.
    The shipped span is the re-encoded one, or with ``own`` the sender's own cache."""
    exact, _ = prefill(model, layout.ids)
    out = []
    for i, sender in enumerate(senders):
        if i == 0 and not own:
            continue  # its re-encoded span already is B's prefill
        if not own and sender.reencoded is None:
            raise KVCommError("anchors need the senders' re-encoded spans (reencode_in_receiver_frame)")
        start, n = layout.import_starts[i], len(sender.message_ids)
        truth = exact.slice(start, start + n)
        placed = reposition(sender.cache if own else sender.reencoded, start, rope)
        back = -torch.arange(start, start + n)  # rotate to position 0
        out.append(([rerotate(k, back, rope)[0] for k in placed.keys],
                    [rerotate(t - k, back, rope)[0] for t, k in zip(truth.keys, placed.keys)],
                    [t[0] - v[0] for t, v in zip(truth.values, placed.values)]))
    return out


def pool_from_spans(spans, num_examples: int, neighbours: int = DEFAULT_NEIGHBOURS) -> AnchorPool:
    """Concatenate per-span (keys, key deviations, value deviations) into a pool."""
    if neighbours < 1:
        raise KVCommError(f"the anchor neighbour count must be >= 1 (got {neighbours})")
    if not spans:
        raise KVCommError("no anchor spans: anchors come from examples with two or more senders")
    num_layers = len(spans[0][0])

    def cat(part: int, layer: int):
        return None if layer == 0 else torch.cat([s[part][layer] for s in spans], dim=1)

    return AnchorPool(keys=[cat(0, layer) for layer in range(num_layers)],
                      key_offsets=[cat(1, layer) for layer in range(num_layers)],
                      value_offsets=[cat(2, layer) for layer in range(num_layers)],
                      num_examples=num_examples, num_tokens=sum(s[0][0].shape[1] for s in spans), neighbours=neighbours)


def _probe_layer(num_layers: int) -> int:
    """The layer whose nearest-anchor distance decides the fallback: the middle one."""
    return num_layers // 2


@dataclass(frozen=True)
class AnchorSearch:
    """One span's nearest anchors at the probe layer, reused by every layer: indices and softmax
    weights [kv_heads, n, k], and the mean distance to the nearest anchor (the fallback's measure)."""

    indices: torch.Tensor
    weights: torch.Tensor
    mean_nearest: float


def mean_anchor_distance(keys_at_zero: torch.Tensor, anchors: torch.Tensor) -> float:
    """Mean over heads and tokens of the distance from each key [H, n, d] to its nearest anchor [H, M, d]."""
    return float(torch.cdist(keys_at_zero, anchors).min(dim=-1).values.mean())


def own_pool(spans_per_example: list[list], neighbours: int = DEFAULT_NEIGHBOURS) -> AnchorPool:
    """kv-own-anchored's pool: every example's spans, and the fallback distance, the
    ``FALLBACK_QUANTILE`` of each anchor span's mean nearest-anchor distance to the *other* examples'
    anchors at the probe layer (so a span as familiar as a typical anchor is not sent to prefill)."""
    flat = [span for spans in spans_per_example for span in spans]
    pool = pool_from_spans(flat, len(spans_per_example), neighbours)
    probe = _probe_layer(len(flat[0][0]))
    distances = []
    for i, spans in enumerate(spans_per_example):
        others = [s[0][probe] for j, ex in enumerate(spans_per_example) if j != i for s in ex]
        if not others:
            continue
        rest = torch.cat(others, dim=1)
        distances += [mean_anchor_distance(s[0][probe], rest) for s in spans]
    limit = float(torch.tensor(distances).quantile(FALLBACK_QUANTILE)) if distances else float("inf")
    return AnchorPool(keys=pool.keys, key_offsets=pool.key_offsets, value_offsets=pool.value_offsets,
                      num_examples=pool.num_examples, num_tokens=pool.num_tokens, neighbours=neighbours,
                      fallback_distance=limit)


def falls_back(pool: AnchorPool, span: KVCache, rope) -> bool:
    """Whether no anchor matches ``span`` (a sender's own K/V at its own positions): its mean
    nearest-anchor distance at the probe layer, keys rotated to position 0, exceeds the pool's limit."""
    return pool.fallback_distance is not None and falls_back_after(pool, search_once(pool, span, rope))


def _probe_keys(pool: AnchorPool, span: KVCache, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's anchor keys at the probe layer and ``span``'s keys there, rotated to position 0."""
    probe = _probe_layer(span.num_layers)
    anchors = pool.keys[probe]
    assert anchors is not None  # the probe layer is never 0 for a model with two or more layers
    return anchors, rerotate(span.keys[probe], -span.positions, rope)[0]


def search_once(pool: AnchorPool, span: KVCache, rope) -> AnchorSearch:
    """``span``'s (a sender's own K/V at its own positions) nearest anchors at the probe layer."""
    anchors, at_zero = _probe_keys(pool, span, rope)
    dist, idx, weights = _neighbours(at_zero, anchors, pool.neighbours)
    return AnchorSearch(indices=idx, weights=weights, mean_nearest=float(dist[..., 0].mean()))


def falls_back_after(pool: AnchorPool, search: AnchorSearch) -> bool:
    """``falls_back`` for a span already searched (its nearest distances come with the search)."""
    return pool.fallback_distance is not None and search.mean_nearest > pool.fallback_distance


def _neighbours(queries: torch.Tensor, anchors: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query token [H, n, d]: its k nearest anchors' distances and indices [H, n, k] (nearest
    first) and softmax weights."""
    k = min(k, anchors.shape[1])
    dist, idx = torch.cdist(queries, anchors).topk(k, dim=-1, largest=False)
    return dist, idx, torch.softmax(-dist / dist.median().clamp_min(1e-12), dim=-1)


def _weighted(offsets: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted mean of the picked anchors' offsets [H, M, d] -> [H, n, d]."""
    heads, n, k = idx.shape
    picked = torch.gather(offsets, 1, idx.reshape(heads, n * k, 1).expand(-1, -1, offsets.shape[-1]))
    return (weights.unsqueeze(-1) * picked.reshape(heads, n, k, -1)).sum(dim=2)


@torch.no_grad()
def anchored_span(pool: AnchorPool | None, sender_index: int, reencoded: KVCache, start: int, rope,
                  offset_first: bool = False, search: AnchorSearch | None = None) -> KVCache:
    """The shipped span placed at B's positions from ``start``, with the anchors' offset added (none
    for the first sender's re-encoded span, which is exact; ``offset_first``: the sender's own cache,
    where the first sender's span deviates too). With ``search`` (``search_once``) every layer uses
    its neighbours; without, each layer searches its own."""
    placed = reposition(reencoded, start, rope)
    if sender_index == 0 and not offset_first:
        return placed
    if pool is None:
        raise KVCommError("anchored protocols need an anchor pool (kvcomm eval builds it)")
    if len(pool.keys) != placed.num_layers:
        raise KVCommError(f"the anchor pool has {len(pool.keys)} layers, the span {placed.num_layers}")
    # Every layer rotates by the same angles: the tables are built once per span, not twice per layer
    # (reposition above already checked that this rope type allows re-rotation).
    positions = torch.arange(start, start + placed.num_tokens)
    inv_freq = rope.inv_freq if isinstance(rope, RopeInfo) else rope_info(rope).inv_freq if isinstance(rope, torch.nn.Module) else rope
    device = placed.keys[0].device
    to_zero = [t.to(device) for t in rotation_tables(-positions, inv_freq.cpu())]
    to_place = [t.to(device) for t in rotation_tables(positions, inv_freq.cpu())]
    keys, values = [placed.keys[0]], [placed.values[0]]
    for layer in range(1, placed.num_layers):
        anchor_keys, key_offsets, value_offsets = pool.keys[layer], pool.key_offsets[layer], pool.value_offsets[layer]
        assert anchor_keys is not None and key_offsets is not None and value_offsets is not None  # layer > 0
        if search is not None:
            idx, weights = search.indices, search.weights
        else:
            at_zero = rotate_keys(placed.keys[layer], *to_zero)[0]
            _, idx, weights = _neighbours(at_zero, anchor_keys, pool.neighbours)  # one search for K and V
        key_offset, value_offset = _weighted(key_offsets, idx, weights), _weighted(value_offsets, idx, weights)
        keys.append(placed.keys[layer] + rotate_keys(key_offset.unsqueeze(0), *to_place))
        values.append(placed.values[layer] + value_offset.unsqueeze(0))
    return KVCache(keys=keys, values=values, positions=placed.positions, token_ids=placed.token_ids)
