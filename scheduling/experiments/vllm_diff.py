"""Step-for-step comparison of the simulator's scheduler with vLLM's real V1 scheduler (no model).

Both sides get the same jobs and settings (block size, pool blocks, token budget, max_num_seqs,
chunked prefill and prefix caching on) and the same clock: every step takes 1.0 s (the simulator's
``ConstantStepCost(1.0)``; vLLM's side, :mod:`vllmref.worker_scheduler`, counts steps), so their
step sequences must be identical. Per step the comparison requires the same batch (for each
scheduled request: job, turn, tokens scheduled, tokens computed before the step, in scheduling
order), the same preempted requests, the same number of free blocks after scheduling and the
same free queue, block id by block id (both pools number their blocks alike and hand out the
head of the queue first, so equal queues mean equal eviction order).
The simulator runs twice: its exact loop alone (``fast_path=False``: every step scheduled by the
code that mirrors vLLM's ``schedule()``) and as replays run it, with decoding requests in the decode
group (``scheduling.engine.decode_group``) whenever a step allows; both must match vLLM. A decode-group
member is listed in the batch at its place in running order with its one token.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from scheduling.engine import Engine, EngineConfig
from scheduling.engine.step_cost import ConstantStepCost
from scheduling.policies import make_policy
from scheduling.workload.traces import Job, job_to_dict


@dataclass(frozen=True)
class DiffSettings:
    block_size: int = 16
    num_gpu_blocks: int = 64
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 8
    model: str = "llama-60m"  # only its config.json is read by vLLM (no weights)


@dataclass
class StepRecord:
    step: int
    t_start: float
    scheduled: list = field(default_factory=list)   # [job_id, turn, num_new_tokens, num_computed_before]
    preempted: list = field(default_factory=list)   # [job_id, turn]
    free_blocks: int = 0
    free_queue: list = field(default_factory=list)  # block ids, the next to be evicted first
    fast: bool = False  # the simulator scheduled it with the decode group (never compared: vLLM has none)


@dataclass
class DiffResult:
    vllm: list[StepRecord]
    sim: list[StepRecord]  # the exact loop alone
    mismatches: list[dict]
    sim_fast: list[StepRecord] = field(default_factory=list)  # with the decode group, as replays run
    fast_mismatches: list[dict] = field(default_factory=list)
    num_fast_steps: int = 0  # steps the decode group took part in

    @property
    def num_mismatching_steps(self) -> int:
        return len({m["step"] for m in self.mismatches})

    def first(self, n: int = 5) -> list[dict]:
        return self.mismatches[:n]


class _RecordingEngine(Engine):
    """The simulator, recording each scheduled step's batch, preemptions and free blocks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trace: list[StepRecord] = []
        self._victims: list = []

    def _preempt(self, r) -> None:
        self._victims.append([r.job_id, r.turn])
        super()._preempt(r)

    def _schedule(self, now_s: float):
        self._victims = []
        dur = super()._schedule(now_s)
        if dur is not None or self._victims:
            self.trace.append(StepRecord(
                step=len(self.trace) + 1, t_start=now_s, scheduled=self._batch(),
                preempted=sorted(self._victims), free_blocks=self.pool.num_free_blocks,
                free_queue=list(self.pool.free_queue_ids()), fast=self._step_fast and bool(self._dec)))
        return dur

    def _batch(self) -> list:
        """The step's batch in running order (vLLM's: running requests, then those admitted in the
        pass), decode-group members included with their one token and computed tokens."""
        rows = [(r.run_pos, [r.job_id, r.turn, n, r.num_computed]) for r, n in zip(self._sched_reqs, self._sched_n)]
        if self._step_fast:
            rows += [(r.run_pos, [r.job_id, r.turn, 1, r.lag + self._g]) for r in self._dec.values()]
        return [row for _, row in sorted(rows, key=lambda pos_row: pos_row[0])]


def sim_steps(jobs: Sequence[Job], settings: DiffSettings, fast_path: bool = False, **engine_overrides) -> list[StepRecord]:
    """The simulator's steps, by its exact loop alone or (``fast_path``) with the decode group as
    replays run it (``engine_overrides``: other EngineConfig fields, e.g. to show that a behaviour
    vLLM does not have is caught)."""
    config = EngineConfig(num_gpu_blocks=settings.num_gpu_blocks, max_num_batched_tokens=settings.max_num_batched_tokens,
                          max_num_seqs=settings.max_num_seqs, block_size=settings.block_size, fast_path=fast_path,
                          record_steps=True, **engine_overrides)
    engine = _RecordingEngine(jobs, config, make_policy("fcfs", {}), ConstantStepCost(1.0))
    engine.run()
    return engine.trace


def _spec(jobs: Sequence[Job], settings: DiffSettings) -> dict:
    from vllmref import env
    from vllmref.settings import max_model_len

    model_dir, _, _ = env.resolve_model(settings.model)
    return {**asdict(settings), "model": str(model_dir), "jobs": [job_to_dict(j) for j in jobs],
            "max_model_len": max_model_len(max(j.total_tokens() for j in jobs), settings.block_size)}


def vllm_steps_many(cases: Sequence[tuple[Sequence[Job], DiffSettings]]) -> list[list[StepRecord]]:
    """vLLM's steps for each (jobs, settings), in one worker process (vLLM's import dominates)."""
    from vllmref import env

    records = env.run_worker("worker_scheduler", {"scenarios": [_spec(j, s) for j, s in cases]}, threads=1)
    out: list[list[StepRecord]] = [[] for _ in cases]
    for r in records:
        if r["kind"] == "step":
            out[r["scenario"]].append(StepRecord(step=r["step"], t_start=r["t_start"], scheduled=r["scheduled"],
                                                 preempted=sorted(r["preempted"]), free_blocks=r["free_blocks"],
                                                 free_queue=r["free_queue"]))
    return out


def compare_steps(sim: list[StepRecord], vllm: list[StepRecord]) -> list[dict]:
    """Every difference, step by step (a missing step on one side is one difference)."""
    out = []
    for i in range(max(len(sim), len(vllm))):
        a = sim[i] if i < len(sim) else None
        b = vllm[i] if i < len(vllm) else None
        if a is None or b is None:
            out.append({"step": i + 1, "field": "step", "sim": None if a is None else asdict(a),
                        "vllm": None if b is None else asdict(b)})
            continue
        if not math.isclose(a.t_start, b.t_start, rel_tol=1e-12, abs_tol=1e-9):  # the same float sums, summed
            out.append({"step": i + 1, "field": "t_start", "sim": a.t_start, "vllm": b.t_start})  # in another order
        for name in ("scheduled", "preempted", "free_blocks", "free_queue"):
            va, vb = getattr(a, name), getattr(b, name)
            if va != vb:
                out.append({"step": i + 1, "field": name, "sim": va, "vllm": vb})
    return out


def _check_fits(jobs: Sequence[Job], settings: DiffSettings) -> None:
    from common.errors import ConfigError

    pool_tokens = settings.num_gpu_blocks * settings.block_size
    for job in jobs:  # vLLM would keep such a turn waiting forever; the simulator refuses it
        if job.total_tokens() > pool_tokens:
            raise ConfigError(f"job {job.job_id} needs {job.total_tokens()} tokens, more than the pool's {pool_tokens}")


def run_differentials(cases: Sequence[tuple[Sequence[Job], DiffSettings]]) -> list[DiffResult]:
    """Each (jobs, settings) through vLLM's scheduler and the simulator, compared step by step."""
    for jobs, settings in cases:
        _check_fits(jobs, settings)
    results = []
    for (jobs, settings), vllm in zip(cases, vllm_steps_many(cases)):
        sim = sim_steps(jobs, settings)
        fast = sim_steps(jobs, settings, fast_path=True)
        results.append(DiffResult(vllm=vllm, sim=sim, mismatches=compare_steps(sim, vllm), sim_fast=fast,
                                  fast_mismatches=compare_steps(fast, vllm),
                                  num_fast_steps=sum(s.fast for s in fast)))
    return results


