"""Predictor hot paths: vectorized decode predictions (>= 20,000/s for batches of 64 on one core)
and the single-batch ``predict_time`` the scheduler calls per step."""
import os

import numpy as np
import pytest

from gpubench.results import git_commit
from predictor import StepModel

NUM_PREDICTIONS = 4096  # decode batches costed per call
BATCH = 64
MIN_DECODE_PREDICTIONS_PER_S = 20_000


def _info(benchmark, **kw):
    benchmark.extra_info.update(git_sha=git_commit(), device="cpu (1 thread of numpy)",
                                loadavg_1m=os.getloadavg()[0], **kw)


@pytest.mark.parametrize("sku,model", [("h100-sxm", "llama-3.1-8b"), ("cpu", "smollm2-135m")])
def test_predict_decode_vectorized(benchmark, sku, model):
    m = StepModel.for_names(sku=sku, model=model)
    rng = np.random.default_rng(0)
    batch_sizes = np.full(NUM_PREDICTIONS, BATCH)
    context_sums = rng.integers(BATCH * 128, BATCH * 8192, NUM_PREDICTIONS)
    out = benchmark(m.predict_decode, batch_sizes, context_sums)
    assert out.shape == (NUM_PREDICTIONS,) and np.all(out > 0)
    per_s = NUM_PREDICTIONS / benchmark.stats.stats.median
    _info(benchmark, sku=sku, model=model, batch=BATCH, num_predictions_per_call=NUM_PREDICTIONS,
          decode_predictions_per_s=per_s)
    assert per_s >= MIN_DECODE_PREDICTIONS_PER_S, f"{per_s:.0f} decode predictions/s < {MIN_DECODE_PREDICTIONS_PER_S}"


def test_predict_time_single_batch(benchmark):
    m = StepModel.for_names(sku="h100-sxm", model="llama-3.1-8b")
    batch = [(1, 2048)] * (BATCH - 1) + [(512, 1024)]
    t = benchmark(m.predict_time, batch)
    assert t == pytest.approx(m.predict(batch).total_s, rel=1e-12)
    _info(benchmark, sku="h100-sxm", model="llama-3.1-8b", batch=BATCH,
          mixed_predictions_per_s=1 / benchmark.stats.stats.median)


CPU_OPS_CALIBRATION = os.path.join(os.path.dirname(__file__), "..", "results", "eval", "cpu", "calibration-probes.json")


def test_predict_decode_cpu_op_tables(benchmark):
    """The CPU op-table path (probe-only CPU predictor): the same >= 20,000/s floor."""
    m = StepModel.for_names(sku="cpu", model="smollm2-135m", calibration=CPU_OPS_CALIBRATION)
    assert m.cpu_table is not None
    rng = np.random.default_rng(0)
    batch_sizes = np.full(NUM_PREDICTIONS // 8, BATCH)
    context_sums = rng.integers(BATCH * 128, BATCH * 8192, batch_sizes.size)
    out = benchmark(m.predict_decode, batch_sizes, context_sums)
    assert np.all(out > 0)
    per_s = batch_sizes.size / benchmark.stats.stats.median
    _info(benchmark, sku="cpu", model="smollm2-135m", batch=BATCH, path="cpu_ops",
          num_predictions_per_call=int(batch_sizes.size), decode_predictions_per_s=per_s)
    assert per_s >= MIN_DECODE_PREDICTIONS_PER_S, f"{per_s:.0f} decode predictions/s < {MIN_DECODE_PREDICTIONS_PER_S}"
