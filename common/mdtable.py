"""The one Markdown table writer: every table the tools write into .md files or print goes through it.

Callers format their own cells (each table has its own units and precision); this module only lays
them out as a GitHub table: a header row, a ``|---|`` rule, one row per record.
"""
from __future__ import annotations

from typing import Iterable, Sequence


def markdown_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """``header`` and ``rows`` (cells as ``str()`` gives them) as table lines, without a trailing newline.

    Raises:
        ValueError: a row with another number of cells than the header (a caller's bug).
    """
    width = len(header)
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * width]
    for row in rows:
        cells = list(row)
        if len(cells) != width:
            raise ValueError(f"a table row has {len(cells)} cells, the header {width}: {cells!r}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)
