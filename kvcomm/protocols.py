"""How receiver agent B gets sender agents' messages: as text, or as their KV caches.

What a sender ships and how B's prompt is cut into its own and imported segments is
kvcomm.layout's; this module is what B does with an imported segment.

Protocols (how an import segment enters B's cache; B's own segments are always computed). The code
never branches on a protocol's name: ``ProtocolSpec.features`` (kvcomm.names.ProtocolFeatures) says
what each does, read off the name: whether K/V is shipped, re-encoded in B's frame, re-rotated,
anchored, boundary-recomputed or blended:

- ``text``: B re-encodes the message tokens (full prefill; the reference).
- ``kv-verbatim``: A's K/V imported as they are, at the positions A encoded them (B's own tokens keep
  their index in B's sequence): isolates the position error.
- ``kv-rerotated``: A's keys re-rotated to their positions in B's sequence (``kvcomm.rope``).
- ``kv-rerotated+boundary``: as kv-rerotated, but the first ``boundary_k`` tokens of each imported
  chunk are recomputed by B (the seam with B's prompt and the chunk's attention-sink tokens); with
  ``boundary_k`` >= the chunk length this is exactly ``text``.
- ``remote-prefill`` (called ``kv-reencoded`` until 2026-12-06; the old name is still accepted):
  cross-context re-encoding on the sender's side. After writing its message, the
  sender encodes the message once more in B's frame -- B's system prompt and the header its notes go
  under, which agents of one framework share, but not the other senders' messages, which it cannot
  know -- and ships that KV; B re-rotates it into place as for kv-rerotated. The message K/V then
  attended to what B's own prefill would attend to, not to the sender's log. For the first sender
  this is B's own prefill exactly; a later sender's chunk misses the earlier chunks. The sender pays
  one more prefill of frame + message (``SenderState.reencode_s``), off B's critical path. The K/V it
  ships are a function of the message text and B's frame only: B's prefill done by the sender, not
  reuse of the sender's own cache, so its agreement with text is an identity and it is reported as
  a reference row, never judged against the goal (``ProtocolFeatures.reference``).
- ``remote-prefill+blend`` (was ``kv-reencoded+blend``): CacheBlend over the re-encoded spans: a later sender's chunk, the one that
  missed the earlier chunks, is where the deviation is and what the recompute goes to.
- ``kv-anchored``: remote-prefill plus KVComm-style anchor offsets (``kvcomm.anchors``): a later
  sender's span gets the deviation that its k nearest anchor tokens (from examples never scored)
  showed between their re-encoded K/V and B's exact prefill, estimated by B at import time.
- ``kv-anchored+boundary``: kv-anchored, and B recomputes the first ``boundary_k`` tokens of each
  later sender's span (EPIC's boundary recompute; the first sender's span is already exact, so it
  recomputes nothing there). The recomputed head attends to the earlier senders' spans as B's own
  prefill would; the rest of the span keeps its anchored K/V. With ``boundary_k`` >= every later
  span's length this is exactly ``text``.
- ``kv-own-anchored``: KVCOMM proper: every sender's *own* cache, re-rotated into place, plus the
  deviation its nearest anchor tokens showed between their own K/V and B's exact prefill (searched
  at every layer); a span farther from the anchors than the pool's fallback distance is prefilled by
  B instead. No sender re-prefills anything.
- ``kv-own-anchored-once``: as kv-own-anchored, but each token's nearest anchors are found once, at
  the middle layer, and every layer takes its deviations at those anchors (one search per span,
  which also decides the fallback).
- ``kv-layers``: KVComm's (KTH) selective layer sharing (``kvcomm.layer_share``): the sender's own
  span, re-rotated into place, at the layers chosen on calibration examples (30 %, by the attention
  mass B's question puts on the message); at every other layer the tokens B computes afterwards
  do not attend to the message. Nothing is recomputed; a third of the K/V bytes move.
- ``kv-blend``: CacheBlend (``kvcomm.blend``): B's cached prefix (exact), then the imported chunks
  re-rotated into place (with B's own separators between them, each encoded on its own, as CacheBlend
  treats every chunk), the question as the query; layer 0 runs over all tokens, and a ratio ``ratio``
  of the chunk tokens, chosen by value deviation at the check layer, is recomputed at every layer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.errors import KVCommError, suggest
from kvcomm.anchors import anchored_span, falls_back_after, search_once
from kvcomm.cache import KVCache, continue_from, greedy_generate, prefill
from kvcomm.layer_share import HiddenSpans, hidden
from kvcomm.layout import Layout, SenderState
from kvcomm.names import (  # noqa: F401 - defined there, imported from here too
    DEFAULT_ANCHOR_EXAMPLES,
    DEFAULT_BOUNDARY_K,
    DEFAULT_RATIO,
    PROTOCOLS,
    ProtocolFeatures,
    canonical,
    protocol_features,
)
from kvcomm.rope import reposition


@dataclass(frozen=True)
class ProtocolSpec:
    """A protocol and its parameters (``boundary_k`` for +boundary, ``ratio`` for the blends,
    ``anchor_examples`` for kv-anchored); what it does is :attr:`features`, read off the name."""

    name: str
    boundary_k: int = DEFAULT_BOUNDARY_K
    ratio: float = DEFAULT_RATIO
    anchor_examples: int = DEFAULT_ANCHOR_EXAMPLES  # kv-anchored: examples its anchor pool is built from

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", canonical(self.name))  # kv-reencoded -> remote-prefill
        if self.name not in PROTOCOLS:
            raise KVCommError(f"unknown protocol '{self.name}'{suggest(self.name, PROTOCOLS)}; known: {', '.join(PROTOCOLS)}")
        if self.boundary_k < 0:
            raise KVCommError(f"boundary k must be >= 0 (got {self.boundary_k})")
        if not 0.0 <= self.ratio <= 1.0:
            raise KVCommError(f"blend ratio must be in [0, 1] (got {self.ratio})")
        if self.anchor_examples < 1:
            raise KVCommError(f"the anchor example count must be >= 1 (got {self.anchor_examples})")

    @property
    def features(self) -> ProtocolFeatures:
        """What the protocol ships and how B takes it in (kvcomm.names.ProtocolFeatures)."""
        return protocol_features(self.name)

    @property
    def label(self) -> str:
        """Name with the parameters its features use, e.g. ``kv-blend r=0.15``: the key of result rows."""
        f = self.features
        return " ".join([self.name, *([f"a={self.anchor_examples}"] if f.anchored or f.layer_share else []),
                         *([f"k={self.boundary_k}"] if f.boundary else []), *([f"r={self.ratio:g}"] if f.blend else [])])

    @property
    def ships_reencoded(self) -> bool:
        """The sender ships its message re-encoded in B's frame (it must have run ``reencode_in_receiver_frame``)."""
        return self.features.reencoded


@dataclass
class Reception:
    """B's state after taking in the messages and the question (before the first answer token)."""

    cache: KVCache
    last_logits: torch.Tensor  # [vocab], the distribution of B's first answer token
    num_imported: int  # tokens in the imported spans
    num_recomputed: int  # imported tokens whose KV B computed itself (all layers past the check layer)
    prefill_s: float  # receiver TTFT: wall time of taking in the messages + question, B's prefix cached
    extra: dict = field(default_factory=dict)
    # kv-layers: the imported slots B's later tokens (the answer too) may not see, and at which layers
    hidden: HiddenSpans | None = None

    def scope(self, model):
        """The scope B's later forwards over this reception's cache run in (kvcomm.layer_share)."""
        return hidden(model, self.hidden)


# ---- sender -------------------------------------------------------------------------------------
@dataclass
class _Span:
    """A step of the plan: compute ``ids`` at ``positions``, or append an imported ``cache``."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    cache: KVCache | None = None


def _shipped_span(spec: ProtocolSpec, sender: SenderState) -> KVCache:
    """The K/V a sender ships under ``spec``: its message span as encoded in its own chat, or (the
    remote-prefill protocols) as re-encoded in B's frame."""
    if not spec.ships_reencoded:
        return sender.cache
    if sender.reencoded is None:
        raise KVCommError(f"{spec.name} needs the senders' re-encoded spans (reencode_in_receiver_frame)")
    return sender.reencoded


def _plan(spec: ProtocolSpec, layout: Layout, senders: list[SenderState], rope, anchors=None) -> tuple[list[_Span], int]:
    """Turn the layout into compute/import steps (adjacent computes merged); returns (steps, recomputed)."""
    steps: list[_Span] = []
    recomputed = 0

    def compute(ids: list[int], start: int) -> None:
        if not ids:
            return
        if not steps or steps[-1].cache is not None:
            steps.append(_Span())
        steps[-1].ids += ids
        steps[-1].positions += list(range(start, start + len(ids)))

    features = spec.features
    pos = len(layout.segments[0].ids)
    for seg in layout.segments[1:]:
        n = len(seg.ids)
        if seg.kind == "own" or not features.ships_kv:
            compute(seg.ids, pos)
            recomputed += n if seg.kind == "import" else 0
        else:
            span = _shipped_span(spec, senders[seg.sender])
            own = not features.reencoded  # kv-own-anchored: the sender's own cache, every sender offset
            # own-anchored: one nearest-anchor search at the probe layer decides the fallback (and with
            # search_once serves every layer)
            search = search_once(anchors, span, rope) if features.anchored and own and anchors is not None else None
            if search is not None and falls_back_after(anchors, search):
                compute(seg.ids, pos)  # no anchor matches this span: B prefills it (KVCOMM's fallback)
                recomputed += n
                pos += n
                continue
            if features.anchored:
                span = anchored_span(anchors, seg.sender, span, pos, rope, offset_first=own,
                                     search=search if features.search_once else None)
            k = min(spec.boundary_k, n) if features.recomputes_head(seg.sender) else 0
            compute(seg.ids[:k], pos)
            recomputed += k
            if k < n:
                rest = span.slice(k)
                if features.repositions:
                    rest = reposition(rest, pos + k, rope)
                steps.append(_Span(cache=rest))
        pos += n
    return steps, recomputed


@torch.no_grad()
def receive(model, spec: ProtocolSpec, layout: Layout, senders: list[SenderState], prefix: KVCache,
            rope=None, anchors=None, shared_layers: frozenset[int] | None = None) -> Reception:
    """B takes in the senders' messages and the question under protocol ``spec``; timed.

    Args:
        rope: ``kvcomm.models.rope_info(model)`` (computed from ``model`` when None; pass it to keep
            that lookup out of the timing).
        anchors: the ``kvcomm.anchors.AnchorPool`` kv-anchored estimates its offsets from (inside
            the timing: B applies them at import time).
        shared_layers: kv-layers' shared layers (``kvcomm.layer_share.choose_layers``).
    """
    if spec.features.placebo:
        raise KVCommError("the placebo matches another protocol's KL to text: kvcomm.placebo.placebo_reception")
    if rope is None:
        from kvcomm.models import rope_info

        rope = rope_info(model)
    t0 = time.perf_counter()
    if spec.features.blend:
        reception = _receive_blend(model, spec, layout, senders, prefix, rope)
    else:
        steps, recomputed = _plan(spec, layout, senders, rope, anchors)
        unseen = _unshared(spec, layout, model, shared_layers)
        cache, logits = prefix, None
        with hidden(model, unseen):
            for step in steps:
                if step.cache is not None:
                    cache = KVCache.concat([cache, step.cache])
                else:
                    # the last row's logits only, as a serving engine's prefill: text's TTFT once paid the
                    # lm_head over every prompt row (~27 % more work per token for SmolLM2)
                    cache, logits = continue_from(model, cache, step.ids, positions=step.positions, last_only=True)
        if logits is None:
            raise KVCommError("B's prompt must end with its own tokens (the question)")
        reception = Reception(cache=cache, last_logits=logits[0, -1], num_imported=layout.num_imported,
                              num_recomputed=recomputed, prefill_s=0.0, hidden=unseen)
        if unseen is not None:
            reception.extra["shared_layers"] = sorted(set(range(model.config.num_hidden_layers)) - unseen.layers)
    reception.prefill_s = time.perf_counter() - t0
    return reception


def _unshared(spec: ProtocolSpec, layout: Layout, model, shared_layers: frozenset[int] | None) -> HiddenSpans | None:
    """kv-layers: the imported spans, hidden at every layer the senders did not share (else None)."""
    if not spec.features.layer_share:
        return None
    if not shared_layers:
        raise KVCommError("kv-layers needs its shared layers (kvcomm eval chooses them on calibration examples)")
    return HiddenSpans(layers=frozenset(range(model.config.num_hidden_layers)) - shared_layers, spans=layout.import_spans)


def _receive_blend(model, spec: ProtocolSpec, layout: Layout, senders: list[SenderState], prefix: KVCache,
                   rope) -> Reception:
    """CacheBlend: every context chunk comes as a cache (B's prefix and separators encoded on their own)."""
    from kvcomm.blend import blend_prefill

    chunks: list[KVCache] = []
    import_ranges: list[tuple[int, int]] = []
    start = prefix.num_tokens
    for seg in layout.segments[1:-1]:
        if seg.kind == "import":
            chunks.append(_shipped_span(spec, senders[seg.sender]))
            import_ranges.append((start, start + len(seg.ids)))
        else:
            # NOTE(H): a separator is B's own text, but CacheBlend's model is "every chunk precomputed
            # alone"; B encodes it alone (a few tokens) and lets the check layer decide.
            chunks.append(prefill(model, seg.ids)[0])
        start += len(seg.ids)
    result = blend_prefill(model, chunks, layout.segments[-1].ids, ratio=spec.ratio, prefix=prefix)
    selected = torch.as_tensor(result.selected_indices).reshape(-1).tolist()
    per_sender = [sum(1 for i in selected if a <= i < b) for a, b in import_ranges]
    return Reception(cache=result.cache, last_logits=result.logits[0, -1], num_imported=layout.num_imported,
                     num_recomputed=sum(per_sender), prefill_s=0.0,
                     extra={"recomputed_per_layer": list(map(int, result.recomputed_per_layer)),
                            "recomputed_per_sender": per_sender})


@torch.no_grad()
def answer(model, tokenizer, reception: Reception, max_new_tokens: int = 12) -> str:
    """B's greedy answer after ``reception``, decoded until end of turn or ``max_new_tokens``."""
    end_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    first = int(reception.last_logits.argmax())
    tokens = [first]
    if first not in end_ids and max_new_tokens > 1:
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        with reception.scope(model):  # kv-layers: the answer does not see the message at unshared layers either
            more, _, _ = greedy_generate(model, reception.cache, [first], max_new_tokens - 1, eos_token_id=eos)
        tokens += more
    tokens = [t for t in tokens if t not in end_ids]
    return tokenizer.decode(tokens, skip_special_tokens=True)
