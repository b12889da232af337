"""Tables that fit where they are printed: a terminal's width, or, in a pipe or a file, as wide as
their content (nothing cut: `gpubench skus | head` shows whole ids).

``console(width=None)``: a rich Console for stdout (or stderr) whose width is the terminal's
(``shutil.get_terminal_size``, which reads ``$COLUMNS`` first) when the stream is a terminal, and
unlimited otherwise; ``width`` overrides both (tests, callers that know better).

``table(columns, rows, width=...)``: a rich Table of string cells laid out for that width. Each
:class:`Col` says how it may give way when the table is wider than the width: ``keep`` columns
(ids) are never wrapped or cut; ``wrap`` columns (long text) wrap over lines; the others (numbers)
stay whole; columns with a ``drop`` rank are left out, rank 1 first, until the table fits,
and a caption names what was left out. Only when nothing is left to drop does rich shorten cells.
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from typing import Sequence

UNLIMITED = 100_000  # columns of a console that never wraps (a pipe, a file)
_MIN_WRAP = 12  # a wrapping column is not counted narrower than this (or its longest word)


@dataclass(frozen=True)
class Col:
    """One column: its header, alignment and how it gives way on a narrow terminal."""

    header: str
    justify: str = "left"
    keep: bool = False  # an id: never wrapped, never cut
    wrap: bool = False  # long text: wraps over lines when narrow
    drop: int = 0  # > 0: left out when the table does not fit, rank 1 first


def output_width(stream=None) -> int | None:
    """The terminal's columns when ``stream`` (default stdout) is a terminal, else None (no limit)."""
    stream = sys.stdout if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced stream
        tty = False
    return shutil.get_terminal_size().columns if tty else None


def console(width: int | None = None, *, stderr: bool = False):
    """A rich Console as wide as the terminal (``$COLUMNS`` first), unlimited when not a terminal."""
    from rich.console import Console

    if width is None:
        width = output_width(sys.stderr if stderr else sys.stdout) or UNLIMITED
    return Console(width=width, stderr=stderr)


def _need(col: Col, cells: list[str]) -> int:
    """The narrowest a column can be laid out without cutting a cell (wrapping ones: a word)."""
    texts = [col.header, *cells]
    if col.wrap:
        longest_word = max((len(w) for t in texts for w in t.split()), default=1)
        return min(max(longest_word, 1), max(_MIN_WRAP, 1))
    return max((len(t) for t in texts), default=1)


def min_table_width(columns: Sequence[Col], cells: list[list[str]]) -> int:
    """The narrowest rendering of these columns in rich's default box: cells + padding + borders."""
    return sum(_need(c, col) + 2 for c, col in zip(columns, cells)) + len(columns) + 1


def table(columns: Sequence[Col], rows: Sequence[Sequence[str]], *, width: int, title: str | None = None):
    """A rich Table of ``rows`` (string cells) that fits ``width`` columns where it can (see module)."""
    from rich.table import Table

    cols = list(columns)
    by_col = [[str(r[i]) for r in rows] for i in range(len(cols))]
    keep = list(range(len(cols)))
    dropped = []
    for i in sorted((i for i, c in enumerate(cols) if c.drop > 0), key=lambda i: cols[i].drop):
        if min_table_width([cols[k] for k in keep], [by_col[k] for k in keep]) <= width:
            break
        keep.remove(i)
        dropped.append(cols[i].header)
    caption = (f"{width} columns: left out {', '.join(dropped)} (a wider terminal, or a pipe, shows every column)"
               if dropped else None)
    t = Table(title=title, caption=caption)
    for k in keep:
        c = cols[k]
        if c.keep:
            t.add_column(c.header, justify=c.justify, no_wrap=True, min_width=_need(c, by_col[k]))  # type: ignore[arg-type]
        elif c.wrap:
            t.add_column(c.header, justify=c.justify, overflow="fold")  # type: ignore[arg-type]
        else:
            t.add_column(c.header, justify=c.justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        t.add_row(*(str(r[k]) for k in keep))
    return t
