"""kv-anchored: KVComm-style anchor offsets for a later sender's re-encoded span (real tiny models)."""
from __future__ import annotations

import pytest
import torch

from common.errors import KVCommError
from kvcomm.anchors import anchored_span, pool_from_spans, span_deviations
from kvcomm.layout import reencode_in_receiver_frame
from kvcomm.models import rope_info
from kvcomm.protocols import ProtocolSpec, receive

from .test_protocols import _two_sender_setup


def _setup(model, **sizes):
    layout, senders, prefix = _two_sender_setup(model, **sizes)
    return layout, reencode_in_receiver_frame(model, layout, senders), prefix


def test_a_pool_holding_the_example_itself_gives_texts_cache_and_logits(tiny_model):
    # With the example's own exact deviations in the pool and one neighbour, every token finds
    # itself (distance 0), so the estimate is the exact deviation: B's own prefill, every layer.
    rope = rope_info(tiny_model)
    layout, senders, prefix = _setup(tiny_model)
    pool = pool_from_spans(span_deviations(tiny_model, layout, senders, rope), 1, neighbours=1)
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    got = receive(tiny_model, ProtocolSpec("kv-anchored"), layout, senders, prefix, rope, pool)
    reenc = receive(tiny_model, ProtocolSpec("remote-prefill"), layout, senders, prefix)
    assert got.num_recomputed == 0 and torch.equal(got.cache.positions, torch.arange(len(layout.ids)))
    for layer in range(tiny_model.config.num_hidden_layers):
        torch.testing.assert_close(got.cache.keys[layer], text.cache.keys[layer], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got.cache.values[layer], text.cache.values[layer], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.last_logits, text.last_logits, atol=1e-4, rtol=1e-4)
    # and remote-prefill, which this corrects, is not text's
    assert float((reenc.last_logits - text.last_logits).abs().max()) > 1e-3


def test_offsets_from_other_examples_move_the_later_span_only(tiny_model):
    rope = rope_info(tiny_model)
    anchors = []
    for a_prefix, b_prefix in ((9, 5), (13, 8), (15, 6)):  # other examples: other chats and frames
        layout, senders, _ = _setup(tiny_model, a_prefix=a_prefix, b_prefix=b_prefix)
        anchors += span_deviations(tiny_model, layout, senders, rope)
    pool = pool_from_spans(anchors, 3)
    assert pool.keys[0] is None and pool.num_tokens == sum(a[0][1].shape[1] for a in anchors)
    layout, senders, _ = _setup(tiny_model)
    first = anchored_span(pool, 0, senders[0].reencoded, layout.import_starts[0], rope)
    later = anchored_span(pool, 1, senders[1].reencoded, layout.import_starts[1], rope)
    plain = anchored_span(None, 0, senders[1].reencoded, layout.import_starts[1], rope)  # placed, no offset
    assert torch.equal(first.keys[-1], anchored_span(None, 0, senders[0].reencoded, layout.import_starts[0], rope).keys[-1])
    torch.testing.assert_close(later.keys[0], plain.keys[0])  # layer 0 has no deviation
    assert not torch.allclose(later.values[-1], plain.values[-1])
    assert torch.equal(later.positions, plain.positions)


def test_a_later_sender_without_a_pool_is_one_clear_error(tiny_model):
    layout, senders, prefix = _setup(tiny_model)
    with pytest.raises(KVCommError, match="anchor pool"):
        receive(tiny_model, ProtocolSpec("kv-anchored"), layout, senders, prefix)
    with pytest.raises(KVCommError, match="anchor example count"):
        ProtocolSpec("kv-anchored", anchor_examples=0)
    assert ProtocolSpec("kv-anchored", anchor_examples=12).label == "kv-anchored a=12"


def test_kvcomm_eval_builds_the_pool_from_unscored_examples(tiny_chat_model, tmp_path):
    from kvcomm.evaluate import ANCHOR_SEED_OFFSET, EvalConfig, run_eval
    from kvcomm.tasks import generate

    model, tok = tiny_chat_model
    cfg = EvalConfig(model="tiny", tasks=("multihop", "summary"), n=2, out_dir=tmp_path, max_new_tokens=2,
                     protocols=(ProtocolSpec("text"), ProtocolSpec("remote-prefill"), ProtocolSpec("kv-anchored", anchor_examples=3)))
    rows = run_eval(cfg, model, tok, progress=False)
    anch = rows[rows["protocol"] == "kv-anchored a=3"]
    assert len(anch) == 4
    multihop = anch[anch["task"] == "multihop"]
    assert all(e["anchor_pool"]["examples"] == 3 and e["anchor_pool"]["tokens"] > 0 for e in multihop["extra"])
    # one sender (summary): nothing to offset, so it is remote-prefill exactly, with no pool
    summary = rows[rows["task"] == "summary"].sort_values("index")
    anchored, reencoded = (summary[summary["protocol"] == p] for p in ("kv-anchored a=3", "remote-prefill"))
    assert len(anchored) == 2 and not any("anchor_pool" in e for e in anchored["extra"])
    assert anchored["generated"].tolist() == reencoded["generated"].tolist()
    assert anchored["kl_text"].tolist() == pytest.approx(reencoded["kl_text"].tolist(), abs=1e-9)
    # the anchors are other examples than the scored ones
    scored = {e.question for e in generate("multihop", 2, 0)}
    assert not scored & {e.question for e in generate("multihop", 3, ANCHOR_SEED_OFFSET)}


def test_anchored_boundary_recomputes_the_head_of_later_spans_only(tiny_model):
    # Offsets from other examples (not exact), then B recomputes the first k tokens of the later
    # sender's span: k >= that span is B's own prefill exactly; k = 0 is kv-anchored; in between
    # the recomputed head is B's own K/V and the first sender's span is untouched.
    rope = rope_info(tiny_model)
    anchors = []
    for a_prefix, b_prefix in ((9, 5), (13, 8)):
        other, other_senders, _ = _setup(tiny_model, a_prefix=a_prefix, b_prefix=b_prefix)
        anchors += span_deviations(tiny_model, other, other_senders, rope)
    pool = pool_from_spans(anchors, 2)
    layout, senders, prefix = _setup(tiny_model)
    later_len = len(senders[1].message_ids)
    start = layout.import_starts[1]
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    anchored = receive(tiny_model, ProtocolSpec("kv-anchored"), layout, senders, prefix, rope, pool)
    full = receive(tiny_model, ProtocolSpec("kv-anchored+boundary", boundary_k=later_len), layout, senders, prefix, rope, pool)
    none = receive(tiny_model, ProtocolSpec("kv-anchored+boundary", boundary_k=0), layout, senders, prefix, rope, pool)
    head = receive(tiny_model, ProtocolSpec("kv-anchored+boundary", boundary_k=2), layout, senders, prefix, rope, pool)
    assert full.num_recomputed == later_len and none.num_recomputed == 0 and head.num_recomputed == 2
    torch.testing.assert_close(full.last_logits, text.last_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(none.last_logits, anchored.last_logits, atol=0, rtol=0)
    assert float((anchored.last_logits - text.last_logits).abs().max()) > 1e-3
    last = tiny_model.config.num_hidden_layers - 1
    # the recomputed head attends to the first sender's span as in B's own prefill: text's K/V there
    torch.testing.assert_close(head.cache.values[last][:, :, start:start + 2], text.cache.values[last][:, :, start:start + 2],
                               atol=2e-5, rtol=1e-4)
    # the rest of the later span keeps the anchored K/V, the first span is exact either way
    torch.testing.assert_close(head.cache.values[last][:, :, start + 2:start + later_len],
                               anchored.cache.values[last][:, :, start + 2:start + later_len], atol=0, rtol=0)
    first = slice(layout.import_starts[0], start)
    torch.testing.assert_close(head.cache.values[last][:, :, first], text.cache.values[last][:, :, first], atol=2e-5, rtol=1e-4)
    assert ProtocolSpec("kv-anchored+boundary", boundary_k=16, anchor_examples=40).label == "kv-anchored+boundary a=40 k=16"


def test_the_cli_expands_anchored_boundary_per_k():
    from kvcomm.cli import parse_protocols

    specs = parse_protocols("text,kv-anchored,kv-anchored+boundary", "0.15", "8,16", 12)
    assert [s.label for s in specs] == ["text", "kv-anchored a=12", "kv-anchored+boundary a=12 k=8",
                                        "kv-anchored+boundary a=12 k=16"]
