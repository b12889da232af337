"""The placebo protocol: text's own K/V with noise of a matched KL, only on the imported spans."""
from __future__ import annotations

import math

import torch

from kvcomm.metrics import first_token_kl
from kvcomm.placebo import KL_TOLERANCE, placebo_reception
from kvcomm.protocols import ProtocolSpec, receive

from .test_protocols import _two_sender_setup


def test_placebo_with_no_target_is_text(tiny_model):
    layout, senders, prefix = _two_sender_setup(tiny_model)
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    for target in (0.0, float("nan")):
        got = placebo_reception(tiny_model, layout, prefix, text.last_logits, target, seed=1)
        torch.testing.assert_close(got.last_logits, text.last_logits, atol=1e-5, rtol=1e-5)
        assert got.extra["placebo"]["sigma"] == 0.0


def test_placebo_reaches_the_target_kl_by_noising_only_the_imported_tokens(tiny_model):
    layout, senders, prefix = _two_sender_setup(tiny_model)
    text = receive(tiny_model, ProtocolSpec("text"), layout, senders, prefix)
    rerotated = receive(tiny_model, ProtocolSpec("kv-rerotated"), layout, senders, prefix)
    target = first_token_kl(text.last_logits, rerotated.last_logits)
    assert target > 1e-4  # the senders' own prefixes differ from B's: there is something to match
    got = placebo_reception(tiny_model, layout, prefix, text.last_logits, target, seed=1)
    kl = first_token_kl(text.last_logits, got.last_logits)
    assert math.isclose(kl, target, rel_tol=KL_TOLERANCE) and got.extra["placebo"]["sigma"] > 0
    assert math.isclose(got.extra["placebo"]["kl"], kl, rel_tol=1e-6)
    imported = torch.zeros(len(layout.ids), dtype=torch.bool)
    imported[7:27] = imported[31:45] = True  # own 7 | A 20 | own 4 | C 14 | question 6
    for layer, (k, t) in enumerate(zip(got.cache.keys, text.cache.keys)):
        # B's own tokens before the question keep text's K/V; every imported token moved; the question
        # (computed on top of the noise) moves at every layer past the first
        torch.testing.assert_close(k[:, :, :31][:, :, ~imported[:31]], t[:, :, :31][:, :, ~imported[:31]])
        assert (k - t)[:, :, imported].abs().amax(dim=(0, 1, 3)).gt(0).all()
        if layer > 0:
            assert not torch.allclose(k[:, :, 45:], t[:, :, 45:])
    # the noise is seeded: the same seed gives the same reception, another a different one
    again = placebo_reception(tiny_model, layout, prefix, text.last_logits, target, seed=1)
    other = placebo_reception(tiny_model, layout, prefix, text.last_logits, target, seed=2)
    torch.testing.assert_close(again.last_logits, got.last_logits, atol=0, rtol=0)
    assert not torch.equal(other.cache.keys[1], got.cache.keys[1])


def test_kvcomm_eval_matches_the_placebo_to_kv_rerotated_and_never_judges_it(tiny_chat_model, tmp_path):
    from kvcomm.eval_report import PLACEBO, summarize
    from kvcomm.evaluate import EvalConfig, run_eval

    model, tok = tiny_chat_model
    cfg = EvalConfig(model="tiny", tasks=("drift3",), n=3, out_dir=tmp_path, max_new_tokens=2,
                     protocols=(ProtocolSpec("placebo"), ProtocolSpec("text"), ProtocolSpec("kv-rerotated")))
    rows = run_eval(cfg, model, tok, progress=False)
    rer = rows[rows["protocol"] == "kv-rerotated"].set_index("index")
    plc = rows[rows["protocol"] == "placebo"].set_index("index")
    for i in plc.index:
        info = plc.loc[i, "extra"]["placebo"]
        assert info["target_kl"] == rer.loc[i, "kl_text"] and info["matched"] == "kv-rerotated"
        assert math.isclose(plc.loc[i, "kl_text"], info["target_kl"], rel_tol=KL_TOLERANCE)
    summary = summarize(rows).set_index("protocol")
    assert summary.loc["placebo", "goal"] == PLACEBO and not summary.loc["placebo", "meets_goal"]
    # a run without kv-rerotated still matches its KL (computed untimed for the placebo)
    alone = run_eval(EvalConfig(model="tiny", tasks=("drift3",), n=3, out_dir=tmp_path / "alone", max_new_tokens=2,
                                protocols=(ProtocolSpec("text"), ProtocolSpec("placebo"))), model, tok, progress=False)
    assert alone[alone["protocol"] == "placebo"]["kl_text"].tolist() == plc["kl_text"].tolist()
