"""`predict --breakdown` adds up to the predicted time, and says how its blocks are made: on the CPU
the headline used to print a "bound" blocks time smaller than its compute term (the op tables'
sum beside the roofline's sums, presented as its terms), and the max form labelled its blocks by
op classes while taking the other roof."""
from __future__ import annotations

import re

import pytest

from predictor.calibration_model import Calibration
from predictor.cli import breakdown_rows
from predictor.step import StepModel
from tests.conftest import REPO, gpubench

CPU_TABLES = REPO / "results/eval/cpu/calibration-probes.json"  # has cpu_ops: the op-table variant
H200 = REPO / "results/h200/calibration.json"
BATCHES = [[(1, 128)], [(1, 512)] * 4, [(512, 0)], [(256, 1024)] + [(1, 300)] * 7, [(1, 64)] * 32]
CASES = [("cpu", "smollm2-135m", None, "additive", False), ("cpu", "smollm2-135m", None, "max", False),
         ("cpu", "smollm2-135m", CPU_TABLES, "additive", False), ("cpu", "smollm2-135m", CPU_TABLES, "max", False),
         ("h100", "llama-3.1-8b", None, "additive", False), ("h100", "llama-3.1-8b", None, "max", True),
         ("h200", "llama-3.1-8b", H200, "additive", True), ("l40s", "llama-3.1-8b", None, "additive", False)]


def _t(row, cols) -> float:
    return float(row[cols.index("t ms")])


@pytest.mark.parametrize("sku, model, cal, form, graphs", CASES)
def test_breakdown_total_is_predict_time_and_its_rows_add_up(sku, model, cal, form, graphs):
    m = StepModel.for_names(sku=sku, model=model, calibration=Calibration.load(cal) if cal else None, form=form,
                            cuda_graphs=graphs)
    for b in BATCHES:
        pred = m.predict(b)
        total = m.predict_time(b)
        assert pred.total_s == pytest.approx(total, rel=1e-9)
        cols, rows = breakdown_rows(pred, total, False)
        assert rows[-1][0] == "total" and _t(rows[-1], cols) == pytest.approx(total * 1e3, abs=1e-4)
        assert sum(_t(r, cols) for r in rows[:-1]) == pytest.approx(total * 1e3, abs=1e-3)
        if form == "max":  # the blocks are the larger roof, and the label says which
            assert pred.blocks_s == pytest.approx(max(pred.compute_s, pred.memory_s))
            assert pred.bound == ("compute" if pred.compute_s >= pred.memory_s else "memory")
        elif pred.form == "additive":  # a sum of per-op maxima is at least either sum
            assert pred.blocks_s >= max(pred.compute_s, pred.memory_s) * (1 - 1e-12)
        if m.hardware.backend != "cpu":  # asynchronous scheduling: device and host rows, the total their max
            t_async = m.predict_time(b, async_scheduling=True)
            cols, rows = breakdown_rows(pred, t_async, True)
            by = {r[0]: _t(r, cols) for r in rows}
            ops = sum(_t(r, cols) for r in rows[:len(pred.ops) + 1])  # the ops and the launch row
            assert by["device (ops + launches)"] == pytest.approx(ops, abs=1e-3)
            assert by["total = max(device, host)"] == pytest.approx(
                max(by["device (ops + launches)"], by["host residual"]), abs=1e-3)
            assert by["total = max(device, host)"] == pytest.approx(t_async * 1e3, abs=1e-4)


def _cli_totals(*argv):
    res = gpubench("predict", *argv, "--breakdown")
    assert res.returncode == 0, res.stderr
    headline = float(re.search(r": ([0-9.]+) ms \[", res.stdout).group(1))
    lines = res.stdout.splitlines()
    header = [c.strip() for c in next(ln for ln in lines if ln.startswith("┃ op")).strip("┃").split("┃")]
    total_row = next(ln for ln in lines if ln.startswith("│ total"))
    cells = [c.strip() for c in total_row.strip("│").split("│")]
    blocks = next(ln for ln in lines if ln.lstrip().startswith("blocks"))
    return headline, float(cells[header.index("t ms")]), blocks


@pytest.mark.parametrize("argv", [
    ("--sku", "cpu", "--model", "smollm2-135m", "--batch", "4", "--context", "512"),
    ("--sku", "cpu", "--model", "smollm2-135m", "--batch", "32", "--context", "128", "--calibration", str(CPU_TABLES),
     "--force-calibration"),
    ("--sku", "cpu", "--model", "smollm2-135m", "--batch", "4", "--context", "512", "--calibration", str(CPU_TABLES),
     "--force-calibration", "--form", "max"),
    ("--sku", "h100", "--batch", "32", "--context", "2048"),
    ("--sku", "h200", "--calibration", str(H200), "--batch", "1", "--context", "1024", "--cuda-graphs",
     "--async-scheduling"),
])
def test_cli_breakdown_total_is_the_headline_and_the_blocks_line_says_how(argv):
    headline, total, blocks = _cli_totals(*argv)
    assert total == pytest.approx(headline, abs=1e-3)
    if "--calibration" in argv and "max" not in argv and argv[1] == "cpu":  # the op tables: sums are reference only
        assert "the measured op tables" in blocks and "for reference" in blocks
    elif "max" in argv:
        assert re.search(r"blocks ([0-9.]+) ms \(max of compute ([0-9.]+), memory ([0-9.]+): (compute|memory) bound",
                         blocks)
        b, c, m_, bound = re.search(r"blocks ([0-9.]+) ms \(max of compute ([0-9.]+), memory ([0-9.]+): (\w+)",
                                    blocks).groups()
        assert float(b) == pytest.approx(max(float(c), float(m_)), abs=1e-3)
        assert bound == ("compute" if float(c) >= float(m_) else "memory")
    else:
        assert "sum over ops of max(t_c, t_m)" in blocks
