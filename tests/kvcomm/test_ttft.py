"""`gpubench kvcomm ttft` end to end on a tiny random chat model: rows per (length, round, protocol),
paired speedups recomputed from the rows, recompute shares, outputs, and refusals."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from gpubench.cli import main


def test_sweep_end_to_end_and_a_second_run_into_the_same_directory_is_refused(tiny_chat_model_dir, tmp_path, capsys):
    out = tmp_path / "ttft"
    args = ["kvcomm", "ttft", "--model", str(tiny_chat_model_dir), "--lengths", "16,48", "--repeats", "3",
            "--protocols", "text,kv-rerotated,kv-rerotated+boundary,kv-blend", "--boundary-k", "4", "--ratio", "0.25",
            "--out", str(out), "--no-progress"]
    assert main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)  # stdout is the JSON object alone
    for name in ("rows.jsonl", "summary.json", "summary.md", "ttft.png", "COMMAND"):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    labels = ["text", "kv-rerotated", "kv-rerotated+boundary k=4", "kv-blend r=0.25"]
    assert len(rows) == 2 * 3 * len(labels)  # every protocol once per round, per length
    assert sorted({r["num_imported"] for r in rows}) == [16, 48]  # the message is cut to the exact length
    assert all(r["ttft_s"] > 0 and 0 < r["cpu_share"] <= 1.5 for r in rows)
    by = {(r["num_imported"], r["round"], r["protocol"]): r for r in rows}
    assert all(by[(n, k, "text")]["num_recomputed"] == n for n in (16, 48) for k in range(3))
    assert all(by[(n, k, "kv-rerotated")]["num_recomputed"] == 0 for n in (16, 48) for k in range(3))
    assert all(by[(n, k, "kv-rerotated+boundary k=4")]["num_recomputed"] == 4 for n in (16, 48) for k in range(3))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["protocols"] == labels and summary["cpu_model"]
    assert printed["summary"] == summary["summary"] and printed["out_dir"] == str(out)
    assert all(Path(f).is_file() for f in printed["files"])
    for s in summary["summary"]:
        n, label = s["num_imported"], s["protocol"]
        # the speedup is the median of same-round ratios, not a ratio of medians
        ratios = [by[(n, k, "text")]["ttft_s"] / by[(n, k, label)]["ttft_s"] for k in range(3)]
        assert s["speedup_median"] == pytest.approx(statistics.median(ratios), rel=1e-12)
        assert s["ttft_median_s"] == pytest.approx(statistics.median(by[(n, k, label)]["ttft_s"] for k in range(3)))
    blend = [s for s in summary["summary"] if s["protocol"] == "kv-blend r=0.25"]
    assert all(0 < s["recompute_fraction"] <= 0.5 for s in blend)
    assert (out / "COMMAND").read_text().startswith("gpubench kvcomm ttft --model")
    assert "| 48 | kv-rerotated |" in (out / "summary.md").read_text()
    capsys.readouterr()
    assert main(args) == 2  # timings are not resumed or appended to
    assert "already holds a ttft run" in capsys.readouterr().err
    assert len((out / "rows.jsonl").read_text().splitlines()) == len(rows)  # and nothing was lost


def test_several_senders_split_the_length_and_anchored_boundary_recomputes_later_heads(tiny_chat_model_dir, tmp_path, capsys):
    out = tmp_path / "ttft2"
    assert main(["kvcomm", "ttft", "--model", str(tiny_chat_model_dir), "--lengths", "33", "--repeats", "2",
                 "--senders", "3", "--anchor-examples", "2", "--boundary-k", "4",
                 "--protocols", "text,remote-prefill,kv-anchored,kv-anchored+boundary", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["num_imported"] for r in rows} == {33} and all(r["num_senders"] == 3 for r in rows)  # 11 + 11 + 11
    by = {r["protocol"]: r for r in rows if r["round"] == 0}
    # two later senders' heads of 4 tokens; the first sender's re-encoded span is exact already
    assert by["kv-anchored+boundary a=2 k=4"]["num_recomputed"] == 8 and by["kv-anchored a=2"]["num_recomputed"] == 0
    # the pool: 2 exchanges of another seed, the two later spans of each (22 tokens apiece)
    assert by["kv-anchored a=2"]["anchor_tokens"] == 2 * 22 and by["remote-prefill"]["anchor_tokens"] == 0
    # end to end: the re-encoding senders' extra prefill (timed in the round) and the K/V's move count;
    # text moves its UTF-8 bytes, the others the K/V in bf16
    from kvcomm.names import E2E_LINK_GBS

    for label in ("remote-prefill", "kv-anchored a=2"):
        r = by[label]
        assert r["sender_extra_s"] > 0 and r["moved_bytes"] > 100 * by["text"]["moved_bytes"]
        assert r["e2e_s"] == pytest.approx(r["sender_extra_s"] + r["moved_bytes"] / (E2E_LINK_GBS * 1e9) + r["ttft_s"])
    assert by["text"]["sender_extra_s"] == 0.0
    summary = json.loads((out / "summary.json").read_text())["summary"]
    remote = next(s for s in summary if s["protocol"] == "remote-prefill")
    assert remote["e2e_speedup_median"] < remote["speedup_median"]
    from kvcomm.ttft import figure

    labels = [ln.get_label() for ln in figure(summary).axes[1].get_lines()]
    assert "remote-prefill, end to end" in labels and "kv-anchored a=2, end to end" in labels
    assert "--senders" in (out / "COMMAND").read_text().splitlines()[0]


@pytest.mark.parametrize("bad, message", [
    (["--lengths", "0,64"], "positive token counts"),
    (["--lengths", "64,lots"], "comma-separated token counts"),
    (["--protocols", "kv-rerotated"], "must include 'text'"),
    (["--protocols", "text,placebo"], "placebo has no TTFT of its own"),
    (["--ratio", "2"], "within [0, 1]"),
    (["--senders", "3", "--lengths", "2"], "each of the 3 senders"),
    (["--model", "smollm2-135n"], "unknown model"),
])
def test_bad_input_is_one_line_and_writes_nothing(bad, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["kvcomm", "ttft", "--out", str(out), *bad]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_one_load_rule_for_the_timed_kvcomm_runs():
    from kvcomm.load import LOAD_FLAG, load_flags

    assert load_flags(0.4, [1.0, 1.2], 1) == []
    before, = load_flags(LOAD_FLAG + 0.1, [1.0], 1)
    assert "before the run" in before
    # while it runs, the run's own threads are allowed on top of the threshold, no more
    assert load_flags(0.4, [LOAD_FLAG + 2.0], 2, whose="the backend's") == []
    during, = load_flags(None, [LOAD_FLAG + 2.1], 2, whose="the backend's")
    assert "during the run" in during and "the backend's 2 thread(s)" in during


def test_cli_prints_and_writes_the_contention_state_beside_the_speedups(tiny_chat_model_dir, tmp_path):
    from tests.conftest import gpubench

    # a fresh directory and an --out whose parents do not exist yet
    proc = gpubench("kvcomm", "ttft", "--model", str(tiny_chat_model_dir), "--lengths", "16", "--repeats", "2",
                    "--protocols", "text,kv-rerotated", "--out", "new/parents/ttft", "--no-progress", cwd=tmp_path,
                    timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "new/parents/ttft"
    doc = json.loads((out / "summary.json").read_text())
    state = doc["contention"]
    assert state["flagged"] == doc["flagged"] and state["num_rows"] == len(doc["summary"]) == 2
    assert state["flagged_rows"] == sum(s["flagged"] for s in doc["summary"])
    md = (out / "summary.md").read_text()
    for text in (proc.stdout, md):
        assert "| load avg max | CPU share |" in text
        assert f"contention: load average (1 min) {state['loadavg_1m_before']:.2f} before" in text
        assert f"CPU share {state['cpu_share_min']:.2f}-" in text
        assert ("FLAGGED, not for quoting" in text) == state["flagged"]
        assert ("not flagged: 0 of 2 rows" in text) == (not state["flagged"])
        for s in doc["summary"]:  # each row: its load and CPU share beside its speedup, marked when flagged
            row = next(line for line in text.splitlines() if line.startswith(f"| 16 | {s['protocol']} |"))
            assert row.endswith(f"| {s['loadavg_1m_max']:.2f} | {s['cpu_share']:.2f} |")
            assert (" *" in row) == s["flagged"]


def test_flagged_rows_are_marked_in_the_table_printed_and_in_summary_md(tiny_chat_model_dir, tmp_path, capsys,
                                                                        monkeypatch):
    import os

    # quiet before the run and during the first length's rounds, loaded during the second's
    loads = iter([0.2, 0.3, 0.3])
    monkeypatch.setattr(os, "getloadavg", lambda: (next(loads, 9.0), 0.0, 0.0))
    out = tmp_path / "ttft"
    assert main(["kvcomm", "ttft", "--model", str(tiny_chat_model_dir), "--lengths", "16,24", "--repeats", "2",
                 "--protocols", "text,kv-rerotated", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "summary.json").read_text())
    assert [s["flagged"] for s in doc["summary"]] == [False, False, True, True]
    assert doc["flagged"] and doc["contention"]["flagged_rows"] == 2
    for text in (printed, (out / "summary.md").read_text()):
        rows = [line for line in text.splitlines() if line.startswith(("| 16 |", "| 24 |"))]
        assert [row.count(" *") for row in rows] == [0, 0, 3, 3]  # TTFT, speedup and end to end of the loaded rows
        assert "| 9.00 |" in rows[3] and "| 0.30 |" in rows[0]
        assert "FLAGGED, not for quoting: load average up to 9.00 during the run" in text
        assert "2 of 4 rows flagged (marked *)" in text


def _summary(ttft_ms: dict[str, list[float]], lengths=(64, 128, 256)) -> list[dict]:
    return [{"num_imported": n, "protocol": label, "ttft_median_s": ms / 1e3, "ttft_p25_s": 0.95 * ms / 1e3,
             "ttft_p75_s": 1.05 * ms / 1e3, "speedup_median": ttft_ms["text"][i] / ms}
            for label, values in ttft_ms.items() for i, (n, ms) in enumerate(zip(lengths, values))]


@pytest.mark.parametrize("ttft_ms", [
    {"text": [520.0, 700.0, 880.0], "kv-rerotated": [410.0, 430.0, 450.0]},  # inside one decade: no major tick
    {"text": [600.0, 1300.0, 2400.0], "kv-rerotated": [380.0, 400.0, 420.0]},  # one major tick (1000)
])
def test_ttft_panel_has_readable_y_tick_labels(ttft_ms):
    """The TTFT axis (log) once showed no label at all, or only 10^3, over a range within a decade."""
    import matplotlib.pyplot as plt

    from kvcomm.ttft import figure
    from tests.plotcheck import MATHTEXT, drawn, visible_tick_labels

    fig = drawn(figure(_summary(ttft_ms)))
    labels = visible_tick_labels(fig.axes[0].yaxis)
    plt.close(fig)
    assert len(labels) >= 2, labels
    assert all(float(text) > 0 for text in labels)  # plain numbers, no 10^3 mathtext
    assert not any(m in text for text in labels for m in MATHTEXT)


def test_own_anchored_protocols_share_one_pool_and_kv_layers_moves_its_shared_layers_bytes(tiny_chat_model_dir, tmp_path, capsys):
    import math

    out = tmp_path / "ttft3"
    assert main(["kvcomm", "ttft", "--model", str(tiny_chat_model_dir), "--lengths", "24", "--repeats", "2",
                 "--senders", "2", "--anchor-examples", "2",
                 "--protocols", "text,kv-own-anchored,kv-own-anchored-once,kv-layers", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    by = {r["protocol"]: r for r in rows if r["round"] == 0}
    # one pool of every sender's own span (2 exchanges x 24 tokens) serves both own-anchored protocols
    assert by["kv-own-anchored a=2"]["anchor_tokens"] == by["kv-own-anchored-once a=2"]["anchor_tokens"] == 48
    num_layers = json.loads((tiny_chat_model_dir / "config.json").read_text())["num_hidden_layers"]
    shared = math.ceil(0.3 * num_layers)
    assert by["kv-layers a=2"]["moved_bytes"] == by["kv-own-anchored a=2"]["moved_bytes"] * shared // num_layers
    assert by["kv-layers a=2"]["num_recomputed"] == 0 and by["kv-layers a=2"]["anchor_tokens"] == 0


def test_default_protocols_are_the_own_cache_ones_the_figures_are_quoted_for(tiny_chat_model_dir, tmp_path, capsys):
    """`kvcomm ttft` with its default protocols (lengths cut to keep the tiny model short): text's
    reference, the re-rotated own cache, the one-search anchored own cache and CacheBlend."""
    out = tmp_path / "defaults"
    assert main(["kvcomm", "ttft", "--model", str(tiny_chat_model_dir), "--lengths", "24", "--repeats", "1",
                 "--anchor-examples", "2", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["protocol"] for r in rows} == {"text", "kv-rerotated", "kv-own-anchored-once a=2", "kv-blend r=0.15"}
