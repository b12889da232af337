"""predictor: turn gpubench measurements into a calibrated predictor of one forward step's time.

Public API (other packages use only this): ``load_model_config``, ``ModelConfig``, ``StepModel`` (and
its variants ``GpuRooflineStep``, ``CpuRooflineStep``, ``CpuOpTableStep``),
``StepPrediction``, ``OpTime``, ``HardwareSpec``, ``Calibration``, ``hardware_for_calibration``.
"""
from common.model_config import ModelConfig, available_models, load_model_config
from predictor.calibrate import Calibration, Param
from predictor.hardware import HardwareSpec
from predictor.step import StepModel
from predictor.step_prediction import OpTime, StepPrediction
from predictor.step_variants import CpuOpTableStep, CpuRooflineStep, GpuRooflineStep


def hardware_for_calibration(sku: str, calibration) -> HardwareSpec:
    """The device a calibration prices on ``sku``: for ``cpu``, the CPU the calibration records whole,
    wherever this runs (else this host); any other SKU, its spec (predictor.host_match)."""
    from predictor.host_match import spec_for_calibration

    return spec_for_calibration(sku, calibration)


__all__ = ["ModelConfig", "available_models", "load_model_config", "StepModel", "GpuRooflineStep", "CpuRooflineStep",
           "CpuOpTableStep", "StepPrediction", "OpTime",
           "HardwareSpec", "Calibration", "Param", "hardware_for_calibration"]
