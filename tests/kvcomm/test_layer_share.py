"""kv-layers: KVComm's (KTH) selective layer sharing, on real tiny models (the masked attention runs
transformers' own SDPA path) and through ``kvcomm eval``."""
from __future__ import annotations

import math

import pytest
import torch

from common.errors import KVCommError
from kvcomm.cache import continue_from
from kvcomm.layer_share import AttentionMeter, HiddenSpans, choose_layers, hidden, metered
from kvcomm.protocols import ProtocolSpec, receive

from .test_protocols import _two_sender_setup

LAYERS = ProtocolSpec("kv-layers")


def _imported_spans(layout):
    return layout.import_spans


def test_sharing_every_layer_is_kv_rerotated(tiny_model):
    layout, senders, prefix = _two_sender_setup(tiny_model)
    every = frozenset(range(tiny_model.config.num_hidden_layers))
    got = receive(tiny_model, LAYERS, layout, senders, prefix, shared_layers=every)
    rerotated = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, senders, prefix)
    torch.testing.assert_close(got.last_logits, rerotated.last_logits, atol=1e-5, rtol=1e-5)
    assert got.num_recomputed == 0 and got.extra["shared_layers"] == sorted(every)
    assert tiny_model.config._attn_implementation == "sdpa"  # the scope switched it back


def test_a_message_hidden_at_every_layer_is_a_message_never_sent(tiny_model):
    # B's own tokens computed at their positions in B's prompt, with the imported slots skipped: what
    # B computes when no layer of the messages is visible
    layout, senders, prefix = _two_sender_setup(tiny_model)
    everywhere = HiddenSpans(layers=frozenset(range(tiny_model.config.num_hidden_layers)), spans=_imported_spans(layout))
    with hidden(tiny_model, everywhere):  # every token B computes after its prefix, the separator too
        masked = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, senders, prefix).last_logits
    # the reference: B's own segments only, at their positions in B's prompt
    own_ids, own_positions, pos = [], [], len(layout.segments[0].ids)
    for seg in layout.segments[1:]:
        if seg.kind == "own":
            own_ids += seg.ids
            own_positions += range(pos, pos + len(seg.ids))
        pos += len(seg.ids)
    _, never_sent = continue_from(tiny_model, prefix, own_ids, positions=own_positions, last_only=True)
    torch.testing.assert_close(masked, never_sent[0, -1], atol=1e-5, rtol=1e-5)
    seen = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, senders, prefix).last_logits
    assert float((seen - masked).abs().max()) > 1e-3  # outside the scope it sees them


def test_the_answer_is_decoded_under_the_same_mask(tiny_model, tmp_path):
    layout, senders, prefix = _two_sender_setup(tiny_model)
    shared = frozenset({0})
    rec = receive(tiny_model, LAYERS, layout, senders, prefix, shared_layers=shared)
    assert rec.hidden is not None and rec.hidden.spans == ((7, 27), (31, 45))  # own 7 | A 20 | own 4 | C 14 | own
    assert rec.hidden.layers == frozenset(range(1, tiny_model.config.num_hidden_layers))
    with rec.scope(tiny_model):
        _, inside = continue_from(tiny_model, rec.cache, [int(rec.last_logits.argmax())], last_only=True)
    _, outside = continue_from(tiny_model, rec.cache, [int(rec.last_logits.argmax())], last_only=True)
    assert float((inside - outside).abs().max()) > 1e-3
    with pytest.raises(KVCommError, match="needs its shared layers"):
        receive(tiny_model, LAYERS, layout, senders, prefix)


def test_the_meter_reads_the_attention_mass_the_eager_path_returns(tiny_llama):
    layout, senders, prefix = _two_sender_setup(tiny_llama)
    spans = _imported_spans(layout)
    meter = AttentionMeter(spans=spans)
    with metered(tiny_llama, meter):
        receive(tiny_llama, ProtocolSpec("text"), layout, senders, prefix)
    assert sorted(meter.mass) == list(range(tiny_llama.config.num_hidden_layers))
    # the same mass from transformers' eager attention weights over the whole prompt
    tiny_llama.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = tiny_llama(input_ids=torch.tensor([layout.ids]), output_attentions=True)
    finally:
        tiny_llama.config._attn_implementation = "sdpa"
    after = spans[-1][1]
    for layer, weights in enumerate(out.attentions):
        expected = sum(weights[0, :, after:, a:b].sum(-1) for a, b in spans).mean()
        assert meter.mass[layer] == [pytest.approx(float(expected), abs=1e-5)]
        assert 0 < meter.mass[layer][0] < 1


def test_choose_layers_keeps_the_share_with_the_most_mass():
    mass = {0: 0.1, 1: 0.5, 2: 0.05, 3: 0.4, 4: 0.3, 5: 0.2, 6: 0.0, 7: 0.6, 8: 0.01, 9: 0.02}
    assert choose_layers(mass, 10) == frozenset({7, 1, 3})  # ceil(0.3 * 10) = 3
    assert choose_layers(mass, 10, share=0.01) == frozenset({7})
    with pytest.raises(KVCommError, match="share"):
        choose_layers(mass, 10, share=0)
    with pytest.raises(KVCommError, match="layers"):
        choose_layers(mass, 12)


def test_kvcomm_eval_chooses_the_layers_on_another_seed_and_ships_their_bytes(tiny_chat_model, tmp_path):
    from kvcomm.evaluate import EvalConfig, run_eval

    model, tok = tiny_chat_model
    cfg = EvalConfig(model="tiny", tasks=("handoff2",), n=2, out_dir=tmp_path, max_new_tokens=2,
                     protocols=(ProtocolSpec("text"), ProtocolSpec("kv-layers", anchor_examples=3)))
    rows = run_eval(cfg, model, tok, progress=False)
    text, layers = rows[rows["protocol"] == "text"], rows[rows["protocol"] == "kv-layers a=3"]
    num_layers = model.config.num_hidden_layers
    shared = [e["shared_layers"] for e in layers["extra"]]
    assert len(layers) == 2 and shared[0] == shared[1] and len(shared[0]) == math.ceil(0.3 * num_layers)
    for t, mine in zip(text["transfer_bytes"], layers["transfer_bytes"]):
        assert mine["bf16"] == t["bf16"] * len(shared[0]) // num_layers and mine["text_utf8"] == t["text_utf8"]
    assert (layers["num_recomputed"] == 0).all()
