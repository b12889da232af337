"""The log axes of the scheduling plots (sweep metric vs load, trace statistics) read as plain
numbers: 600, not matplotlib's default 6x10^2 mathtext on minor ticks."""
from __future__ import annotations

import pandas as pd
import pytest

from tests.plotcheck import MATHTEXT, drawn, visible_tick_labels


@pytest.fixture
def log_axis_labels(monkeypatch):
    """Every figure saved during the test, drawn: the labels of each log axis, by figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seen: list[list[list[str]]] = []
    real = Figure.savefig

    def keep(fig, *args, **kwargs):
        real(fig, *args, **kwargs)
        drawn(fig)
        seen.append([visible_tick_labels(axis) for ax in fig.axes if ax.get_visible()
                     for axis in (ax.xaxis, ax.yaxis) if axis.get_scale() == "log"])

    monkeypatch.setattr(Figure, "savefig", keep)
    return seen


def _sweep_frame() -> pd.DataFrame:
    rows = []
    for policy, scale in (("fcfs", 1.0), ("continuum", 0.7)):
        for jps, jct in ((0.5, 420.0), (1.0, 610.0), (2.0, 880.0)):  # within one decade: minor ticks labelled
            for seed in (0, 1):
                rows.append({"sku": "h100", "policy": policy, "jps": jps, "seed": seed, "error": "",
                             "jct_mean_s": scale * jct + seed, "jct_p90_s": 1.1 * scale * jct + seed,
                             "ttft_p50_s": 0.3 * scale * jps, "ttft_p90_s": 0.5 * scale * jps,
                             "tpot_p50_s": 0.04 * scale, "tpot_p90_s": 0.06 * scale})
    return pd.DataFrame(rows)


def _assert_plain(labels: list[str]) -> None:
    assert len(labels) >= 2, labels
    assert not [text for text in labels if any(m in text for m in MATHTEXT)], labels
    assert all(float(text.replace("\u2212", "-")) > 0 for text in labels), labels


def test_sweep_log_axes_show_plain_numbers(tmp_path, log_axis_labels):
    from scheduling.experiments.sweep_report import write_plots

    made = write_plots(_sweep_frame(), tmp_path)
    assert {p.name for p in made} >= {"jct_vs_jps.png", "ttft_vs_jps.png", "tpot_vs_jps.png"}
    assert len(log_axis_labels) >= 3
    for figure in log_axis_labels:
        assert figure  # every one of these plots has a log y axis
        for labels in figure:
            _assert_plain(labels)


def test_trace_stats_plot_tool_time_axis_shows_plain_numbers(tmp_path, log_axis_labels):
    from gpubench.cli import main

    assert main(["trace", "stats", "--jobs", "60", "--plot", str(tmp_path / "stats.png")]) == 0
    assert (tmp_path / "stats.png").is_file()
    [figure] = log_axis_labels
    [labels] = figure  # the tool-call CDF's x axis
    _assert_plain(labels)



def test_legend_names_drop_a_shared_label_head_and_variant_colours_differ():
    from scheduling.experiments.sweep_report import legend_names, policy_colors

    routers = [f"fcfs@replicas=4+router={r}" for r in ("round-robin", "prefix", "session", "kv-cost")]
    names, head = legend_names(routers)
    assert head == "fcfs@replicas=4+" and names[routers[1]] == "router=prefix"
    assert legend_names(["fcfs", "continuum"]) == ({"fcfs": "fcfs", "continuum": "continuum"}, "")
    assert legend_names(["cpu-offload", "cpu-offload@cpu_gib=128"])[1] == ""  # a plain name keeps every label whole
    labels = ["fcfs", *[f"fcfs@x={i}" for i in range(12)]]
    colors = policy_colors(labels)
    assert len(set(colors.values())) == len(labels)
