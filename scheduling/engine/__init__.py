"""The discrete-event engine in vLLM V1's shape: the event loop and scheduling pass (``loop``), admission,
the decode group, applying a finished step, the batch tally, the KV cache manager over the block pool,
its events, sizes, records and step costs. ``Engine`` and ``EngineConfig`` are importable from here.
"""
from scheduling.engine.engine_config import EngineConfig
from scheduling.engine.loop import Engine

__all__ = ["Engine", "EngineConfig"]
