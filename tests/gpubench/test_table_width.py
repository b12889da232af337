"""Tables fit the terminal they are printed on, and are never cut in a pipe: `gpubench skus | head`
used to print `a10...` for every id, and show, run and compare always drew 160 columns."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from common import termtable
from gpubench import skus
from gpubench.bench_output import SUMMARY_COLUMNS
from tests.conftest import REPO, gpubench

RUN = REPO / "results/cpu/20261129T174152Z-vm"  # a committed run with long "% of" notes
QUIET = REPO / "results/cpu/20261204T065713Z-vm"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def in_pty(*args: str, columns: int) -> str:
    """``python -m gpubench ARGS`` with stdout on a pseudo-terminal of ``$COLUMNS`` columns; its
    output without colour codes."""
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               COLUMNS=str(columns), NO_COLOR="1", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "gpubench", *args], stdout=slave, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    return ANSI.sub("", b"".join(chunks).decode()).replace("\r", "")


def test_skus_in_a_pipe_shows_every_id_whole_whatever_columns_says():
    ids = skus.all_ids()
    for env_columns in (None, "80"):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env.pop("COLUMNS", None)
        if env_columns:
            env["COLUMNS"] = env_columns
        res = subprocess.run([sys.executable, "-m", "gpubench", "skus"], capture_output=True, text=True, env=env,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        assert "…" not in res.stdout and "..." not in res.stdout
        for i in ids:
            assert f"│ {i} " in res.stdout, i
        assert "left out" not in res.stdout  # a pipe gets every column


@pytest.mark.parametrize("argv", [("skus",), ("show", str(RUN)), ("compare", str(QUIET), str(RUN), "--all"),
                                  ("predict", "--sku", "h100", "--batch", "4", "--breakdown")])
def test_on_an_80_column_terminal_every_line_fits(argv):
    out = in_pty(*argv, columns=80)
    lines = out.splitlines()
    if argv[0] == "predict":  # its headline lines are plain prints, which the terminal wraps: the table
        lines = [ln for ln in lines if ln[:1] in "┏┃┡│└"]
    assert len(lines) > 5
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    if argv[0] == "skus":
        for i in skus.all_ids():
            assert f"│ {i} " in out, i  # the id column is never cut
        assert "80 columns: left out" in " ".join(out.split())


@pytest.mark.parametrize("width", [72, 80, 100, 132])
def test_the_renderers_fit_the_width_they_are_given(width):
    from gpubench.bench_output import compare_table, print_summary, skus_table
    from gpubench.compare import compare_runs
    from gpubench.report import summarize_run
    from gpubench.results import load

    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None)
    con.print(skus_table([skus.get(i) for i in skus.all_ids()], width))
    print_summary(summarize_run(load(RUN)), con)
    con.print(compare_table(compare_runs([load(QUIET), load(RUN)]), True, width))
    lines = buf.getvalue().splitlines()
    assert max(len(ln) for ln in lines) <= width, max(lines, key=len)
    for i in skus.all_ids():
        assert f"│ {i} " in buf.getvalue()


def test_a_table_drops_the_least_important_columns_first_and_says_so():
    cols = [termtable.Col("id", keep=True), termtable.Col("text", wrap=True), termtable.Col("a", "right", drop=2),
            termtable.Col("b", "right", drop=1)]
    rows = [["a-very-long-identifier", "some words that can wrap", "1234567890", "0987654321"]]
    buf = io.StringIO()
    con = Console(file=buf, width=50, color_system=None)
    con.print(termtable.table(cols, rows, width=50))
    text = buf.getvalue()
    assert "a-very-long-identifier" in text and "1234567890" in text and "0987654321" not in text
    assert "left out b" in " ".join(text.split()) and max(len(ln) for ln in text.splitlines()) <= 50
    wide = io.StringIO()
    Console(file=wide, width=termtable.UNLIMITED, color_system=None).print(termtable.table(cols, rows, width=termtable.UNLIMITED))
    assert "0987654321" in wide.getvalue() and "left out" not in wide.getvalue()


def test_console_width_is_the_terminals_or_unlimited(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "91")
    monkeypatch.setattr(sys, "stdout", Tty())
    assert termtable.console().width == 91
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert termtable.console().width == termtable.UNLIMITED
    assert termtable.console(70).width == 70


def test_show_in_a_pipe_keeps_every_column():
    res = gpubench("show", str(QUIET))
    assert res.returncode == 0
    header = next(ln for ln in res.stdout.splitlines() if ln.startswith("┃"))
    assert [c.strip() for c in header.strip("┃").split("┃")] == [c.header for c in SUMMARY_COLUMNS]
