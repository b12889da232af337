"""Build a real in-process vLLM V1 engine from a worker spec (runs inside the vLLM environment).

Spec keys: ``model`` (directory), ``real_weights`` (False: ``load_format="dummy"``, random
weights, no tokenizer), ``block_size`` (CPU attention needs a multiple of 32; vLLM's CPU default
128), ``max_num_batched_tokens`` (token budget), ``max_num_seqs``, ``max_model_len``,
``num_gpu_blocks`` (the KV pool's usable blocks, as the simulator counts them; vLLM is given one
more, its null block; None: sized from ``VLLM_CPU_KVCACHE_SPACE``),
``enable_prefix_caching``, ``seed``, ``scheduling_policy`` (``fcfs``, vLLM's default, or
``priority``: requests by their ``priority``, then arrival; the victim of a preemption the last of
that order). Always float32 (no AVX-512-BF16/AMX assumed: bf16 prefill was 4-9x slower on such a
host) and eager (torch.compile warm-up took 90 s on 2 cores and changes
nothing a step row needs).
"""
from __future__ import annotations

import json
import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """A user error: one line for the parent (``error: ...``), exit 2."""
    print(f"error: {message}", flush=True)
    sys.exit(2)


def progress(message: str) -> None:
    print(f"progress: {message}", flush=True)


def build_engine(spec: dict):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    kwargs = dict(
        model=spec["model"], dtype="float32", enforce_eager=True, seed=int(spec.get("seed", 0)),
        block_size=int(spec.get("block_size", 128)), enable_prefix_caching=bool(spec.get("enable_prefix_caching", True)),
        max_num_batched_tokens=int(spec.get("max_num_batched_tokens", 4096)),
        max_num_seqs=int(spec.get("max_num_seqs", 256)), max_model_len=int(spec.get("max_model_len", 4096)),
        scheduler_cls="vllmref.hooks.RecordingScheduler", disable_log_stats=False,
        scheduling_policy=spec.get("scheduling_policy", "fcfs"),
    )
    if spec.get("num_gpu_blocks"):
        # vLLM's pool includes the null block, which is never free: N usable blocks need N + 1
        # (the simulator and the differential test count usable blocks).
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks"]) + 1
    if not spec.get("real_weights", True):
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    if spec.get("kv_transfer"):
        # A prefill/decode pair through vLLM's ExampleConnector: the producer writes each request's KV
        # (whole blocks, one safetensors file per layer) under shared_storage_path, the consumer
        # finds and loads it as an external hit. It runs on the CPU build (no NCCL, no NIXL). The
        # subclass only times the connector's file I/O (vllmref.kv_timing).
        from vllm.config import KVTransferConfig

        t = spec["kv_transfer"]
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TimedExampleConnector", kv_connector_module_path="vllmref.kv_timing", kv_role=t["role"],
            kv_connector_extra_config={"shared_storage_path": t["path"]})
    try:
        return LLMEngine.from_engine_args(EngineArgs(**kwargs))
    except Exception as e:  # vLLM raises many types for a model it cannot load
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        fail(f"vLLM cannot load {spec['model']}: {type(e).__name__}: {' | '.join(lines[:3])[:400]}")


def engine_facts(engine) -> dict:
    """What the engine actually runs with (read back, not assumed)."""
    import torch
    import vllm

    cfg = engine.vllm_config
    return {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
            # usable blocks (vLLM's count includes its never-free null block)
            "block_size": cfg.cache_config.block_size, "num_gpu_blocks": cfg.cache_config.num_gpu_blocks - 1,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs, "num_threads": torch.get_num_threads(),
            "async_scheduling": bool(getattr(cfg.scheduler_config, "async_scheduling", False)),
            "scheduling_policy": str(getattr(cfg.scheduler_config.policy, "value", cfg.scheduler_config.policy)),
            "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching)}


def write_record(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()
