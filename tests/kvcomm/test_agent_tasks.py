"""The agent-like tasks: real drift, unaligned seams, own system prompts, answers derivable from the
facts, the two hops in two senders' notes; and `kvcomm eval` end to end on them (tiny model, n = 2)."""
from __future__ import annotations

import re

from kvcomm.layout import message_drift, receiver_layout_ids, sender_layout
from kvcomm.tasks import NUM_FACTS, RECEIVER_SYSTEM, generate


def _layout(tok, ex):
    return receiver_layout_ids(tok, ex, [sender_layout(tok, m)[1] for m in ex.messages])


def test_drift_moves_the_message_hundreds_of_tokens_and_breaks_the_seam(smollm2_tokenizer):
    tok = smollm2_tokenizer
    drifts = []
    for ex in generate("drift", 40, seed=0):
        (drift,) = message_drift(tok, ex)
        drifts.append(drift)
        # one-shot tokenization of B's prompt merges the header's space into the message's first token
        assert not _layout(tok, ex).seam_aligned
    assert min(drifts) >= 300 and max(drifts) - min(drifts) > 20  # varies with the log's length
    for ex in generate("keycode", 5):  # the old task, for contrast: 7 tokens, aligned
        assert message_drift(tok, ex) == [7] and _layout(tok, ex).seam_aligned


def test_drift_answer_is_the_logs_last_code_and_stated_once_in_the_notes():
    superseded = 0
    sender_prompts = set()
    for ex in generate("drift", 60, seed=1):
        (msg,) = ex.messages
        sender_prompts.add(msg.system_prompt)
        assert msg.system_prompt != RECEIVER_SYSTEM and "Notes" not in msg.system_prompt
        item = re.fullmatch(r"What is the code for the (.+)\?", ex.question).group(1)
        assert re.findall(rf"The code for the {item} is (\d{{4}})\.", msg.text) == [ex.answer]
        assert len(re.findall(r"is (\d{4})\.", msg.text)) == NUM_FACTS
        log_codes = re.findall(rf"code for the {item} (?:set to|changed from \d{{4}} to) (\d{{4}})", msg.instruction)
        assert log_codes and log_codes[-1] == ex.answer  # the notes report the code in force at the end
        superseded += len(re.findall(r"changed from (\d{4})", msg.instruction))
        assert ex.notes_header == "Notes from agent {agent}: " and ex.answer_prefix == f"The code for the {item} is"
    assert superseded >= 60  # old codes appear in the log: the message K/V attended to wrong values
    assert sender_prompts == {generate("drift", 1)[0].messages[0].system_prompt}


_SENTENCE = re.compile(r"([A-Z][\w ]+?) (works for|is married to|was founded by|is based in|was born in) ([A-Z][\w ]+?)\.")


def _facts(text: str) -> list[tuple[str, str, str]]:
    return _SENTENCE.findall(text)


def test_multihop_needs_one_fact_from_each_sender():
    templates = set()
    for ex in generate("multihop", 60, seed=2):
        a, c = ex.messages
        assert [a.agent, c.agent] == ["A", "C"] and a.system_prompt != c.system_prompt != RECEIVER_SYSTEM
        subject = next(s for s in _facts(a.text) if s[0] in ex.question or s[2] in ex.question)
        # the question names the first hop's subject; its object bridges to C's notes
        first = [f for f in _facts(a.text) if f[0] == subject[0]]
        assert len(first) == 1
        bridge = first[0][2]
        second = [f for f in _facts(c.text) if f[0] == bridge]
        assert len(second) == 1 and second[0][2] == ex.answer  # derivable by chaining the two facts
        assert ex.answer not in a.text and bridge not in ex.question  # neither sender alone answers it
        cities = [f[2] for f in _facts(c.text)]
        assert len(cities) == len(set(cities)) >= 3  # C's notes hold competing answers
        for sender in (a, c):  # each sender read its facts in a register, among filler sentences
            facts = _facts(sender.text)
            assert all(f"{x} {rel} {y}." in sender.instruction for x, rel, y in facts)
            assert sender.instruction.count(".") >= len(facts) + 3
        templates.add(first[0][1])
        assert ex.answer_prefix and ex.question.endswith("?")
    assert templates == {"works for", "is married to", "was founded by"}


def test_multihop_senders_read_their_register_first(smollm2_tokenizer):
    for ex in generate("multihop", 10, seed=0):
        assert all(d > 30 for d in message_drift(smollm2_tokenizer, ex))


def test_kvcomm_eval_end_to_end_on_the_new_tasks(tiny_chat_model_dir, smollm2_tokenizer, tmp_path, capsys):
    """`gpubench kvcomm eval --tasks drift,multihop` on a tiny random model (its answers are noise)."""
    from gpubench.cli import main
    from kvcomm.evaluate import load_rows

    out = tmp_path / "run"
    args = ["kvcomm", "eval", "--model", str(tiny_chat_model_dir), "--tasks", "drift,multihop", "--n", "2",
            "--protocols", "text,kv-rerotated,kv-blend", "--no-progress", "--max-tokens", "2", "--out", str(out)]
    assert main(args) == 0
    rows = load_rows(out)
    assert len(rows) == 2 * 2 * 3 and set(rows["task"]) == {"drift", "multihop"}
    for ex in generate("drift", 2) + generate("multihop", 2):
        for drift in rows[(rows["task"] == ex.task) & (rows["index"] == ex.index)]["drift_tokens"]:
            assert drift == message_drift(smollm2_tokenizer, ex)
    assert (rows[rows["protocol"] == "text"]["kl_text"] == 0).all()
    assert (rows[rows["protocol"] != "text"]["kl_text"] > 0).all()
    assert not rows[rows["task"] == "drift"]["seam_aligned"].any()
    md = (out / "summary.md").read_text()
    assert "| drift | kv-rerotated | 2 |" in md and "| multihop | kv-blend r=0.15 | 2 |" in md
    assert main(args[:5] + ["drift,multihopp"] + args[6:]) == 2
    assert "unknown task 'multihopp'" in capsys.readouterr().err


def test_drift3_has_three_drifted_senders_and_the_answer_in_exactly_one(smollm2_tokenizer):
    from kvcomm.tasks import DRIFT3_FACTS_PER_SENDER, DRIFT3_SENDERS

    holders = set()
    for ex in generate("drift3", 30, seed=0):
        assert [m.agent for m in ex.messages] == list(DRIFT3_SENDERS)
        assert len({m.system_prompt for m in ex.messages}) == 3  # each sender its own chat
        item = re.fullmatch(r"What is the code for the (.+)\?", ex.question).group(1)
        holder = [i for i, m in enumerate(ex.messages) if f"The code for the {item} is {ex.answer}." in m.text]
        assert len(holder) == 1
        holders.add(holder[0])
        codes = re.findall(r"is (\d{4})\.", " ".join(m.text for m in ex.messages))
        assert len(codes) == 3 * DRIFT3_FACTS_PER_SENDER and len(set(codes)) == len(codes)
        # each message was written after its own log: every sender's drift is in the hundreds
        assert all(d >= 150 for d in message_drift(smollm2_tokenizer, ex))
        msg = ex.messages[holder[0]]
        log_codes = re.findall(rf"code for the {item} (?:set to|changed from \d{{4}} to) (\d{{4}})", msg.instruction)
        assert log_codes and log_codes[-1] == ex.answer
    assert holders == {0, 1, 2}  # the asked code comes from any of the three senders


def test_kvcomm_eval_scores_the_summary_task_by_rouge_l_with_its_own_decode_budget(tiny_chat_model, tmp_path):
    from kvcomm.evaluate import EvalConfig, run_eval
    from kvcomm.example import rouge_l
    from kvcomm.protocols import ProtocolSpec

    model, tok = tiny_chat_model
    cfg = EvalConfig(model="tiny", tasks=("summary", "drift3"), n=2, out_dir=tmp_path, max_new_tokens=2,
                     protocols=(ProtocolSpec("text"), ProtocolSpec("kv-rerotated"), ProtocolSpec("kv-reencoded")))
    rows = run_eval(cfg, model, tok, progress=False)
    reenc = rows[rows["protocol"] == "remote-prefill"]  # asked for by its old name, kv-reencoded
    assert len(reenc) == 4 and all(e["sender_reencode_s"] > 0 for e in reenc["extra"])
    # one sender (summary): the span re-encoded in B's frame is B's own prefill, so B's first answer
    # token has text's distribution
    assert (reenc[reenc["task"] == "summary"]["kl_text"] < 1e-6).all()
    summ = rows[rows["task"] == "summary"]
    assert (summ["scoring"] == "rouge_l").all() and (rows[rows["task"] == "drift3"]["scoring"] == "exact").all()
    for r in summ.itertuples():
        assert r.f1 == rouge_l(r.prediction, r.answer)
    # the summary's budget is its own (40 tokens), not the run's --max-tokens 2
    longest = max(len(tok(g, add_special_tokens=False)["input_ids"]) for g in summ["generated"])
    drift3_longest = max(len(tok(g, add_special_tokens=False)["input_ids"]) for g in rows[rows["task"] == "drift3"]["generated"])
    assert drift3_longest <= 4 and longest > 10, (drift3_longest, longest)  # re-tokenized text: a token or two either way
    assert all(len(d) == 3 for d in rows[rows["task"] == "drift3"]["drift_tokens"])
