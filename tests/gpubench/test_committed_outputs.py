"""Re-running a documented command cannot silently rewrite a checkout's committed results: an output
option that names a path holding git-tracked files is one line, exit 2, before any work, unless
GPUBENCH_REGENERATE=1 asks for it. Checked in a real git repository."""
import subprocess

import pytest

from common.errors import ConfigError
from common.outdir import REGENERATE_ENV, committed_files
from gpubench.cli import build_parser, check_outputs, main

FAST = ["--jobs", "2", "--jps", "1", "--step-cost", "constant:0.01", "--no-progress"]


@pytest.fixture()
def checkout(tmp_path, monkeypatch):
    """A git repository with one committed replay directory and one untracked directory."""
    monkeypatch.delenv(REGENERATE_ENV, raising=False)
    repo = tmp_path / "repo"
    (repo / "results" / "replay").mkdir(parents=True)
    (repo / "results" / "replay" / "COMMAND").write_text("gpubench replay ...\n# taken at load 0.9\n")
    (repo / "scratch").mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "results"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "results"], check=True)
    return repo


def test_a_replay_into_committed_results_is_refused_and_nothing_changes(checkout, capsys):
    committed = checkout / "results" / "replay"
    before = (committed / "COMMAND").read_text()
    assert main(["replay", *FAST, "--out", str(committed)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "results/replay/COMMAND" in err and REGENERATE_ENV in err
    assert sorted(p.name for p in committed.iterdir()) == ["COMMAND"] and (committed / "COMMAND").read_text() == before


def test_asked_for_it_regenerates_in_place(checkout, monkeypatch, capsys):
    monkeypatch.setenv(REGENERATE_ENV, "1")
    committed = checkout / "results" / "replay"
    assert main(["replay", *FAST, "--out", str(committed)]) == 0
    assert (committed / "summary.json").is_file()


def test_untracked_and_outside_paths_are_written_as_before(checkout, tmp_path, capsys):
    assert main(["replay", *FAST, "--out", str(checkout / "scratch" / "r")]) == 0
    assert main(["replay", *FAST, "--out", str(tmp_path / "elsewhere")]) == 0
    assert committed_files(tmp_path / "elsewhere") == []  # tmp_path is in no checkout


@pytest.mark.parametrize("argv, refused", [
    (["run", "--device", "cpu", "--out", "{c}"], True),  # a new run directory among committed results
    (["run", "--device", "cpu", "--out", "{r}"], True),  # the results root itself
    (["run", "--device", "cpu", "--out", "{s}"], False),  # a root with nothing committed
    (["run", "--device", "cpu", "--resume", "{c}"], True),  # appends to the committed run
    (["show", "{c}", "--plots"], True),  # PNGs next to the committed run
    (["show", "{c}", "--plots", "--out", "{s}"], False),
    (["fit", "{s}", "-o", "{c}/COMMAND"], True),  # a committed file itself
    (["trace", "stats", "--plot", "{s}/t.png"], False),
    (["kvcomm", "eval", "--out", "{c}"], True),
    (["sweep", "--out", "{c}"], True),
    (["view", "{s}", "--export", "{c}/COMMAND"], True),
])
def test_every_written_option_is_checked(checkout, argv, refused):
    paths = {"c": str(checkout / "results" / "replay"), "s": str(checkout / "scratch"), "r": str(checkout / "results")}
    args = build_parser().parse_args([a.format(**paths) for a in argv])
    if refused:
        with pytest.raises(ConfigError, match="committed to this checkout"):
            check_outputs(args)
    else:
        check_outputs(args)


def test_run_out_into_committed_results_is_one_line_before_any_work(checkout, monkeypatch):
    """`gpubench run --out results` (through the real console script) is refused, naming the way out,
    and creates nothing; GPUBENCH_REGENERATE=1 in front (what a committed COMMAND line is re-run
    with) lets the check pass."""
    from tests.conftest import gpubench

    before = sorted(p.relative_to(checkout) for p in checkout.rglob("*") if ".git" not in p.parts)
    res = gpubench("run", "--device", "cpu", "--probes", "launch", "--out", "results", cwd=checkout)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr
    assert "--out results: holds 1 file(s) committed" in lines[0] and "./gpubench-results" in lines[0]
    assert REGENERATE_ENV in lines[0]
    assert sorted(p.relative_to(checkout) for p in checkout.rglob("*") if ".git" not in p.parts) == before
    args = build_parser().parse_args(["run", "--device", "cpu", "--out", str(checkout / "results")])
    monkeypatch.setenv(REGENERATE_ENV, "1")
    check_outputs(args)
