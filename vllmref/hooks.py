"""A vLLM V1 ``Scheduler`` that records every engine step (runs inside the vLLM environment).

vLLM accepts a scheduler class by qualified name (``scheduler_cls``); this subclass changes no
decision. It wraps ``schedule()`` and ``update_from_output()``: the first gives the batch the real
scheduler chose (tokens per request, the context each request had before the step, preemptions,
free blocks), the second closes the step's clock. With the engine core in the worker's own
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the records land in :data:`STEPS`, which the worker
drains after each ``LLMEngine.step()``.

Timing: ``t_start``/``t_end`` (``time.perf_counter``) bracket schedule -> forward -> sampling ->
update, the engine-core step; ``process_cpu_s`` is the CPU time of all the process's threads over
the same interval, so ``process_cpu_s / (wall * threads)`` is the step's share of the CPUs it asked
for (below ~0.9 the OS gave the cores to someone else: the row was taken under contention).
"""
from __future__ import annotations

import os
import time

from vllm.v1.core.sched.scheduler import Scheduler

STEPS: list[dict] = []
_open: dict | None = None


def external_id(internal_id: str) -> str:
    """The id the request was added with: vLLM appends ``-<8 random characters>`` to make it unique."""
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


def drain() -> list[dict]:
    """The steps recorded since the last call."""
    out = list(STEPS)
    STEPS.clear()
    return out


class RecordingScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        global _open
        t_start, cpu_start = time.perf_counter(), time.process_time()
        load_1m = os.getloadavg()[0]
        out = super().schedule(*args, **kwargs)
        # schedule() has already advanced num_computed_tokens by the scheduled count.
        batch = []
        for req_id, num_new in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            before = req.num_computed_tokens - num_new
            is_decode = req.num_output_tokens > 0 and num_new == 1 and before == req.num_tokens - 1
            batch.append({"req_id": external_id(req_id), "num_new_tokens": num_new, "num_computed_before": before,
                          "num_prompt_tokens": req.num_prompt_tokens, "decode": is_decode})
        pool = self.kv_cache_manager.block_pool
        cached = getattr(pool, "cached_block_hash_to_block", None)
        _open = {
            "t_start": t_start, "cpu_start": cpu_start, "loadavg_1m_before": load_1m, "batch": batch,
            "preempted": sorted(external_id(r) for r in (out.preempted_req_ids or ())),
            # The null block is part of num_gpu_blocks but never free; report usable blocks.
            "kv_free_blocks": pool.get_num_free_blocks(), "kv_total_blocks": pool.num_gpu_blocks - 1,
            "kv_cached_blocks": len(cached) if cached is not None and hasattr(cached, "__len__") else None,
            "num_running": len(self.running), "num_waiting": len(self.waiting),
        }
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        global _open
        result = super().update_from_output(scheduler_output, model_runner_output)
        rec, _open = _open, None
        if rec is not None and rec["batch"]:
            rec["t_end"] = time.perf_counter()
            rec["process_cpu_s"] = time.process_time() - rec.pop("cpu_start")
            rec["loadavg_1m_after"] = os.getloadavg()[0]
            STEPS.append(rec)
        return result
