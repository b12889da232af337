"""`gpubench replay --trace-out`: the Chrome trace of a real replay, checked against the replay's own tables."""
import json
from collections import defaultdict

import pandas as pd
import pytest

from gpubench.cli import main
from scheduling.viewer.trace_export import ENGINE_PID, JOBS_PID, STEPS_TID
from scheduling.workload.trace_synth import SyntheticParams, synthetic_jobs
from scheduling.workload.traces import save_trace, with_poisson_arrivals

SMALL = SyntheticParams(turns_mean=4, turns_min=2, turns_max=6, obs_tokens_median=100, obs_tokens_max=600,
                        out_tokens_median=20, out_tokens_max=60)
TURN_PHASES = ("queued", "prefill", "decode", "tool call")


def replay_with_trace(tmp_path, *extra):
    trace = save_trace(with_poisson_arrivals(synthetic_jobs(6, seed=3, params=SMALL), 2.0, seed=3), tmp_path / "t.jsonl")
    out, trace_out = tmp_path / "run", tmp_path / "trace.json"
    rc = main(["replay", "--trace", str(trace), "--step-cost", "constant:0.01", "--no-progress", "--out", str(out),
               "--trace-out", str(trace_out), *extra])
    assert rc == 0
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    steps = pd.read_csv(out / "steps.csv")
    turns = pd.read_csv(out / "turns.csv", dtype={"job_id": str})
    return json.loads(trace_out.read_text()), metrics, steps, turns


def check_schema_and_tracks(doc, metrics, steps, turns):
    events = doc["traceEvents"]
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= e.keys(), e
        assert e["ph"] in ("X", "C", "M") and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    step_events = [e for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == (ENGINE_PID, STEPS_TID)]
    assert len(step_events) == metrics["steps"] == len(steps)
    assert sum(e["args"]["scheduled_tokens"] for e in step_events) == int(turns["scheduled_tokens"].sum())
    assert sum(e["args"]["prefill_tokens"] for e in step_events) == int(steps["num_prefill_tokens"].sum())
    assert [e["args"]["num_seqs"] for e in step_events] == \
        (steps["num_prefill_seqs"] + steps["num_decode_seqs"]).tolist()

    # Each job has its own track; its phases follow one another without overlap.
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X" and e["pid"] == JOBS_PID:
            assert e["name"] in TURN_PHASES
            tracks[e["tid"]].append(e)
    assert len(tracks) == metrics["num_jobs"]
    for track in tracks.values():
        assert len({e["args"]["job_id"] for e in track}) == 1
        track.sort(key=lambda e: e["ts"])
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)
    job_names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == JOBS_PID}
    assert job_names == {f"job {j}" for j in turns["job_id"].unique()}
    # A turn's decode ends at its finish: one decode event per turn with more than its first token.
    decodes = [e for t in tracks.values() for e in t if e["name"] == "decode"]
    assert len(decodes) == int((turns["finish_s"] > turns["first_token_s"]).sum())

    kv = [e["args"] for e in events if e["ph"] == "C" and e["name"] == "KV blocks"]
    assert len(kv) == len(steps)
    assert all(c["used"] + c["free"] == metrics["num_gpu_blocks"] for c in kv)
    assert [c["used"] for c in kv] == steps["kv_used_blocks"].tolist()
    hits = [e["args"] for e in events if e["ph"] == "C" and e["name"] == "prefix-hit tokens"]
    return sum(c["gpu"] for c in hits)


def test_trace_of_a_replay_matches_its_tables(tmp_path):
    doc, metrics, steps, turns = replay_with_trace(tmp_path, "--policy", "continuum")
    gpu_hits = check_schema_and_tracks(doc, metrics, steps, turns)
    # Without preemption every admission is a turn's final one: the hit counter adds up to the summary.
    assert metrics["preemptions"] == 0 and metrics["hit_tokens"] > 0
    assert gpu_hits == metrics["hit_tokens"]


def test_trace_under_preemption_keeps_tracks_apart(tmp_path):
    doc, metrics, steps, turns = replay_with_trace(tmp_path, "--num-gpu-blocks", "160", "--jps", "50")
    assert metrics["preemptions"] > 0  # the case where a turn is scheduled more than once
    check_schema_and_tracks(doc, metrics, steps, turns)


def test_json_output_names_the_trace(tmp_path, capsys):
    trace_out = tmp_path / "t.json"
    rc = main(["replay", "--jobs", "2", "--jps", "1", "--preset", "scaled-cpu", "--step-cost", "constant:0.01",
               "--no-progress", "--json", "--out", str(tmp_path / "r"), "--trace-out", str(trace_out)])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["trace"] == str(trace_out) and trace_out.is_file()


@pytest.mark.parametrize("trace_out, extra, message", [
    ("a_file/t.json", [], "a_file is not a directory"),
    ("t.txt", [], "must end in .json"),
    ("a_dir.json", [], "is a directory"),
    ("t.json", ["--no-step-log"], "drop --no-step-log"),
])
def test_bad_trace_out_is_one_line_before_the_replay(tmp_path, capsys, trace_out, extra, message):
    (tmp_path / "a_dir.json").mkdir()
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "run"
    rc = main(["replay", "--jobs", "2", "--jps", "1", "--step-cost", "constant:0.01", "--no-progress",
               "--out", str(out), "--trace-out", str(tmp_path / trace_out), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()  # refused before the replay wrote anything
