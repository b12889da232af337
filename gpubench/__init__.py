"""gpubench: measure what a GPU (or CPU) really delivers for LLM inference.

Stages: compiled probes (``gpubench.backends``/``gpubench.backends.cpu.probes``) write a run directory
(``gpubench.results``); ``predictor`` calibrates a step-time model from it; ``scheduling`` and
``kvcomm`` use that model.
"""
__version__ = "0.1.0"
