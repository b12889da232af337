"""predictor: turn gpubench measurements into a calibrated predictor of one forward step's time.

Public API (other packages use only this): ``load_model_config``, ``ModelConfig`` and, once the
predictor lands, ``StepModel``/``StepPrediction``.
"""
from predictor.config import ModelConfig, available_models, load_model_config

__all__ = ["ModelConfig", "available_models", "load_model_config"]
