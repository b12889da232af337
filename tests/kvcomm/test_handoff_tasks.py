"""The hand-off tasks: one entity, three facts of different kinds, drift of hundreds of tokens, no answer
prefix, three templates, one or two senders; ``choice`` scoring; and `kvcomm eval` end to end on them
(tiny model) with its per-template table."""
from __future__ import annotations

import re

import pytest

from kvcomm.example import Example, first_named, score
from kvcomm.handoff_tasks import TEMPLATES, WEEKDAYS
from kvcomm.layout import message_drift
from kvcomm.names import TASK_CHANCE
from kvcomm.tasks import generate


@pytest.mark.parametrize("task", ["handoff", "handoff2"])
def test_handoff_examples_state_the_answer_once_with_no_prefix_and_every_template(task):
    examples = generate(task, 60, seed=3)
    assert {ex.template for ex in examples} == {t.name for t in TEMPLATES}
    holders = set()
    for ex in examples:
        assert ex.answer_prefix == "" and ex.scoring == "choice" and ex.answer in ex.candidates
        assert len(ex.messages) == (1 if task == "handoff" else 2)
        # the answer is in exactly one sender's notes, and no other value of its kind is in any
        named = [(i, first_named(m.text, ex.candidates)) for i, m in enumerate(ex.messages)]
        assert [v for _, v in named if v is not None] == [ex.answer]
        holders |= {i for i, v in named if v == ex.answer}
        # the last line of the holder's log that sets this fact sets the answer (a superseded value first)
        fact = next(f for t in TEMPLATES for f in t.facts if t.name == ex.template and f.values == ex.candidates)
        key = re.fullmatch(re.escape(fact.question).replace(re.escape("{k}"), "(.+)"), ex.question).group(1)
        log = ex.messages[next(i for i, v in named if v == ex.answer)].instruction
        endings = tuple({f.format(k=key, v=v, old=o) for f in (fact.log_set, fact.log_change)
                         for v in ex.candidates for o in ex.candidates})
        sets = [line for line in log.splitlines() if line.endswith(endings)]
        assert sets and sets[-1].endswith(ex.answer)
    assert holders == ({0} if task == "handoff" else {0, 1})  # handoff2 asks about either sender's facts
    # generated per index: a longer run extends a shorter one
    assert generate(task, 5, seed=3) == examples[:5] and generate(task, 5, seed=4) != examples[:5]


def test_handoff_logs_hold_superseded_values_and_move_the_message_hundreds_of_tokens(smollm2_tokenizer):
    changed = 0
    drifts = []
    for ex in generate("handoff2", 30, seed=5):
        drifts += message_drift(smollm2_tokenizer, ex)
        changed += sum(len(re.findall(r" from (?:the )?(.+?) to ", m.instruction)) for m in ex.messages)
    assert min(drifts) >= 200 and max(drifts) - min(drifts) > 20
    assert 20 <= changed <= 70  # about half of the 90 facts were first set to another value


def test_choice_scoring_reads_the_first_value_of_the_asked_kind():
    ex = Example(task="t", index=0, messages=(), question="On which day does Greta Brandt leave?",
                 answer="Tuesday", scoring="choice", candidates=WEEKDAYS)
    for reply, right in [("Tuesday.", 1.0), ("Greta Brandt flies to Oslo and leaves on Tuesday.", 1.0),
                         ("She leaves on Monday, not Tuesday.", 0.0), ("Greta Brandt flies to Oslo.", 0.0),
                         ("", 0.0), ("TUESDAY", 1.0), ("Tuesdays", 0.0)]:
        assert score(ex, reply) == (right, right), reply
    rooms = ("Room 12", "Room 120")
    assert first_named("It goes to room 120.", rooms) == "Room 120"
    assert TASK_CHANCE["handoff"] == TASK_CHANCE["handoff2"] == 1 / len(WEEKDAYS)  # the smallest kind


def test_kvcomm_eval_on_handoff_writes_the_per_template_table(tiny_chat_model, tmp_path):
    import pandas as pd

    from kvcomm.eval_report import write_reports
    from kvcomm.evaluate import EvalConfig, run_eval
    from kvcomm.protocols import ProtocolSpec

    model, tok = tiny_chat_model
    cfg = EvalConfig(model="tiny", tasks=("handoff2",), n=4, out_dir=tmp_path, max_new_tokens=2,
                     protocols=(ProtocolSpec("text"), ProtocolSpec("kv-rerotated")))
    rows = run_eval(cfg, model, tok, progress=False)
    assert (rows["scoring"] == "choice").all() and set(rows["template"]) <= {t.name for t in TEMPLATES}
    write_reports(tmp_path, rows, "gpubench kvcomm eval --tasks handoff2 --n 4")
    table = pd.read_csv(tmp_path / "summary_by_template.csv")
    assert set(table["protocol"]) == {"text", "kv-rerotated"} and table["n"].sum() == 8
    assert "## By template" in (tmp_path / "summary.md").read_text()
    text = table[table["protocol"] == "text"]
    assert ((text["retention"] == 1.0) | text["retention"].isna()).all()  # text keeps all its own right answers


OWN, ONCE = "kv-own-anchored a=40", "kv-own-anchored-once a=40"


@pytest.mark.parametrize("run, judged", [("handoff-seed11", OWN), ("handoff2-seed11", OWN), ("handoff-seed12", OWN),
                                         ("handoff2-seed12", OWN), ("handoff-design-once", ONCE),
                                         ("handoff-once-seed13", ONCE), ("handoff2-once-seed13", ONCE),
                                         ("handoff-layers-seed13", "kv-layers a=40")])
def test_committed_handoff_summaries_regenerate_from_their_rows(run, judged, tmp_path):
    """The committed scoring runs: their COMMAND, rerun on a copy holding every row, rewrites the same
    summaries (nothing is measured: no model is loaded)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd

    repo = Path(__file__).resolve().parents[2]
    src = repo / "results/kvcomm" / run
    out = tmp_path / run
    shutil.copytree(src, out)
    argv = (src / "COMMAND").read_text().splitlines()[0].split()[1:]
    argv[argv.index("--out") + 1] = str(out)
    proc = subprocess.run([sys.executable, "-m", "gpubench", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(repo)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("summary.csv", "summary_by_template.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(out / name), pd.read_csv(src / name))
    rows = pd.read_csv(out / "summary.csv").set_index(["task", "protocol"]).xs(judged, level="protocol")
    assert (rows.recompute_fraction <= 0.15).all() and (rows.num_text_right >= (24 if "design" in run else 59)).all()
