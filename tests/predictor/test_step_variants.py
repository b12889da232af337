"""The step predictor's variants: StepModel(...) picks the type its hardware and calibration call for,
and each variant's scalar path (predict_time, the scheduler's hot path) equals its vectorized path
(predict_features / predict_many) and its breakdown (predict) on the same batches."""
from pathlib import Path

import numpy as np
import pytest

from predictor import CpuOpTableStep, CpuRooflineStep, GpuRooflineStep, StepModel
from predictor.ops import batch_features

CPU_CALIBRATION = Path(__file__).parents[2] / "results/eval/cpu/calibration-probes.json"
DECODES = [[(1, 512)] * 8, [(1, 4096)] * 32, [(1, 100)]]  # uniform: what features can describe exactly
MIXED = [[(256, 0), (1, 900), (1, 300)], [(64, 2048)], [(1, 10), (512, 512)]]


def test_the_variant_follows_the_hardware_and_the_calibration():
    assert type(StepModel("h200", "llama-3.1-8b")) is GpuRooflineStep
    assert type(StepModel.for_names(sku="cpu", model="llama-60m")) is CpuRooflineStep
    tables = StepModel("cpu", "llama-60m", calibration=str(CPU_CALIBRATION))
    assert type(tables) is CpuOpTableStep and tables.cpu_table is not None
    roofline = StepModel("cpu", "llama-60m", calibration=str(CPU_CALIBRATION), form="max")
    assert type(roofline) is CpuRooflineStep and roofline.cpu_table is None  # the max form is the roofline baseline
    assert all(isinstance(m, StepModel) for m in (tables, roofline))


def _agree(model, batches, vectorized_exact: bool) -> None:
    scalar = np.array([model.predict_time(b) for b in batches])
    np.testing.assert_allclose(model.predict_many(batches), scalar, rtol=1e-12)
    np.testing.assert_allclose([model.predict(b).total_s for b in batches], scalar, rtol=1e-9)
    if vectorized_exact:
        feats = np.stack([batch_features(b) for b in batches])
        np.testing.assert_allclose(model.predict_features(feats), scalar, rtol=1e-9)


@pytest.mark.parametrize("form", ["additive", "max"])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gpu_roofline_scalar_equals_vectorized(form, cuda_graphs):
    model = StepModel("h100-sxm", "llama-3.1-8b", form=form, cuda_graphs=cuda_graphs)
    _agree(model, DECODES, vectorized_exact=True)  # uniform decodes: per-sequence attention = features
    _agree(model, MIXED, vectorized_exact=False)   # mixed batches are priced per sequence part


@pytest.mark.parametrize("form", ["additive", "max"])
def test_cpu_roofline_scalar_equals_vectorized(form):
    model = StepModel("cpu", "smollm2-135m", form=form)
    _agree(model, DECODES + MIXED, vectorized_exact=True)  # the CPU roofline prices feature totals


def test_cpu_op_tables_scalar_equals_vectorized():
    model = StepModel("cpu", "llama-60m", calibration=str(CPU_CALIBRATION), gemm_layout="fused")
    _agree(model, DECODES, vectorized_exact=True)  # decode features become the same uniform batch
    _agree(model, MIXED, vectorized_exact=False)
    low, high = model.predict_interval(DECODES[0])
    assert low < model.predict_time(DECODES[0]) < high
