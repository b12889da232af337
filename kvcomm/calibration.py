"""What B prepares from calibration exchanges (another seed's, never scored) before any scored one.

- the anchored protocols' pools (``kvcomm.anchors``): each exchange's spans against B's exact prefill;
- kv-layers' shared layers (``kvcomm.layer_share``): the layers where B's question attends most to
  the messages when it reads them as text.

``kvcomm eval`` draws the exchanges from the task's generator, ``kvcomm ttft`` from its access-log
sender; both hand them here as (layout, senders) pairs, so the two build the same things the same way.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from common.errors import KVCommError
from kvcomm.anchors import AnchorPool, own_pool, pool_from_spans, span_deviations
from kvcomm.layer_share import AttentionMeter, choose_layers, metered
from kvcomm.layout import receiver_prefix, reencode_in_receiver_frame
from kvcomm.protocols import ProtocolSpec, receive


@torch.no_grad()
def anchor_pool(model, exchanges: Iterable, rope, own: bool = False) -> AnchorPool:
    """kv-anchored's pool (each exchange's later senders re-encoded in B's frame against B's prefill),
    or with ``own`` kv-own-anchored's (every sender's own span, and the pool's fallback distance)."""
    spans: list = []
    count = 0
    for layout, senders in exchanges:
        count += 1
        if own:
            spans.append(span_deviations(model, layout, senders, rope, own=True))
        else:
            spans += span_deviations(model, layout, reencode_in_receiver_frame(model, layout, senders), rope)
    return own_pool(spans) if own else pool_from_spans(spans, count)


@torch.no_grad()
def shared_layers(model, exchanges: Iterable, rope) -> frozenset[int]:
    """kv-layers' shared layers: B takes each exchange in as text, and every layer's mean attention
    mass from B's tokens after the last message onto the messages ranks it (kvcomm.layer_share)."""
    mass: dict[int, list[float]] = {}
    for layout, senders in exchanges:
        meter = AttentionMeter(spans=layout.import_spans)
        with metered(model, meter):
            receive(model, ProtocolSpec("text"), layout, senders, receiver_prefix(model, layout), rope)
        for layer, values in meter.mass.items():
            mass.setdefault(layer, []).extend(values)
    if not mass:
        raise KVCommError("no calibration exchanges to choose kv-layers' shared layers from")
    return choose_layers({layer: sum(v) / len(v) for layer, v in mass.items()}, model.config.num_hidden_layers)
