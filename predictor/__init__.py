"""predictor: turn gpubench measurements into a calibrated predictor of one forward step's time.

Public API (other packages use only this): ``load_model_config``, ``ModelConfig``, ``StepModel``,
``StepPrediction``, ``OpTime``, ``HardwareSpec``, ``Calibration``.
"""
from predictor.calibrate import Calibration, Param
from predictor.config import ModelConfig, available_models, load_model_config
from predictor.hardware import HardwareSpec
from predictor.step import StepModel
from predictor.step_prediction import OpTime, StepPrediction

__all__ = ["ModelConfig", "available_models", "load_model_config", "StepModel", "StepPrediction", "OpTime",
           "HardwareSpec", "Calibration", "Param"]
