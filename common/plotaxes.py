"""Log axes a reader can read at a glance: plain numbers (600, 0.03), never 6x10^2.

Matplotlib's default log formatter writes minor ticks in mathtext (``6\\times10^{2}``), and over a
range narrower than a decade it may label no tick at all once minor ticks are off. Here the choice
of which ticks get a label stays matplotlib's (``LogFormatter``: every minor tick over a narrow
range, some over a few decades, none over many), only the text is a plain number.
"""
from __future__ import annotations

from typing import Any


def plain_number(x: float) -> str:
    """600, 2000, 0.5, 0.003; whole numbers in full (1e5 reads as 100000), others as ``{:g}``."""
    return f"{x:.0f}" if x >= 1 and x == round(x) else f"{x:g}"


def plain_log_ticks(axis: Any) -> None:
    """Label a log-scaled ``ax.xaxis`` / ``ax.yaxis`` with plain numbers on major and minor ticks."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return plain_number(x) if super().__call__(x, pos) else ""

    axis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))

