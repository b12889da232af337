"""`evaluate`'s probe-only method on GPU rows (eval_methods.gpu_probe_base): the calibration as it is,
each row priced for the engine it names, nothing fitted on any row. Scored on the committed H200 step
rows of the eager engine (GPU rows cannot be taken here), relabelled to the graph engine to check that
the engine column reaches the pricing."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from common.errors import ConfigError
from predictor.calibrate import Calibration
from predictor.engines import step_model_for_engine
from predictor.eval_methods import gpu_probe_base
from predictor.evaluate import evaluate_rows

REPO = Path(__file__).resolve().parents[2]
STEPS = REPO / "results/h200/steps"
CAL = REPO / "results/h200/calibration.json"


def _rows(*models: str) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(STEPS / f"gpu-{m}.parquet") for m in models], ignore_index=True)


def test_each_row_is_priced_for_its_engine_with_the_calibration_as_it_is():
    df = _rows("llama-3.2-1b")
    eager = gpu_probe_base(df, sku="h200", calibration=CAL)
    graph = gpu_probe_base(df.assign(engine="torch-graph"), sku="h200", calibration=CAL)
    cal = Calibration.load(CAL)
    sm, _ = step_model_for_engine("h200", "llama-3.2-1b", calibration=cal, engine="torch", dtype="bf16")
    first = [tuple(s) for s in json.loads(df.batch_json.iloc[0])]
    assert eager.iloc[0] == pytest.approx(sm.predict_time(first))
    # the graph engine pays the graph-node interval per kernel instead of the eager launch interval
    saved = sm.num_kernels * (cal.value("t_launch_s") - cal.value("t_graph_node_s"))
    assert saved > 0
    np.testing.assert_allclose((eager - graph).to_numpy(), saved, rtol=1e-9)


def test_evaluate_scores_probe_only_held_out_by_model_and_fits_nothing():
    df = _rows("llama-3.2-1b", "qwen2.5-0.5b")
    res = evaluate_rows(df, sku="h200", calibration=CAL, target="wall_s", seed=0)
    pred = res.predictions[res.predictions.method == "probe_only"]
    assert set(pred.split) >= {"by_model"} and len(pred)
    base = gpu_probe_base(df, sku="h200", calibration=CAL)
    by_key = dict(zip(df.key, base))
    np.testing.assert_allclose(pred.predicted_s.to_numpy(), [by_key[k] for k in pred.key])  # the same in every fold
    assert ((res.metrics.method == "probe_only") & (res.metrics.split == "by_model")).any()


def test_no_probe_only_without_a_gpu_calibration_and_no_cpu_price_for_the_graph_engine():
    df = _rows("llama-3.2-1b")
    assert gpu_probe_base(df, sku="h200", calibration=None) is None
    with pytest.raises(ConfigError, match="GPU SKUs only"):
        step_model_for_engine("cpu", "smollm2-135m", calibration=None, engine="torch-graph")
