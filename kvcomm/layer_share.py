"""Selective layer sharing (KVComm, Shi et al. 2025, KTH): the sender ships its message's K/V at a
share of the layers only, and at every other layer B's tokens do not see the message at all.

B's cache still holds a slot for every imported token at every layer (the positions of what follows
do not move), but at a layer that was not shared the attention of every token B computes afterwards
(the question, the answer) masks those slots out: exactly as if the message were absent there. The
mask is applied by an attention function registered with transformers, which a ``hidden`` scope
switches the model to and back; it calls the same SDPA kernel with an explicit boolean mask.

Which layers are shared is chosen as KVComm does, by attention importance: on calibration examples
(another seed, never scored) B takes in the messages as text, and each layer's score is the mean
attention mass that B's question tokens put on the message tokens (mean over heads and question
tokens). The ``SHARED_LAYER_SHARE`` of layers with the highest mass are shared. KVComm also weighs
the scores by a Gaussian prior over depth; this keeps the measured mass alone.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from common.errors import KVCommError

# KVComm shares about 30 % of the layers in its main results.
SHARED_LAYER_SHARE = 0.3
_IMPLEMENTATION = "kvcomm_layer_share"


@dataclass(frozen=True)
class HiddenSpans:
    """Cache slots [start, end) that B's later tokens may not attend to, at ``layers``."""

    layers: frozenset[int]
    spans: tuple[tuple[int, int], ...]


@dataclass
class AttentionMeter:
    """Accumulates, per layer, the attention mass the queries put on ``spans`` (calibration)."""

    spans: tuple[tuple[int, int], ...]
    mass: dict[int, list[float]] = field(default_factory=dict)


_active: list[HiddenSpans | AttentionMeter] = []


def _allowed(query_len: int, key_len: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[1, 1, q, kv] boolean: index-causal (the queries are the last ``query_len`` cache slots) and
    whatever transformers' own mask allows."""
    rows = torch.arange(key_len - query_len, key_len).unsqueeze(1)
    allowed = (torch.arange(key_len).unsqueeze(0) <= rows).view(1, 1, query_len, key_len)
    if attention_mask is not None:
        allowed = allowed & (attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)
    return allowed


def _attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA with the active scope's mask: the hidden spans masked at their layers, or (a meter) the
    attention mass on its spans recorded before the usual output is computed."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = _active[-1] if _active else None
    allowed = _allowed(query.shape[-2], key.shape[-2], attention_mask).to(query.device)
    if isinstance(state, HiddenSpans) and module.layer_idx in state.layers:
        allowed = allowed.clone()
        for start, end in state.spans:
            allowed[..., start:end] = False
    elif isinstance(state, AttentionMeter):
        # only the queries after the last span: B's own tokens reading the messages, not the messages
        first = max(0, max(end for _, end in state.spans) - (key.shape[-2] - query.shape[-2]))
        if first < query.shape[-2]:
            groups = query.shape[1] // key.shape[1]
            keys = key.repeat_interleave(groups, dim=1).transpose(-1, -2)
            scores = query[..., first:, :] @ keys * kwargs.get("scaling", 1.0)
            weights = torch.softmax(scores.masked_fill(~allowed[..., first:, :], float("-inf")), dim=-1)
            on_spans = sum(weights[..., start:end].sum(-1) for start, end in state.spans)
            state.mass.setdefault(module.layer_idx, []).append(float(on_spans.mean()))
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, allowed, is_causal=False, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(_IMPLEMENTATION, sdpa_mask)


@contextmanager
def _scope(model, state: HiddenSpans | AttentionMeter) -> Iterator[None]:
    _register()
    config = model.config
    before = config._attn_implementation
    if before not in ("sdpa", _IMPLEMENTATION):
        raise KVCommError(f"selective layer sharing masks SDPA attention; this model uses '{before}'")
    _active.append(state)
    config._attn_implementation = _IMPLEMENTATION
    try:
        yield
    finally:
        _active.pop()
        config._attn_implementation = before


def hidden(model, spans: HiddenSpans | None):
    """A scope in which ``model``'s tokens do not see ``spans`` (none: an empty scope)."""
    return nullcontext() if spans is None else _scope(model, spans)


def metered(model, meter: AttentionMeter):
    """A scope in which every forward of ``model`` adds its attention mass on the meter's spans."""
    return _scope(model, meter)


def choose_layers(mass_per_layer: dict[int, float], num_layers: int, share: float = SHARED_LAYER_SHARE) -> frozenset[int]:
    """The ``share`` of layers (at least one) with the highest attention mass on the message."""
    if not 0 < share <= 1:
        raise KVCommError(f"the shared layer share must be in (0, 1] (got {share})")
    if sorted(mass_per_layer) != list(range(num_layers)):
        raise KVCommError(f"attention mass for layers {sorted(mass_per_layer)}, the model has {num_layers}")
    count = max(1, math.ceil(share * num_layers))
    ranked = sorted(range(num_layers), key=lambda layer: -mass_per_layer[layer])
    return frozenset(ranked[:count])
