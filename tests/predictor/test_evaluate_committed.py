"""The committed evaluation table regenerates from the committed step rows with its COMMAND."""
import shlex
from pathlib import Path

import pandas as pd
import pytest

from predictor.evaluate import EvalConfig, evaluate_rows, load_rows

ROOT = Path(__file__).resolve().parents[2]
EVAL_DIRS = sorted(p.parent for p in (ROOT / "results" / "eval").glob("*/COMMAND"))


def _parse(command: str) -> EvalConfig:
    argv = shlex.split(command)
    assert argv[:2] == ["gpubench", "evaluate"], command
    rows, opts, i = [], {}, 2
    while i < len(argv):
        if argv[i].startswith("--"):
            opts[argv[i][2:]] = argv[i + 1]
            i += 2
        else:
            rows.append(argv[i])
            i += 1
    return EvalConfig(rows=[str(ROOT / r) for r in rows], out=opts["out"], sku=opts.get("sku", "cpu"),
                      calibration=str(ROOT / opts["calibration"]) if "calibration" in opts else None,
                      seed=int(opts.get("seed", 0)), target=opts.get("target", "wall_s"))


@pytest.mark.skipif(not EVAL_DIRS, reason="no committed evaluation under results/eval/")
@pytest.mark.parametrize("eval_dir", EVAL_DIRS, ids=[p.name for p in EVAL_DIRS])
def test_committed_metrics_regenerate(eval_dir):
    command = (eval_dir / "COMMAND").read_text().strip().splitlines()[-1]
    ec = _parse(command)
    df = load_rows(ec.rows)
    # The CPU "SKU" is the detected host: its peak and core count enter the prediction, so the
    # table reproduces on the kind of machine that measured the rows.
    from predictor.hardware import HardwareSpec

    host = HardwareSpec.from_sku("cpu").name
    if ec.sku == "cpu" and not any(host.startswith(str(n)) for n in df.device_name.unique()):
        pytest.skip(f"rows were measured on {sorted(df.device_name.unique())}; this host is {host}")
    res = evaluate_rows(df, sku=ec.sku, calibration=ec.calibration, target=ec.target, seed=ec.seed)
    committed = pd.read_csv(eval_dir / "metrics.csv")
    regenerated = res.metrics.reset_index(drop=True)
    regenerated = pd.read_csv(pd.io.common.StringIO(regenerated.to_csv(index=False)))  # same dtypes as on disk
    pd.testing.assert_frame_equal(committed, regenerated, rtol=1e-6)
    assert (eval_dir / "headline.md").read_text().split("\n", 1)[1] == res.headline
