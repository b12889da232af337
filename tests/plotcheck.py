"""What a reader sees on a rendered matplotlib figure: the tick labels inside an axis's view, and
whether two artists' drawn boxes overlap. Shared by the plot tests of scheduling and kvcomm."""
from __future__ import annotations

MATHTEXT = ("\\times", "10^{", "$")


def drawn(fig):
    """The figure after a draw (tick labels and legend positions are only set by drawing)."""
    fig.canvas.draw()
    return fig


def visible_tick_labels(axis) -> list[str]:
    """The non-empty tick labels, major and minor, inside the axis's view limits."""
    low, high = sorted(axis.get_view_interval())
    ticks = axis.get_major_ticks() + axis.get_minor_ticks()
    return [t.label1.get_text() for t in ticks
            if t.label1.get_visible() and t.label1.get_text() and low <= t.get_loc() <= high]


def overlap(a, b) -> bool:
    """Whether two display-space boxes (``get_window_extent()``) share any area."""
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1
