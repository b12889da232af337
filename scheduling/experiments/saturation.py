"""Where load becomes overload: the back-of-envelope saturation rates that chose the sweep's
default JPS levels (docs/sweep.md, "Choosing the JPS levels")."""
from __future__ import annotations

from scheduling.experiments.sweep_defaults import DEFAULT_MODEL


def saturation_estimate(sku: str, model: str = DEFAULT_MODEL, *, num_jobs: int = 400, seed: int = 0,
                        gpu_memory_utilization: float = 0.9, reserve_bytes: float = 2 * (1 << 30)) -> dict[str, float | str]:
    """Back-of-envelope arrival rates (jobs/s) at which a SKU saturates on the synthetic agents.

    * ``kv_jps``: Little's law on KV memory. A job holds its context (prompt + output so far)
      while it runs and — if nothing evicts it — through every tool gap; its KV demand is the
      integral of context over its unloaded lifetime (decode at batch 32 and prefill at 2048-token
      chunks, both from ``predictor.StepModel`` at a 3K-token context, the calibrated agent's
      typical one). ``kv_jps`` = KV pool tokens / E[demand]: above it the caches of live jobs no
      longer fit, and FCFS starts recomputing.
    * ``decode_jps``: decode throughput at batch 32 / output tokens per job.
    * ``job_s``: unloaded mean job duration (tool gaps + generation).

    The KV pool is the replay's own (``scheduling.experiments.replay.kv_pool_blocks``).
    """
    import numpy as np

    from gpubench import skus
    from predictor import StepModel, load_model_config
    from scheduling.engine.request import BLOCK_SIZE
    from scheduling.experiments.replay import kv_pool_blocks
    from scheduling.workload.trace_synth import synthetic_jobs

    sku_spec = skus.get(sku)
    model_config = load_model_config(model)  # an unknown model fails here, before the step model is built
    step = StepModel.for_names(sku=sku, model=model)
    t_decode_s = float(step.predict([(1, 3000)] * 32).total_s)
    t_prefill_per_token_s = float(step.predict([(2048, 3000)]).total_s) / 2048
    num_blocks, _, _ = kv_pool_blocks(sku_spec, model_config, gpu_memory_utilization=gpu_memory_utilization,
                                      activation_reserve_gib=reserve_bytes / (1 << 30), block_size=BLOCK_SIZE)
    kv_tokens = num_blocks * BLOCK_SIZE
    demand, duration, outputs = [], [], []
    for job in synthetic_jobs(num_jobs, seed):
        integral = t_total = 0.0
        for k, turn in enumerate(job.turns):
            prompt = job.prompt_tokens(k)
            new = turn.input_tokens + (job.system_tokens if k == 0 else 0)
            gen_s = turn.output_tokens * t_decode_s + new * t_prefill_per_token_s
            integral += (prompt + turn.output_tokens / 2) * gen_s + (prompt + turn.output_tokens) * turn.tool_s
            t_total += gen_s + turn.tool_s
        demand.append(integral)
        duration.append(t_total)
        outputs.append(sum(t.output_tokens for t in job.turns))
    return {"sku": sku, "kv_pool_tokens": float(kv_tokens), "decode_step_s": t_decode_s, "job_s": float(np.mean(duration)),
            "kv_jps": float(kv_tokens / np.mean(demand)), "decode_jps": float(32 / t_decode_s / np.mean(outputs))}

