"""How receiver agent B gets sender agents' messages: as text, or as their KV caches.

Sender side (``encode_sender``): agent A runs its own chat -- its own system prompt, its instruction,
then the message as its assistant turn -- and keeps the KV of the **message span only**::

    A's sequence:  <|im_start|>system\\n{A's system}<|im_end|>\\n<|im_start|>user\\n{instr}<|im_end|>\\n
                   <|im_start|>assistant\\n [ message tokens ] <|im_end|>\\n
                                            ^ span exported: K, V, positions as A encoded them

A's system prompt and template tokens are never imported (B has its own); the message KV still
*attended to* A's context when A computed it, which is one of the mismatches the protocols differ on.

Receiver side: B's prompt is rendered with B's chat template around placeholders, and cut into
segments that B computes itself ("own") and segments that come from a sender ("import")::

    own:    <|im_start|>system\\n{B's system}<|im_end|>\\n<|im_start|>user\\nNotes from agent A:\\n
    import: [ A's message tokens ]
    own:    \\n\\nNotes from agent C:\\n                       (only with several senders)
    import: [ C's message tokens ]
    own:    \\n\\nQuestion: {q}<|im_end|>\\n<|im_start|>assistant\\n

Tokenization seam: the message is tokenized **on its own** with the same tokenizer, in A's sequence
and in B's, and both sequences are built by concatenating token ids, so the imported tokens are the
same ids in both. Whether tokenizing B's whole rendered prompt at once would have merged tokens
across a seam is recorded per example (``Layout.seam_aligned``); the ``text`` protocol uses the same
concatenated ids so that every protocol answers the very same token sequence.

B's first own segment (its system prompt and the header) is the same for every request: B keeps it
cached (``receiver_prefix``) and every protocol starts from that cache, so receiver TTFT is the time
to take in the messages and the question.

Protocols (how an import segment enters B's cache; B's own segments are always computed):

- ``text``: B re-encodes the message tokens (full prefill; the reference).
- ``kv-verbatim``: A's K/V imported as they are, at the positions A encoded them (B's own tokens keep
  their index in B's sequence): isolates the position error.
- ``kv-rerotated``: A's keys re-rotated to their positions in B's sequence (``kvcomm.rope``).
- ``kv-rerotated+boundary``: as kv-rerotated, but the first ``boundary_k`` tokens of each imported
  chunk are recomputed by B (the seam with B's prompt and the chunk's attention-sink tokens); with
  ``boundary_k`` >= the chunk length this is exactly ``text``.
- ``kv-reencoded``: cross-context re-encoding on the sender's side. After writing its message, the
  sender encodes the message once more in B's frame -- B's system prompt and the header its notes go
  under, which agents of one framework share, but not the other senders' messages, which it cannot
  know -- and ships that KV; B re-rotates it into place as for kv-rerotated. The message K/V then
  attended to what B's own prefill would attend to, not to the sender's log. For the first sender
  this is B's own prefill exactly; a later sender's chunk misses the earlier chunks. The sender pays
  one more prefill of frame + message (``SenderState.reencode_s``), off B's critical path.
- ``kv-reencoded+blend``: CacheBlend over the re-encoded spans: a later sender's chunk, the one that
  missed the earlier chunks, is where the deviation is and what the recompute goes to.
- ``kv-anchored``: kv-reencoded plus KVComm-style anchor offsets (``kvcomm.anchors``): a later
  sender's span gets the deviation that its k nearest anchor tokens (from examples never scored)
  showed between their re-encoded K/V and B's exact prefill, estimated by B at import time.
- ``kv-anchored+boundary``: kv-anchored, and B recomputes the first ``boundary_k`` tokens of each
  later sender's span (EPIC's boundary recompute; the first sender's span is already exact, so it
  recomputes nothing there). The recomputed head attends to the earlier senders' spans as B's own
  prefill would; the rest of the span keeps its anchored K/V. With ``boundary_k`` >= every later
  span's length this is exactly ``text``.
- ``kv-blend``: CacheBlend (``kvcomm.blend``): B's cached prefix (exact), then the imported chunks
  re-rotated into place (with B's own separators between them, each encoded on its own, as CacheBlend
  treats every chunk), the question as the query; layer 0 runs over all tokens, and a ratio ``ratio``
  of the chunk tokens, chosen by value deviation at the check layer, is recomputed at every layer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from gpubench.errors import KVCommError, suggest
from kvcomm.anchors import anchored_span
from kvcomm.cache import KVCache, continue_from, greedy_generate, prefill
from kvcomm.names import (  # noqa: F401 - defined there, imported from here too
    ANCHORED_PROTOCOLS,
    BLEND_PROTOCOLS,
    BOUNDARY_PROTOCOLS,
    DEFAULT_ANCHOR_EXAMPLES,
    DEFAULT_BOUNDARY_K,
    DEFAULT_RATIO,
    PROTOCOLS,
    REENCODED_PROTOCOLS,
)
from kvcomm.rope import reposition
from kvcomm.tasks import RECEIVER_SYSTEM, AgentMessage, Example

_PLACEHOLDER = "\x00IMPORT{}\x00"


@dataclass(frozen=True)
class ProtocolSpec:
    """A protocol and its parameter (``boundary_k`` for +boundary, ``ratio`` for kv-blend)."""

    name: str
    boundary_k: int = DEFAULT_BOUNDARY_K
    ratio: float = DEFAULT_RATIO
    anchor_examples: int = DEFAULT_ANCHOR_EXAMPLES  # kv-anchored: examples its anchor pool is built from

    def __post_init__(self) -> None:
        if self.name not in PROTOCOLS:
            raise KVCommError(f"unknown protocol '{self.name}'{suggest(self.name, PROTOCOLS)}; known: {', '.join(PROTOCOLS)}")
        if self.boundary_k < 0:
            raise KVCommError(f"boundary k must be >= 0 (got {self.boundary_k})")
        if not 0.0 <= self.ratio <= 1.0:
            raise KVCommError(f"blend ratio must be in [0, 1] (got {self.ratio})")
        if self.anchor_examples < 1:
            raise KVCommError(f"the anchor example count must be >= 1 (got {self.anchor_examples})")

    @property
    def label(self) -> str:
        """Name with its parameter, e.g. ``kv-blend r=0.15``: the key of result rows."""
        if self.name == "kv-anchored+boundary":
            return f"{self.name} a={self.anchor_examples} k={self.boundary_k}"
        if self.name == "kv-rerotated+boundary":
            return f"{self.name} k={self.boundary_k}"
        if self.name in BLEND_PROTOCOLS:
            return f"{self.name} r={self.ratio:g}"
        if self.name in ANCHORED_PROTOCOLS:
            return f"{self.name} a={self.anchor_examples}"
        return self.name

    @property
    def ships_reencoded(self) -> bool:
        """The sender ships its message re-encoded in B's frame (it must have run ``reencode_in_receiver_frame``)."""
        return self.name in REENCODED_PROTOCOLS


@dataclass(frozen=True)
class SenderState:
    """A sender's exported message: its token ids and the KV of exactly that span.

    ``reencoded``: the same span encoded again in B's frame (``reencode_in_receiver_frame``), what
    ``kv-reencoded`` ships; ``reencode_s`` the sender's time for that extra prefill.
    """

    agent: str
    message_ids: list[int]
    cache: KVCache
    reencoded: KVCache | None = None
    reencode_s: float = 0.0


@dataclass(frozen=True)
class Segment:
    """A piece of B's prompt: B's own token ids, or the message of sender ``sender``."""

    kind: str  # "own" | "import"
    ids: list[int]
    sender: int = -1


@dataclass(frozen=True)
class Layout:
    """B's prompt as segments; ``seam_aligned`` says one-shot tokenization gives the same ids."""

    segments: list[Segment]
    seam_aligned: bool

    @property
    def ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    @property
    def num_imported(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.kind == "import")

    @property
    def import_starts(self) -> list[int]:
        """Position in B's sequence of each imported segment's first token (one per sender)."""
        starts, pos = [], 0
        for s in self.segments:
            if s.kind == "import":
                starts.append(pos)
            pos += len(s.ids)
        return starts


@dataclass
class Reception:
    """B's state after taking in the messages and the question (before the first answer token)."""

    cache: KVCache
    last_logits: torch.Tensor  # [vocab], the distribution of B's first answer token
    num_imported: int  # tokens in the imported spans
    num_recomputed: int  # imported tokens whose KV B computed itself (all layers past the check layer)
    prefill_s: float  # receiver TTFT: wall time of taking in the messages + question, B's prefix cached
    extra: dict = field(default_factory=dict)


# ---- sender -------------------------------------------------------------------------------------
def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def sender_layout(tokenizer, message: AgentMessage) -> tuple[list[int], list[int], list[int]]:
    """A's (prefix ids, message ids, suffix ids): its chat up to the assistant turn, the message, the end."""
    chat = [{"role": "system", "content": message.system_prompt},
            {"role": "user", "content": message.instruction},
            {"role": "assistant", "content": _PLACEHOLDER.format(0)}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    before, after = rendered.split(_PLACEHOLDER.format(0))
    return _ids(tokenizer, before), _ids(tokenizer, message.text), _ids(tokenizer, after)


@torch.no_grad()
def encode_sender(model, tokenizer, message: AgentMessage) -> SenderState:
    """Run A's whole chat once and export the KV of the message span (positions as A encoded them)."""
    prefix, msg, suffix = sender_layout(tokenizer, message)
    return encode_sender_ids(model, message.agent, prefix, msg, suffix)


@torch.no_grad()
def encode_sender_ids(model, agent: str, prefix: list[int], msg: list[int], suffix: list[int]) -> SenderState:
    """``encode_sender`` on token ids: prefill prefix + msg + suffix, export the msg span."""
    cache, _ = prefill(model, prefix + msg + suffix)
    return SenderState(agent=agent, message_ids=list(msg), cache=cache.slice(len(prefix), len(prefix) + len(msg)))


@torch.no_grad()
def reencode_in_receiver_frame(model, layout: Layout, senders: list[SenderState]) -> list[SenderState]:
    """Each sender's message encoded again after B's first own segment (B's system prompt and first
    header) and the header right before that sender's notes; returns the senders with ``reencoded``.

    Sender i knows B's frame but not the other senders' messages: its frame is B's opening segment,
    then (for i > 0) the separator and header that precede its notes in B's prompt.
    """
    own_before = [layout.segments[k - 1].ids for k, seg in enumerate(layout.segments) if seg.kind == "import"]
    out = []
    for i, sender in enumerate(senders):
        frame = list(layout.segments[0].ids) + (list(own_before[i]) if i > 0 else [])
        t0 = time.perf_counter()
        cache, _ = prefill(model, frame + list(sender.message_ids))
        span = cache.slice(len(frame), len(frame) + len(sender.message_ids))
        out.append(replace(sender, reencoded=span, reencode_s=time.perf_counter() - t0))
    return out


# ---- receiver layout ----------------------------------------------------------------------------
def receiver_layout(tokenizer, example: Example, senders: list[SenderState]) -> Layout:
    """B's prompt (B's system prompt and chat template) cut into own and import segments."""
    return receiver_layout_ids(tokenizer, example, [s.message_ids for s in senders])


def receiver_layout_ids(tokenizer, example: Example, message_ids: list[list[int]]) -> Layout:
    """``receiver_layout`` from each sender's message token ids (no sender needs to have run)."""
    body = "".join(f"{'' if i == 0 else chr(10) * 2}{example.notes_header.format(agent=m.agent)}{_PLACEHOLDER.format(i)}"
                   for i, m in enumerate(example.messages))
    chat = [{"role": "system", "content": RECEIVER_SYSTEM},
            {"role": "user", "content": f"{body}\n\nQuestion: {example.question}"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    rendered += example.answer_prefix
    segments: list[Segment] = []
    rest = rendered
    for i, ids in enumerate(message_ids):
        before, rest = rest.split(_PLACEHOLDER.format(i))
        segments += [Segment("own", _ids(tokenizer, before)), Segment("import", list(ids), i)]
    segments.append(Segment("own", _ids(tokenizer, rest)))
    texts = [m.text for m in example.messages]
    one_shot = _ids(tokenizer, _fill(rendered, texts))
    return Layout(segments=segments, seam_aligned=one_shot == [t for s in segments for t in s.ids])


def message_drift(tokenizer, example: Example) -> list[int]:
    """Per sender: position of its message's first token in its own chat minus that in B's prompt.

    Tokenizer only (no model): how far every imported key must be re-rotated.
    """
    layouts = [sender_layout(tokenizer, m) for m in example.messages]
    layout = receiver_layout_ids(tokenizer, example, [msg for _, msg, _ in layouts])
    return [len(prefix) - start for (prefix, _, _), start in zip(layouts, layout.import_starts)]


def _fill(rendered: str, texts: list[str]) -> str:
    for i, t in enumerate(texts):
        rendered = rendered.replace(_PLACEHOLDER.format(i), t)
    return rendered


@torch.no_grad()
def receiver_prefix(model, layout: Layout) -> KVCache:
    """B's own cached prefix: the first own segment (system prompt and header), positions 0..n-1."""
    cache, _ = prefill(model, layout.segments[0].ids)
    return cache


# ---- protocols ----------------------------------------------------------------------------------
@dataclass
class _Span:
    """A step of the plan: compute ``ids`` at ``positions``, or append an imported ``cache``."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    cache: KVCache | None = None


def _shipped_span(spec: ProtocolSpec, sender: SenderState) -> KVCache:
    """The K/V a sender ships under ``spec``: its message span as encoded in its own chat, or (the
    kv-reencoded protocols) as re-encoded in B's frame."""
    if not spec.ships_reencoded:
        return sender.cache
    if sender.reencoded is None:
        raise KVCommError(f"{spec.name} needs the senders' re-encoded spans (reencode_in_receiver_frame)")
    return sender.reencoded


def _recomputes_head(spec: ProtocolSpec, sender_index: int) -> bool:
    """Whether B recomputes the head of this sender's span: every span under kv-rerotated+boundary;
    under kv-anchored+boundary only a later sender's (the first sender's re-encoded span is exact)."""
    if spec.name not in BOUNDARY_PROTOCOLS:
        return False
    return spec.name == "kv-rerotated+boundary" or sender_index > 0


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

    pos = len(layout.segments[0].ids)
    for seg in layout.segments[1:]:
        n = len(seg.ids)
        if seg.kind == "own" or spec.name == "text":
            compute(seg.ids, pos)
            recomputed += n if seg.kind == "import" else 0
        else:
            span = _shipped_span(spec, senders[seg.sender])
            if spec.name in ANCHORED_PROTOCOLS:
                span = anchored_span(anchors, seg.sender, span, pos, rope)
            k = min(spec.boundary_k, n) if _recomputes_head(spec, seg.sender) else 0
            compute(seg.ids[:k], pos)
            recomputed += k
            if k < n:
                rest = span.slice(k)
                if spec.name != "kv-verbatim":
                    rest = reposition(rest, pos + k, rope)
                steps.append(_Span(cache=rest))
        pos += n
    return steps, recomputed


@torch.no_grad()
def receive(model, spec: ProtocolSpec, layout: Layout, senders: list[SenderState], prefix: KVCache,
            rope=None, anchors=None) -> Reception:
    """B takes in the senders' messages and the question under protocol ``spec``; timed.

    Args:
        rope: ``kvcomm.models.rope_info(model)`` (computed from ``model`` when None; pass it to keep
            that lookup out of the timing).
        anchors: the ``kvcomm.anchors.AnchorPool`` kv-anchored estimates its offsets from (inside
            the timing: B applies them at import time).
    """
    if rope is None:
        from kvcomm.models import rope_info

        rope = rope_info(model)
    t0 = time.perf_counter()
    if spec.name in BLEND_PROTOCOLS:
        reception = _receive_blend(model, spec, layout, senders, prefix, rope)
    else:
        steps, recomputed = _plan(spec, layout, senders, rope, anchors)
        cache, logits = prefix, None
        for step in steps:
            if step.cache is not None:
                cache = KVCache.concat([cache, step.cache])
            else:
                cache, logits = continue_from(model, cache, step.ids, positions=step.positions)
        if logits is None:
            raise KVCommError("B's prompt must end with its own tokens (the question)")
        reception = Reception(cache=cache, last_logits=logits[0, -1], num_imported=layout.num_imported,
                              num_recomputed=recomputed, prefill_s=0.0)
    reception.prefill_s = time.perf_counter() - t0
    return reception


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
        more, _, _ = greedy_generate(model, reception.cache, [first], max_new_tokens - 1, eos_token_id=eos)
        tokens += more
    tokens = [t for t in tokens if t not in end_ids]
    return tokenizer.decode(tokens, skip_special_tokens=True)
