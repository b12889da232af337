"""Protocol invariants on tiny random models (exact), plus the real-model seam/template handling."""
from __future__ import annotations

import pytest
import torch

from common.errors import KVCommError
from kvcomm.cache import prefill
from kvcomm.layout import Layout, Segment, encode_sender, encode_sender_ids, receiver_layout, receiver_prefix, sender_layout
from kvcomm.protocols import ProtocolSpec, receive
from kvcomm.tasks import generate

from .conftest import random_ids


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return random_ids(n, vocab, seed=seed).tolist()


def _two_sender_setup(model, a_prefix: int = 11, b_prefix: int = 7):
    """Two senders (different own prefixes from B's) and B's layout: own|A|own|C|own."""
    v = model.config.vocab_size
    a = encode_sender_ids(model, "A", _ids(a_prefix, 1, v), _ids(20, 2, v), _ids(2, 3, v))
    c = encode_sender_ids(model, "C", _ids(a_prefix + 5, 4, v), _ids(14, 5, v), _ids(2, 6, v))
    segments = [Segment("own", _ids(b_prefix, 7, v)), Segment("import", a.message_ids, 0),
                Segment("own", _ids(4, 8, v)), Segment("import", c.message_ids, 1), Segment("own", _ids(6, 9, v))]
    layout = Layout(segments=segments, seam_aligned=True)
    return layout, [a, c], receiver_prefix(model, layout)


def test_text_equals_full_prefill(tiny_model):
    layout, senders, prefix = _two_sender_setup(tiny_model)
    got = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    full, logits = prefill(tiny_model, layout.ids)
    torch.testing.assert_close(got.last_logits, logits[0, -1], atol=1e-5, rtol=1e-5)
    assert got.cache.num_tokens == len(layout.ids) and torch.equal(got.cache.positions, full.positions)
    assert got.num_imported == 34 and got.num_recomputed == 34 and got.prefill_s > 0


def test_boundary_covering_every_token_equals_text(tiny_model):
    layout, senders, prefix = _two_sender_setup(tiny_model)
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    full_k = receive(tiny_model, ProtocolSpec("kv-rerotated+boundary", boundary_k=10_000), layout, senders, prefix)
    torch.testing.assert_close(full_k.last_logits, text.last_logits, atol=1e-5, rtol=1e-5)
    assert full_k.num_recomputed == 34


def test_kv_protocols_put_imports_at_the_right_positions(tiny_model):
    layout, senders, prefix = _two_sender_setup(tiny_model)
    b_positions = torch.arange(len(layout.ids))
    rer = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, senders, prefix)
    verb = receive(tiny_model, ProtocolSpec("kv-verbatim"), layout, senders, prefix)
    assert torch.equal(rer.cache.positions, b_positions) and rer.num_recomputed == 0
    # verbatim: A's span keeps A's positions (A's own prefix was 11 tokens, B's 7)
    assert verb.cache.positions[7:27].tolist() == list(range(11, 31))
    assert verb.cache.positions[:7].tolist() == list(range(7)) and verb.cache.positions[27:31].tolist() == [27, 28, 29, 30]
    # imported values are A's values untouched; re-rotated keys differ from verbatim keys by the shift
    torch.testing.assert_close(rer.cache.values[0][:, :, 7:27], senders[0].cache.values[0])
    assert not torch.allclose(rer.cache.keys[0][:, :, 7:27], verb.cache.keys[0][:, :, 7:27])


def test_rerotated_is_exact_when_sender_context_equals_receiver_context(tiny_model):
    """Same preceding tokens, shifted positions: re-rotation recovers text exactly, verbatim does not."""
    v = tiny_model.config.vocab_size
    own = _ids(9, 7, v)
    msg = _ids(25, 2, v)
    # A encoded [own, msg] starting at position 40 (e.g. after a longer history it then dropped)
    a_cache, _ = prefill(tiny_model, own + msg, positions=torch.arange(40, 40 + 34))
    from kvcomm.layout import SenderState

    sender = SenderState(agent="A", message_ids=msg, cache=a_cache.slice(9))
    layout = Layout([Segment("own", own), Segment("import", msg, 0), Segment("own", _ids(5, 3, v))], True)
    prefix = receiver_prefix(tiny_model, layout)
    text = receive(tiny_model, ProtocolSpec("text"), layout, [sender], prefix)
    rer = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, [sender], prefix)
    verb = receive(tiny_model, ProtocolSpec("kv-verbatim"), layout, [sender], prefix)
    torch.testing.assert_close(rer.last_logits, text.last_logits, atol=1e-4, rtol=1e-4)
    assert float((verb.last_logits - text.last_logits).abs().max()) > 1e-3


def test_boundary_k_counts_and_interpolates(tiny_model):
    layout, senders, prefix = _two_sender_setup(tiny_model)
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    errors = []
    for k in (0, 4, 30):
        got = receive(tiny_model, ProtocolSpec("kv-rerotated+boundary", boundary_k=k), layout, senders, prefix)
        assert got.num_recomputed == min(k, 20) + min(k, 14)
        errors.append(float((got.last_logits - text.last_logits).abs().max()))
    rer = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, senders, prefix)
    torch.testing.assert_close(rer.last_logits, receive(tiny_model, ProtocolSpec("kv-rerotated+boundary", boundary_k=0),
                                                       layout, senders, prefix).last_logits)
    assert errors[0] > 1e-4 and errors[-1] < 1e-4


def test_protocol_spec_validation():
    assert ProtocolSpec("kv-blend", ratio=0.3).label == "kv-blend r=0.3"
    assert ProtocolSpec("kv-rerotated+boundary", boundary_k=8).label == "kv-rerotated+boundary k=8"
    with pytest.raises(KVCommError, match="kv-blend"):
        ProtocolSpec("kv-blnd")
    with pytest.raises(KVCommError, match="ratio"):
        ProtocolSpec("kv-blend", ratio=1.5)


@pytest.mark.model
def test_real_template_seams(smollm2):
    """A's and B's templates differ; the imported span is the message alone, same ids on both sides."""
    model, tok = smollm2
    ex = generate("twoagent", 3, seed=0)[2]
    senders = [encode_sender(model, tok, m) for m in ex.messages]
    layout = receiver_layout(tok, ex, senders)
    assert layout.seam_aligned
    a_prefix, a_msg, a_suffix = sender_layout(tok, ex.messages[0])
    assert tok.decode(a_msg) == ex.messages[0].text
    assert "agent A, a note-taking" in tok.decode(a_prefix) and tok.decode(a_suffix).startswith("<|im_end|>")
    b_text = tok.decode(layout.ids)
    assert b_text.startswith("<|im_start|>system\nYou are agent B") and b_text.endswith("<|im_start|>assistant\n" + ex.answer_prefix)
    assert [s.kind for s in layout.segments] == ["own", "import", "own", "import", "own"]
    assert layout.segments[1].ids == a_msg and senders[0].cache.num_tokens == len(a_msg)
    # A encoded its message after its own (longer) prefix: positions differ from B's
    assert int(senders[0].cache.positions[0]) == len(a_prefix) != len(layout.segments[0].ids)


def test_blend_endpoints(tiny_llama):
    """r = 1 recomputes every imported token (== text); r = 0 with one sender == kv-rerotated."""
    layout, senders, prefix = _two_sender_setup(tiny_llama)
    text = receive(tiny_llama, ProtocolSpec("text"), layout, senders, prefix)
    full = receive(tiny_llama, ProtocolSpec("kv-blend", ratio=1.0), layout, senders, prefix)
    torch.testing.assert_close(full.last_logits, text.last_logits, atol=1e-4, rtol=1e-4)
    assert full.num_recomputed == 34 and full.cache.num_tokens == len(layout.ids)
    part = receive(tiny_llama, ProtocolSpec("kv-blend", ratio=0.25), layout, senders, prefix)
    # 25 % of the 38 chunk tokens (34 imported + 4 of B's separator) are chosen; imported ones counted
    assert 5 <= part.num_recomputed <= 10
    one = Layout([layout.segments[0], layout.segments[1], layout.segments[4]], True)
    zero = receive(tiny_llama, ProtocolSpec("kv-blend", ratio=0.0), one, senders, prefix)
    rer = receive(tiny_llama, ProtocolSpec("kv-rerotated"), one, senders, prefix)
    torch.testing.assert_close(zero.last_logits, rer.last_logits, atol=1e-4, rtol=1e-4)
    assert zero.num_recomputed == 0


def test_reencoded_first_sender_is_text_exactly_and_a_later_one_misses_the_earlier_chunk(tiny_model):
    from kvcomm.layout import reencode_in_receiver_frame

    layout, senders, prefix = _two_sender_setup(tiny_model)
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    with pytest.raises(KVCommError, match="re-encoded spans"):
        receive(tiny_model, ProtocolSpec("remote-prefill"), layout, senders, prefix)
    again = reencode_in_receiver_frame(tiny_model, layout, senders)
    assert all(s.reencode_s > 0 and s.cache is o.cache for s, o in zip(again, senders))  # the original span kept
    got = receive(tiny_model, ProtocolSpec("remote-prefill"), layout, again, prefix)
    rer = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, senders, prefix)
    assert got.num_recomputed == 0 and torch.equal(got.cache.positions, torch.arange(len(layout.ids)))
    # sender A's span, encoded after B's own opening segment: B's own prefill of it, every layer
    a = slice(7, 27)
    for layer in range(tiny_model.config.num_hidden_layers):
        torch.testing.assert_close(got.cache.keys[layer][:, :, a], text.cache.keys[layer][:, :, a], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.cache.values[layer][:, :, a], text.cache.values[layer][:, :, a], atol=1e-5, rtol=1e-5)
    # sender C's frame has B's headers but not A's message: its deeper layers differ from text's
    c = slice(31, 45)
    assert float((got.cache.values[-1][:, :, c] - text.cache.values[-1][:, :, c]).abs().max()) > 1e-3
    # and both sit closer to text than the spans encoded in the senders' own chats
    err = lambda r: float((r.last_logits - text.last_logits).abs().max())  # noqa: E731
    assert err(got) < err(rer)


def test_reencoded_single_sender_gives_texts_logits(tiny_model):
    from kvcomm.layout import reencode_in_receiver_frame

    layout, senders, prefix = _two_sender_setup(tiny_model)
    one = Layout(segments=layout.segments[:2] + layout.segments[-1:], seam_aligned=True)
    text = receive(tiny_model, ProtocolSpec("text"), one, senders[:1], prefix)
    got = receive(tiny_model, ProtocolSpec("remote-prefill"), one, reencode_in_receiver_frame(tiny_model, one, senders[:1]), prefix)
    torch.testing.assert_close(got.last_logits, text.last_logits, atol=1e-4, rtol=1e-4)


def test_reencoded_blend_recomputes_where_the_reencoded_spans_still_deviate(tiny_model):
    from kvcomm.layout import reencode_in_receiver_frame

    layout, senders, prefix = _two_sender_setup(tiny_model)
    again = reencode_in_receiver_frame(tiny_model, layout, senders)
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    full = receive(tiny_model, ProtocolSpec("remote-prefill+blend", ratio=1.0), layout, again, prefix)
    torch.testing.assert_close(full.last_logits, text.last_logits, atol=1e-4, rtol=1e-4)
    assert ProtocolSpec("remote-prefill+blend", ratio=0.25).label == "remote-prefill+blend r=0.25"
    # its old name is still taken, under the new one
    assert ProtocolSpec("kv-reencoded+blend", ratio=0.25).label == "remote-prefill+blend r=0.25"
    # A's re-encoded span is B's own prefill (no deviation); C's missed A's message: the recompute
    # goes to C's chunk, where kv-blend over the senders' own spans spreads it over both
    part = receive(tiny_model, ProtocolSpec("remote-prefill+blend", ratio=0.25), layout, again, prefix)
    a_share, c_share = part.extra["recomputed_per_sender"]
    assert a_share == 0 and c_share > 0
    own = receive(tiny_model, ProtocolSpec("kv-blend", ratio=0.25), layout, senders, prefix)
    assert own.extra["recomputed_per_sender"][0] > 0
    with pytest.raises(KVCommError, match="re-encoded spans"):
        receive(tiny_model, ProtocolSpec("remote-prefill+blend"), layout, senders, prefix)


def test_protocols_are_described_by_features_read_off_their_names():
    # What each protocol does comes from its features (no code branches on a protocol's name), and
    # the labels that key result rows are the ones earlier results were written under.
    from kvcomm.cli import parse_protocols
    from kvcomm.names import PROTOCOLS, protocol_features

    f = {name: protocol_features(name) for name in PROTOCOLS}
    assert not f["text"].ships_kv and all(f[n].ships_kv for n in PROTOCOLS if n not in ("text", "placebo"))
    assert [n for n in PROTOCOLS if f[n].placebo] == ["placebo"] and f["placebo"].reference
    assert [n for n in PROTOCOLS if not f[n].repositions and not f[n].blend] == ["text", "kv-verbatim", "placebo"]
    assert [n for n in PROTOCOLS if f[n].reencoded] == ["remote-prefill", "remote-prefill+blend", "kv-anchored",
                                                         "kv-anchored+boundary"]
    assert [n for n in PROTOCOLS if f[n].blend] == ["kv-blend", "remote-prefill+blend"]
    assert [n for n in PROTOCOLS if f[n].boundary] == ["kv-rerotated+boundary", "kv-anchored+boundary"]
    # a boundary recomputes every span's head, except the first sender's exact re-encoded span
    assert f["kv-rerotated+boundary"].recomputes_head(0) and f["kv-rerotated+boundary"].recomputes_head(1)
    assert not f["kv-anchored+boundary"].recomputes_head(0) and f["kv-anchored+boundary"].recomputes_head(1)
    assert not f["kv-anchored"].recomputes_head(1)
    assert [n for n in PROTOCOLS if f[n].search_once] == ["kv-own-anchored-once"] and f["kv-own-anchored-once"].anchored
    assert [n for n in PROTOCOLS if f[n].layer_share] == ["kv-layers"] and f["kv-layers"].repositions
    labels = [s.label for s in parse_protocols(",".join(PROTOCOLS), "0.1,0.3", "4,8", 20)]
    assert labels == ["text", "kv-verbatim", "kv-rerotated", "kv-rerotated+boundary k=4", "kv-rerotated+boundary k=8",
                      "remote-prefill", "kv-blend r=0.1", "kv-blend r=0.3", "remote-prefill+blend r=0.1",
                      "remote-prefill+blend r=0.3", "kv-anchored a=20", "kv-anchored+boundary a=20 k=4",
                      "kv-anchored+boundary a=20 k=8", "kv-own-anchored a=20",
                      "kv-own-anchored-once a=20", "kv-layers a=20", "placebo"]
    with pytest.raises(KVCommError, match="unknown protocol 'kv-magic'"):
        parse_protocols("text,kv-magic", "0.1", "4")
