"""Task generators are seeded, prefix-stable, and their answers are checkable from the messages."""
from __future__ import annotations

import re

import pytest

from common.errors import KVCommError
from kvcomm.example import exact_match, extract_answer, normalize, token_f1
from kvcomm.tasks import NUM_FACTS, NUM_ROOMS_PER_SENDER, TASKS, generate


@pytest.mark.parametrize("task", sorted(TASKS))
def test_seeded_and_prefix_stable(task):
    a, b = generate(task, 20, seed=3), generate(task, 20, seed=3)
    assert a == b
    assert generate(task, 5, seed=3) == a[:5]  # example i does not depend on n: resume extends a run
    assert generate(task, 20, seed=4) != a
    assert [e.index for e in a] == list(range(20)) and len({e.example_id for e in a}) == 20


def test_keycode_answer_is_stated_once_among_distractors():
    for ex in generate("keycode", 50, seed=0):
        notes = ex.messages[0].text
        item = re.match(r"What is the code for the (.+)\?", ex.question).group(1)
        assert re.findall(rf"The code for the {item} is (\d{{4}})\.", notes) == [ex.answer]
        codes = re.findall(r"is (\d{4})\.", notes)
        assert len(codes) == NUM_FACTS and len(set(codes)) == NUM_FACTS  # distractors, distinct codes
        assert ex.answer_prefix == f"The code for the {item} is"
        assert [m.agent for m in ex.messages] == ["A"] and ex.messages[0].system_prompt.startswith("You are agent A")


def test_twoagent_splits_facts_between_two_senders():
    where = {0: 0, 1: 0}
    for ex in generate("twoagent", 60, seed=0):
        assert [m.agent for m in ex.messages] == ["A", "C"]
        who = re.match(r"What is (\w+)'s room number\?", ex.question).group(1)
        holder = [i for i, m in enumerate(ex.messages) if f"{who}'s room number is {ex.answer}." in m.text]
        assert len(holder) == 1 and ex.answer_prefix == f"{who}'s room number is"
        numbers = re.findall(r"is (\d{3})\.", "\n".join(m.text for m in ex.messages))
        assert len(numbers) == 2 * NUM_ROOMS_PER_SENDER and len(set(numbers)) == len(numbers)
        where[holder[0]] += 1
    assert min(where.values()) >= 15  # the asked fact is in either sender's notes


def test_scoring():
    assert normalize(" The Code: 4821.") == "code 4821"
    assert exact_match(extract_answer(" 4821.\nsomething else"), "4821") == 1.0
    assert exact_match(" 4812.", "4821") == 0.0
    assert extract_answer("\n\n  \n") == ""
    assert token_f1("4821", "4821") == 1.0 and token_f1("", "4821") == 0.0
    assert token_f1("code is 4821", "4821") == pytest.approx(2 * (1 / 3) / (1 / 3 + 1))


def test_unknown_task_and_bad_n():
    with pytest.raises(KVCommError, match="keycode"):
        generate("keycod", 3)
    with pytest.raises(KVCommError, match="n >= 1"):
        generate("keycode", 0)


def test_rouge_l_against_hand_computed_values():
    from kvcomm.example import rouge_l

    # LCS("the cat sat on mat", "cat on the mat") after dropping articles: [cat sat on mat] vs
    # [cat on mat] -> LCS 3; P = 3/4, R = 3/3, F = 6/7
    assert rouge_l("The cat sat on the mat", "cat on the mat") == pytest.approx(6 / 7)
    assert rouge_l("w x y z", "w x y z") == 1.0 and rouge_l("x y", "v w") == 0.0
    assert rouge_l("y x", "x y") == pytest.approx(0.5)  # a subsequence keeps order: LCS 1
    assert rouge_l("", "") == 1.0 and rouge_l("", "x") == 0.0


def test_summary_task_reference_and_notes_share_the_facts():
    from kvcomm.example import rouge_l, score
    from kvcomm.tasks import SUMMARY_ANSWER_TOKENS

    for ex in generate("summary", 30, seed=0):
        (msg,) = ex.messages
        assert ex.scoring == "rouge_l" and ex.answer_tokens == SUMMARY_ANSWER_TOKENS
        assert "incident |" in msg.instruction and msg.text.split(".")[0] in msg.instruction
        # copying A's notes scores well but not perfectly; an unrelated sentence scores low
        assert 0.6 < rouge_l(msg.text, ex.answer) < 1.0
        assert rouge_l("The weather was sunny all week.", ex.answer) < 0.15
        em, f1 = score(ex, ex.answer)
        assert (em, f1) == (1.0, 1.0)
