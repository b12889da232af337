"""Layouts: what a sender encodes and ships, and how receiver agent B's prompt is cut into segments.

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

How an import segment then enters B's cache is the protocol's (kvcomm.protocols).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from kvcomm.cache import KVCache, prefill
from kvcomm.example import AgentMessage, Example
from kvcomm.tasks import RECEIVER_SYSTEM

_PLACEHOLDER = "\x00IMPORT{}\x00"


@dataclass(frozen=True)
class SenderState:
    """A sender's exported message: its token ids and the KV of exactly that span.

    ``reencoded``: the same span encoded again in B's frame (``reencode_in_receiver_frame``), what
    ``remote-prefill`` ships; ``reencode_s`` the sender's time for that extra prefill.
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

    @property
    def import_spans(self) -> tuple[tuple[int, int], ...]:
        """[start, end) in B's sequence of each imported segment (one per sender)."""
        sizes = [len(s.ids) for s in self.segments if s.kind == "import"]
        return tuple((start, start + n) for start, n in zip(self.import_starts, sizes))


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
