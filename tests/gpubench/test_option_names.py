"""One name per option across commands: --no-progress (replay, sweep, kvcomm), --jobs N (replay,
sweep, trace), --set [POLICY.]KEY=VALUE (run, sweep, replay), --repeats N (run, kvcomm), --out
(every command that writes), --max-tokens (vllm generate, kvcomm eval), and --json on every command
whose output is a result. The old spellings (--quiet, --synthetic, --reps, --output,
--max-new-tokens) still work, say once on stderr which name to use, and are hidden from --help and
from shell completion."""
import contextlib
import io
import json

import pandas as pd
import pytest

from gpubench.cli import build_parser, main
from gpubench.completion import command_tree
from scheduling.workload.trace_synth import synthetic_jobs
from scheduling.workload.traces import save_trace, with_poisson_arrivals

FAST = ["--step-cost", "constant:0.01", "--jps", "1"]


def replay(tmp_path, name, *argv, capsys):
    rc = main(["replay", *argv, "--out", str(tmp_path / name), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    doc = json.loads(captured.out)
    steps = pd.read_csv(tmp_path / name / "steps.csv")
    return doc, steps, captured.err


def same_outcome(a, b):
    """Two replays' config and metrics (wall-clock fields aside) and step logs are the same."""
    (doc_a, steps_a, _), (doc_b, steps_b, _) = a, b
    wall = ("sim_wall_s", "steps_per_wall_s")
    assert doc_a["config"] == doc_b["config"]
    assert {k: v for k, v in doc_a["metrics"].items() if k not in wall} == \
        {k: v for k, v in doc_b["metrics"].items() if k not in wall}
    pd.testing.assert_frame_equal(steps_a, steps_b)


def test_old_replay_spellings_give_the_same_replay_with_a_note(tmp_path, capsys):
    canonical = replay(tmp_path, "new", "--jobs", "3", *FAST, "--no-progress", capsys=capsys)
    old = replay(tmp_path, "old", "--synthetic", "3", *FAST, "--quiet", capsys=capsys)
    same_outcome(canonical, old)
    # a replay this small never fills the KV pool and says so; that note is the same for both spellings
    pool = "note: the GPU KV pool never filled"
    assert [line for line in canonical[2].splitlines() if not line.startswith(pool)] == []
    notes = [line for line in old[2].strip().splitlines() if not line.startswith(pool)]
    assert notes == ["gpubench replay: note: --synthetic is deprecated, use --jobs (same meaning)",
                     "gpubench replay: note: --quiet is deprecated, use --no-progress (same meaning)"]


def test_replay_set_is_the_dedicated_option_in_sweep_words(tmp_path, capsys):
    flags = replay(tmp_path, "flags", "--jobs", "3", *FAST, "--no-progress", "--policy", "continuum",
                   "--ttl-rule", "fixed", "--ttl-s", "5", "--max-num-seqs", "2", capsys=capsys)
    sets = replay(tmp_path, "sets", "--jobs", "3", *FAST, "--no-progress", "--policy", "continuum",
                  "--set", "continuum.ttl_rule=fixed", "--set", "continuum.ttl_s=5", "--set", "max_num_seqs=2",
                  capsys=capsys)
    same_outcome(flags, sets)
    assert sets[0]["config"]["policy_params"] == {"ttl_rule": "fixed", "ttl_s": 5}
    assert sets[0]["config"]["max_num_seqs"] == 2


def test_jobs_with_a_trace_keeps_its_first_n_jobs(tmp_path, capsys):
    trace = save_trace(with_poisson_arrivals(synthetic_jobs(5, seed=1), 1.0, seed=1), tmp_path / "t.jsonl")
    doc, _, _ = replay(tmp_path, "cut", "--trace", str(trace), "--jobs", "2", "--step-cost", "constant:0.01",
                       "--no-progress", capsys=capsys)
    assert doc["metrics"]["num_jobs"] == 2


@pytest.mark.parametrize("argv, message", [
    (["replay", "--jobs", "2", *FAST, "--set", "nope=1"], "unknown engine setting"),
    (["replay", "--jobs", "2", *FAST, "--set", "lmcache.chunk_tokens=64"], "not of the replayed 'fcfs'"),
    (["replay", "--jobs", "2", *FAST, "--set", "max_num_seqs=0"], "must be an integer >= 1"),
    (["replay", "--jps", "1"], "give the jobs"),
])
def test_bad_replay_options_are_one_line(tmp_path, capsys, argv, message):
    rc = main([*argv, "--no-progress", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_sweep_quiet_is_no_progress(capsys):
    parser = build_parser()
    canonical = parser.parse_args(["sweep", "--out", "o", "--no-progress"])
    old = parser.parse_args(["sweep", "--out", "o", "--quiet"])
    assert "--quiet is deprecated, use --no-progress" in capsys.readouterr().err
    assert vars(canonical) == vars(old) and canonical.no_progress is True
    assert parser.parse_args(["sweep", "--out", "o"]).no_progress is False
    assert parser.parse_args(["replay", "--out", "o"]).no_progress is False


def help_text(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_help_and_completion_list_only_the_canonical_names(command):
    text = help_text(command)
    assert "--no-progress" in text and "--jobs" in text and "--set" in text
    assert "--quiet" not in text and "--synthetic" not in text
    options = command_tree(build_parser())[command]["options"]
    assert {"--no-progress", "--jobs", "--set"} <= set(options)
    assert not {"--quiet", "--synthetic"} & set(options)


# Old spelling -> (command, canonical spelling, a value or None for a flag, the destination).
RENAMED = {
    "--reps": (["run"], "--repeats", "3", "reps"),
    "--output": (["fit", "RUN"], "--out", "cal.json", "output"),
    "--max-new-tokens": (["kvcomm", "eval", "--out", "o"], "--max-tokens", "2", "max_new_tokens"),
    "--synthetic": (["replay", "--out", "o"], "--jobs", "3", "num_jobs"),
    "--quiet": (["replay", "--out", "o"], "--no-progress", None, "no_progress"),
}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_spelling_parses_like_the_canonical_one_with_a_note(old, capsys):
    command, canonical, value, dest = RENAMED[old]
    parser = build_parser()
    tail = [value] if value is not None else []
    new_args = parser.parse_args([*command, canonical, *tail])
    assert capsys.readouterr().err == ""
    old_args = parser.parse_args([*command, old, *tail])
    assert capsys.readouterr().err.strip().endswith(f"{old} is deprecated, use {canonical} (same meaning)")
    assert vars(old_args) == vars(new_args)
    assert getattr(new_args, dest) == (int(value) if value and value.isdigit() else value or True)


# Commands whose output is not a result to parse: a server that runs until stopped, the viewer (a
# browser page), and a shell script.
NO_JSON = {"view", "vllm serve", "completion"}


def test_every_command_shows_only_canonical_names_and_takes_json():
    tree = command_tree(build_parser())  # "command path" -> its subcommands and visible options
    leaves = {path: set(node["options"]) for path, node in tree.items() if path and not node["subcommands"]}
    assert {"run", "fit", "kvcomm eval", "kvcomm ttft", "trace swesmith", "vllm generate"} <= set(leaves)
    for command, options in leaves.items():
        assert not set(RENAMED) & options, command  # old spellings stay hidden
        assert ("--json" in options) == (command not in NO_JSON), command
