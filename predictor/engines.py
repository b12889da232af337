"""Which engine a step prediction prices: vLLM V1 as it runs by default, or this project's torch loop.

The same batch costs different things in different engines, and a user asks about the one they
serve with. ``gpubench predict --engine`` and ``gpubench evaluate`` (per row, from its ``engine``
column) both build their StepModel here, so the figure evaluate reports is the path predict takes.

- ``vllm`` on a GPU: CUDA graphs for the decode batches it captures (each kernel pays the graph-node
  interval) and asynchronous scheduling (the host's work overlaps the device's), vLLM V1's defaults.
  On the CPU: vLLM's fused projections (one qkv and one gate_up call; its oneDNN kernels when the
  calibration's probe run measured them, ``vllm_ops``) and its measured per-step engine cost.
- ``torch``: the eager, synchronous loop of ``gpubench profile``'s torch engine (separate q, k, v,
  gate and up calls on the CPU); ``--cuda-graphs`` / ``--async-scheduling`` switch those on alone.
- ``torch-graph``: ``gpubench profile --engine torch-graph`` (predictor.graph_model) on a GPU: fused
  projections and kernels, decode steps replayed as CUDA graphs, synchronous (the host reads each
  step's tokens before the next). Priced on GPUs only: on the CPU it runs eagerly with fused torch
  projections, which the CPU op tables price only as vLLM's oneDNN calls.

Threads (CPU): the op tables describe torch and vLLM running with the thread count their probe run
used (``torch_ops.num_threads``, 1 unless set). An engine running with another count is refused
rather than priced from tables that do not describe it.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError

ENGINES = ("vllm", "torch", "torch-graph")


@dataclass(frozen=True)
class EngineChoice:
    """How a StepModel prices an engine (see the module docstring)."""

    engine: str
    gemm_layout: str
    cuda_graphs: bool
    async_scheduling: bool


def engine_choice(engine: str, *, gpu: bool, cuda_graphs: bool = False, async_scheduling: bool = False) -> EngineChoice:
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine '{engine}' (choose from: {', '.join(ENGINES)})")
    if engine == "vllm":
        return EngineChoice("vllm", "fused", cuda_graphs=gpu, async_scheduling=gpu)
    if engine == "torch-graph":
        if not gpu:
            raise ConfigError("--engine torch-graph is priced on GPU SKUs only: on the CPU it runs eagerly with fused "
                              "torch projections, which the CPU op tables price only as vLLM's (use --engine torch)")
        return EngineChoice("torch-graph", "fused", cuda_graphs=True, async_scheduling=False)
    return EngineChoice("torch", "separate", cuda_graphs=gpu and cuda_graphs, async_scheduling=gpu and async_scheduling)


def probe_threads(calibration, dtype: str, engine: str = "torch") -> int | None:
    """The thread count of the probe run behind a CPU calibration's op tables (None without tables):
    vllm_ops's for the vLLM engine when it ran, else torch_ops's. Tables fitted before the count was
    recorded came from probes at the default, 1 thread."""
    tables = getattr(calibration, "cpu_ops", {}).get(dtype) if calibration is not None else None
    if tables is None:
        return None
    if engine == "vllm" and tables.d.get("num_threads_vllm"):
        return int(tables.d["num_threads_vllm"])
    return int(tables.d.get("num_threads") or 1)


def check_threads(calibration, dtype: str, threads: int | None, *, engine: str = "torch", what: str = "--threads") -> None:
    """One-line ConfigError when an engine at ``threads`` would be priced from tables probed at another count."""
    probed = probe_threads(calibration, dtype, engine)
    if threads is None or probed is None or threads == probed:
        return
    raise ConfigError(f"{what} {threads}: the calibration's op tables were probed at {probed} thread(s), and an engine "
                      f"at {threads} runs other kernels; probe at {threads} (gpubench run --device cpu --set "
                      f"torch_ops.num_threads={threads} --set vllm_ops.num_threads={threads}, then fit) or price "
                      f"--threads {probed}")


def step_model_for_engine(hardware, model, *, calibration, engine: str, dtype: str | None = None, form: str = "additive",
                          cuda_graphs: bool = False, async_scheduling: bool = False, threads: int | None = None):
    """(StepModel, EngineChoice) pricing ``engine`` on ``hardware``; ``threads`` checked against the
    calibration's probe thread count (CPU op tables)."""
    from predictor.hardware import HardwareSpec
    from predictor.step import StepModel

    hw = HardwareSpec.from_sku(hardware) if isinstance(hardware, str) else hardware
    if threads is not None and (threads < 1 or hw.backend != "cpu"):
        raise ConfigError(f"--threads must be >= 1 (got {threads})" if threads < 1 else
                          "--threads is the CPU engine's thread count; a GPU SKU has none")
    choice = engine_choice(engine, gpu=hw.backend != "cpu", cuda_graphs=cuda_graphs, async_scheduling=async_scheduling)
    sm = StepModel(hw, model, calibration=calibration, form=form, cuda_graphs=choice.cuda_graphs, dtype=dtype,
                   gemm_layout=choice.gemm_layout)
    if hw.backend == "cpu":
        check_threads(sm.calibration, sm.dtype, threads, engine=choice.engine)
    return sm, choice
