"""SLO kinds of agent jobs: parsing ``--slo``, and attainment from a replay's turns and jobs."""
import json

import pandas as pd
import pytest

from common.errors import ConfigError
from scheduling.slo import DEFAULT_SLO, SLOSpec, parse_slo
from scheduling.slo.attainment import attainment
from tests.gpubench.conftest import run_cli


def test_parse_slo_keeps_defaults_and_drops_a_kind():
    assert parse_slo(None) == DEFAULT_SLO == SLOSpec(2.0, 0.1, 10.0, None)
    assert parse_slo("ttft=1, job=600,tool-turn=none") == SLOSpec(1.0, 0.1, None, 600.0)


@pytest.mark.parametrize("text, message", [
    ("ttft=0", "finite number of seconds > 0"), ("latency=3", "expected KIND=SECONDS"),
    ("tpot=fast", "not a number of seconds"), ("job=inf", "finite number of seconds > 0"),
    ("ttft=1,ttft=2", "names ttft twice"),
])
def test_bad_slo_is_one_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_slo(text)


def frames():
    # job a: two turns (the first triggers a tool); job b: one turn of one output token
    turns = pd.DataFrame({
        "job_id": ["a", "a", "b"], "turn": [0, 1, 0],
        "arrival_s": [0.0, 20.0, 1.0], "first_token_s": [0.5, 23.0, 1.2], "finish_s": [12.0, 24.0, 1.2],
        "ttft_s": [0.5, 3.0, 0.2], "output_tokens": [116, 11, 1],
    })
    jobs = pd.DataFrame({"job_id": ["a", "b"], "arrival_s": [0.0, 1.0], "finish_s": [24.0, 1.2],
                         "jct_s": [24.0, 0.2], "num_turns": [2, 1]})
    return turns, jobs


def test_attainment_per_kind_turn_and_job():
    turns, jobs = frames()
    a = attainment(turns, jobs, SLOSpec(ttft_s=2.0, tpot_s=0.1, tool_turn_s=10.0, job_s=None))
    # a#0: ttft 0.5 ok, tpot 11.5/115 = 0.1 ok, tool turn 12 s > 10 s: misses; a#1: ttft 3 s misses
    # (its tpot 1/10 = 0.1 ok; the last turn triggers no tool); b#0: one token, meets all
    assert a["ttft"] == pytest.approx(2 / 3) and a["tpot"] == 1.0 and a["tool_turn"] == 0.0
    assert a["turn"] == pytest.approx(1 / 3) and a["job"] == 0.5 and a["job_deadline"] is None
    span = 24.0
    assert a["job_goodput_per_s"] == pytest.approx(1 / span) and a["token_goodput_per_s"] == pytest.approx(1 / span)
    loose = attainment(turns, jobs, SLOSpec(ttft_s=5.0, tpot_s=None, tool_turn_s=None, job_s=20.0))
    assert loose["turn"] == 1.0 and loose["job_deadline"] == 0.5 and loose["job"] == 0.5  # a's JCT 24 s > 20 s
    # a kind the SLO leaves out is not met by every turn: it has no attainment, as a job deadline without a target
    assert loose["tpot"] is None and loose["tool_turn"] is None and loose["ttft"] == 1.0


def test_replay_scores_its_slo_and_refuses_a_bad_one_before_work(tmp_path):
    out = tmp_path / "r"
    proc = run_cli("replay", "--jobs", "8", "--jps", "2", "--slo", "ttft=0.5,job=3600", "--out", str(out),
                   "--no-progress", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = json.loads((out / "summary.json").read_text())["metrics"]
    a = m["slo_attainment"]
    assert a["slo"] == {"ttft_s": 0.5, "tpot_s": 0.1, "tool_turn_s": 10.0, "job_s": 3600.0}
    assert a["turns"] == m["num_turns"] and 0 <= a["job"] <= a["turn"] <= 1 and m["slo"]["ttft_s"] == 0.5
    bad = run_cli("replay", "--jobs", "8", "--jps", "2", "--slo", "ttft=-1", "--out", str(tmp_path / "b"), timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "b").exists()


def test_sweep_tables_and_plots_carry_the_agent_slo(tmp_path):
    """tables.md has a table per SLO kind and the goodputs; slo_attainment_vs_jps.png is drawn."""
    import pandas as pd

    out = tmp_path / "sweep"
    proc = run_cli("sweep", "--policies", "fcfs", "sjf", "--skus", "l40s", "--jps", "0.5", "2", "--jobs", "20",
                   "--workers", "1", "--no-progress", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (out / "tables.md").read_text()
    for title in ("agent SLO: turns meeting every target", "agent SLO: jobs whose every turn meets it",
                  "agent SLO attainment: TTFT", "agent SLO attainment: tool-turn deadline", "job goodput",
                  "token goodput", "The agent SLO of these replays: TTFT <= 2 s, TPOT <= 100 ms"):
        assert title in text, title
    assert (out / "slo_attainment_vs_jps.png").stat().st_size > 10_000
    rows = pd.read_csv(out / "sweep.csv")
    cell = rows[(rows["policy"] == "sjf") & (rows["jps"] == 2)].iloc[0]
    assert f"| l40s | sjf | {rows[(rows['policy'] == 'sjf') & (rows['jps'] == 0.5)].iloc[0]['slo_attainment_turn']:.1%}" \
           f" | {cell['slo_attainment_turn']:.1%} |" in text
