"""The CPU backend: its probes (``probes/``, one module per probe) run the compiled
kernels of ``gpubench._cpu`` and torch/vLLM ops on this host."""
from gpubench.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
