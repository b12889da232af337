"""kv-own-anchored: KVCOMM's anchor offsets on the senders' own re-rotated caches (no sender
re-prefill), every sender offset, and the prefill fallback when no anchor matches (real tiny models)."""
from __future__ import annotations

import dataclasses
import math

import torch

from kvcomm.anchors import _probe_layer, anchored_span, falls_back, falls_back_after, own_pool, search_once, span_deviations
from kvcomm.models import rope_info
from kvcomm.protocols import ProtocolSpec, receive

from .test_protocols import _two_sender_setup

OWN = ProtocolSpec("kv-own-anchored")
ONCE = ProtocolSpec("kv-own-anchored-once")


def _pool(model, rope, shapes=((9, 5), (13, 8), (15, 6)), neighbours=8):
    spans = []
    for a_prefix, b_prefix in shapes:  # other examples: other chats and frames
        layout, senders, _ = _two_sender_setup(model, a_prefix=a_prefix, b_prefix=b_prefix)
        spans.append(span_deviations(model, layout, senders, rope, own=True))
    return own_pool(spans, neighbours=neighbours)


def test_a_pool_holding_the_example_itself_gives_texts_cache_with_no_sender_reprefill(tiny_model):
    # the example's own exact deviations, one neighbour: every token finds itself, so both senders'
    # own spans (the first one too: its sender's chat differs from B's) become B's own prefill
    rope = rope_info(tiny_model)
    layout, senders, prefix = _two_sender_setup(tiny_model)
    assert all(s.reencoded is None for s in senders)
    pool = own_pool([span_deviations(tiny_model, layout, senders, rope, own=True)], neighbours=1)
    assert math.isinf(pool.fallback_distance)  # one example: no other example to measure a limit against
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    rerotated = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, senders, prefix)
    for spec in (OWN, ONCE):  # once: each token finds itself at the middle layer, so at every layer too
        got = receive(tiny_model, spec, layout, senders, prefix, rope, pool)
        assert got.num_recomputed == 0
        for layer in range(tiny_model.config.num_hidden_layers):
            torch.testing.assert_close(got.cache.keys[layer], text.cache.keys[layer], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(got.cache.values[layer], text.cache.values[layer], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got.last_logits, text.last_logits, atol=1e-4, rtol=1e-4)
    assert float((rerotated.last_logits - text.last_logits).abs().max()) > 1e-3  # what it corrects


def test_offsets_from_other_examples_move_every_senders_span_but_not_layer_0(tiny_model):
    rope = rope_info(tiny_model)
    pool = _pool(tiny_model, rope)
    assert pool.keys[0] is None and 0 < pool.fallback_distance < math.inf
    layout, senders, _ = _two_sender_setup(tiny_model)
    for i, sender in enumerate(senders):
        start = layout.import_starts[i]
        moved = anchored_span(pool, i, sender.cache, start, rope, offset_first=True)
        placed = anchored_span(None, 0, sender.cache, start, rope)  # re-rotated into place, no offset
        torch.testing.assert_close(moved.keys[0], placed.keys[0])
        torch.testing.assert_close(moved.values[0], placed.values[0])
        assert not torch.allclose(moved.values[-1], placed.values[-1]) and torch.equal(moved.positions, placed.positions)


def test_a_span_no_anchor_matches_is_prefilled_by_b(tiny_model):
    rope = rope_info(tiny_model)
    layout, senders, prefix = _two_sender_setup(tiny_model)
    pool = _pool(tiny_model, rope)
    never = dataclasses.replace(pool, fallback_distance=math.inf)
    always = dataclasses.replace(pool, fallback_distance=0.0)
    assert not falls_back(never, senders[0].cache, rope) and falls_back(always, senders[0].cache, rope)
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    none = receive(tiny_model, OWN, layout, senders, prefix, rope, never)
    every = receive(tiny_model, OWN, layout, senders, prefix, rope, always)
    assert none.num_recomputed == 0 and every.num_recomputed == layout.num_imported == 34
    torch.testing.assert_close(every.last_logits, text.last_logits, atol=1e-5, rtol=1e-5)  # all prefilled: text
    # the limit is the pool's own: each anchor example against the others, at its 95th percentile
    far = [falls_back(pool, s.cache, rope) for s in senders]
    assert far == [falls_back(pool, s.cache, rope) for s in senders]  # deterministic
    # kv-own-anchored-once decides the fallback from its one search, as falls_back does
    for p in (never, always, pool):
        assert [falls_back_after(p, search_once(p, s.cache, rope)) for s in senders] == [falls_back(p, s.cache, rope) for s in senders]
    assert receive(tiny_model, ONCE, layout, senders, prefix, rope, always).num_recomputed == 34


def test_one_search_matches_the_per_layer_search_at_its_layer_and_parts_from_it_elsewhere(tiny_model):
    rope = rope_info(tiny_model)
    pool = _pool(tiny_model, rope)
    layout, senders, _ = _two_sender_setup(tiny_model)
    probe = _probe_layer(tiny_model.config.num_hidden_layers)
    parted = 0
    for i, sender in enumerate(senders):
        start, found = layout.import_starts[i], search_once(pool, sender.cache, rope)
        assert found.indices.shape == (pool.keys[probe].shape[0], sender.cache.num_tokens, pool.neighbours)
        once = anchored_span(pool, i, sender.cache, start, rope, offset_first=True, search=found)
        every = anchored_span(pool, i, sender.cache, start, rope, offset_first=True)
        torch.testing.assert_close(once.keys[probe], every.keys[probe], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(once.values[probe], every.values[probe], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(once.values[0], every.values[0])  # layer 0: no offset either way
        parted += sum(not torch.allclose(once.values[n], every.values[n]) for n in range(1, once.num_layers) if n != probe)
    assert parted > 0  # other layers' own neighbours differ: it is another estimate, not the same one


def test_kvcomm_eval_judges_kv_own_anchored_and_builds_its_pool_for_one_sender(tiny_chat_model, tmp_path):
    from kvcomm.eval_report import summarize
    from kvcomm.evaluate import EvalConfig, run_eval

    model, tok = tiny_chat_model
    cfg = EvalConfig(model="tiny", tasks=("handoff",), n=2, out_dir=tmp_path, max_new_tokens=2,
                     protocols=(ProtocolSpec("text"), ProtocolSpec("kv-own-anchored", anchor_examples=3)))
    rows = run_eval(cfg, model, tok, progress=False)
    own = rows[rows["protocol"] == "kv-own-anchored a=3"]
    assert len(own) == 2 and all(e["anchor_pool"]["examples"] == 3 for e in own["extra"])
    assert not any("sender_reencode_s" in e for e in own["extra"])  # no sender re-prefill
    goal = summarize(rows).set_index("protocol").loc["kv-own-anchored a=3", "goal"]
    assert not goal.startswith("reference") and not goal.startswith("placebo")
