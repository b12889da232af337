"""``python -m vllmref.worker_scheduler SPEC OUT``: vLLM's real V1 scheduler with no model at all.

Runs inside the vLLM environment. vLLM's ``Scheduler`` and ``KVCacheManager`` are built from a
``VllmConfig`` (the model's config.json only; no weights are loaded), requests are added, and each
step's ``schedule()`` is answered by a fabricated ``ModelRunnerOutput`` that samples one token for
every request whose scheduled tokens reach the end of what it knows, as vLLM's own scheduler tests
do. Time is counted in steps of 1.0: the clock advances by one per step and jumps to the next
arrival when nothing is running, exactly as the simulator runs with a constant step cost of 1 s.

Jobs are the trace schema (``scheduling.workload.traces``); a job's turn k+1 arrives at turn k's finish
plus its ``tool_s``. Prompt token ids follow the simulator's prefix structure: the prefix group's
system tokens are identical within the group, every input and every sampled token is unique to
its job, so block hashes match where the simulator's chained hashes match.

Records: one ``{"kind": "step"}`` per step with ``scheduled`` = ``[[job_id, turn, num_new_tokens,
num_computed_before], ...]`` in scheduling order, ``preempted`` = ``[[job_id, turn], ...]``,
``free_blocks`` after scheduling, ``free_queue`` (the block ids of the free queue, LRU first), and
``admitted_hits`` = ``[[job_id, turn, cached tokens], ...]``
for requests scheduled for the first time since they were (re)queued.
"""
from __future__ import annotations

import heapq
import json
import sys


def build_scheduler(spec: dict):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    block_size = int(spec["block_size"])
    model_config = ModelConfig(model=spec["model"], dtype="float32", seed=0, max_model_len=int(spec["max_model_len"]),
                               skip_tokenizer_init=True)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    scheduler_config = SchedulerConfig(max_num_seqs=int(spec["max_num_seqs"]),
                                       max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
                                       max_model_len=int(spec["max_model_len"]), enable_chunked_prefill=True,
                                       is_encoder_decoder=False)
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config)
    kv_cache_config = KVCacheConfig(
        # vLLM's pool includes the null block; the simulator's num_gpu_blocks counts usable blocks.
        num_blocks=int(spec["num_gpu_blocks"]) + 1, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=block_size, num_kv_heads=1,
                                                                         head_size=8, dtype=torch.float32))])
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=block_size, log_stats=True)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return scheduler, get_request_block_hasher(block_size, hash_fn)


class TokenIds:
    """Token ids with the simulator's prefix structure (distinct ranges, so no accidental matches)."""

    def __init__(self) -> None:
        self._next = 1000

    def fresh(self, n: int) -> list[int]:
        out = list(range(self._next, self._next + n))
        self._next += n
        return out


def main(spec_path: str, out_path: str) -> int:
    from vllmref.engine import write_record

    spec = json.loads(open(spec_path).read())
    # One spec, or several ("scenarios"): vLLM's import is most of a run's time, so pay it once.
    scenarios = spec["scenarios"] if "scenarios" in spec else [spec]
    with open(out_path, "w") as out:
        for index, scenario in enumerate(scenarios):
            for record in run_scenario(scenario):
                write_record(out, {**record, "scenario": index})
    return 0


class _Turns:
    """The scenario's jobs as the scheduler sees them: token histories (a turn's prompt is its job's
    history plus fresh input ids), the turns waiting for their arrival time and those in flight."""

    def __init__(self, jobs: list[dict]):
        self.jobs = jobs
        self.ids = TokenIds()
        self.system: dict[str, list[int]] = {}
        self.history: dict[int, list[int]] = {}
        self.pending = [(float(j.get("arrival_s", 0.0)), i, 0) for i, j in enumerate(jobs)]
        heapq.heapify(self.pending)
        self.live: dict[str, tuple[int, int]] = {}  # request id -> (job index, turn)
        self.generated: dict[str, list[int]] = {}  # request id -> the token ids "sampled" for it

    def send_due(self, scheduler, hasher, now: float) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        while self.pending and self.pending[0][0] <= now:
            _, j, k = heapq.heappop(self.pending)
            job = self.jobs[j]
            if k == 0:
                group = job["prefix_group"]
                if group not in self.system:
                    self.system[group] = self.ids.fresh(int(job["system_tokens"]))
                self.history[j] = list(self.system[group])
            self.history[j] = self.history[j] + self.ids.fresh(int(job["turns"][k]["input_tokens"]))
            req_id = f"{j}#{k}"
            n_out = int(job["turns"][k]["output_tokens"])
            params = SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True, temperature=0.0)
            scheduler.add_request(Request(req_id, list(self.history[j]), params, None, arrival_time=now,
                                          block_hasher=hasher))
            self.live[req_id] = (j, k)
            self.generated[req_id] = []

    def finish(self, req_ids: list[str], now: float) -> list[list]:
        """``[job_id, turn]`` of each finished request; the job's next turn queued after its tool time."""
        finished_turns = []
        for req_id in req_ids:
            j, k = self.live.pop(req_id)
            self.history[j] = self.history[j] + self.generated.pop(req_id)
            job = self.jobs[j]
            finished_turns.append([job["job_id"], k])
            if k + 1 < len(job["turns"]):
                heapq.heappush(self.pending, (now + float(job["turns"][k].get("tool_s", 0.0)), j, k + 1))
        return finished_turns


def run_scenario(spec: dict):
    """Yield one record per step of one scenario."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler, hasher = build_scheduler(spec)
    turns = _Turns(spec["jobs"])
    jobs, live, pending = turns.jobs, turns.live, turns.pending
    admitted: set[str] = set()
    now = 0.0
    step = 0
    max_steps = int(spec.get("max_steps", 200_000))
    while pending or live:
        if not live and pending and pending[0][0] > now:
            now = pending[0][0]  # idle until the next arrival
        turns.send_due(scheduler, hasher, now)
        out_s = scheduler.schedule()
        if not out_s.num_scheduled_tokens and not out_s.preempted_req_ids and not scheduler.running:
            if pending:  # nothing can run until the next arrival
                now = max(now, pending[0][0])
                scheduler.update_from_output(out_s, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
                continue
            raise SystemExit(f"requests {sorted(live)[:3]} can never be scheduled (the pool is too small)")
        step += 1
        if step > max_steps:
            raise SystemExit(f"more than {max_steps} steps: the scheduler made no progress")
        scheduled, hits, sampled_ids = [], [], []
        for req_id, n in out_s.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            before = req.num_computed_tokens - n
            j, k = live[req_id]
            scheduled.append([jobs[j]["job_id"], k, n, before])
            if req_id not in admitted:
                admitted.add(req_id)
                hits.append([jobs[j]["job_id"], k, before])
            # A token is sampled when the step reaches the end of what the request knows.
            token = [turns.ids.fresh(1)[0]] if req.num_computed_tokens >= req.num_tokens else []
            sampled_ids.append(token)
            turns.generated[req_id] += token
        preempted = []
        for req_id in sorted(out_s.preempted_req_ids or ()):
            j, k = live[req_id]
            preempted.append([jobs[j]["job_id"], k])
            admitted.discard(req_id)  # its next admission looks the prefix up again
        pool = scheduler.kv_cache_manager.block_pool
        free_blocks = pool.get_num_free_blocks()
        free_queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        req_ids = list(out_s.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled_ids, logprobs=None, prompt_logprobs_dict={},
                                pooler_output=[])
        engine_outputs = scheduler.update_from_output(out_s, mro)
        now += 1.0
        finished = [o.request_id for outputs in engine_outputs.values() for o in outputs.outputs
                    if o.finish_reason is not None]
        yield {"kind": "step", "step": step, "t_start": now - 1.0, "scheduled": scheduled, "preempted": preempted,
               "free_blocks": free_blocks, "free_queue": free_queue, "admitted_hits": hits,
               "finished": turns.finish(finished, now)}


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
