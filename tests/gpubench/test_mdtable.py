"""The one Markdown table writer, and the tables that go through it."""
import pytest

from common.mdtable import markdown_table


def test_header_rule_and_rows():
    assert markdown_table(["a", "b"], [[1, "x"], [2.5, ""]]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 |  |"
    assert markdown_table(["only"], []) == "| only |\n|---|"


def test_a_row_of_another_width_is_a_bug_said_clearly():
    with pytest.raises(ValueError, match="3 cells, the header 2"):
        markdown_table(["a", "b"], [[1, 2, 3]])


def test_every_table_writer_uses_it():
    # the modules that write Markdown tables lay them out through common.mdtable, none by hand
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    writers = ["predictor/eval_report.py", "kvcomm/eval_report.py", "kvcomm/ttft.py", "scheduling/experiments/compare.py",
               "scheduling/experiments/sweep_report.py", "scheduling/trace_cli.py"]
    for rel in writers:
        text = (repo / rel).read_text()
        assert "common.mdtable" in text and '"|---|' not in text and '"---|" *' not in text, rel
