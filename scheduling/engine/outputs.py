"""Columns of a replay output directory (steps.csv, turns.csv, jobs.csv): the one definition that
the engine writes and the viewer reads (docs/scheduling.md lists what each column means).

The engine's hot loop appends plain tuples in these orders; ``StepRecord``, ``TurnRecord`` and
``JobRecord`` name their fields for readers and tests (``EngineResult.step_records()`` etc.), and
the ``*_COLUMNS`` tuples are their field names.
"""
from dataclasses import dataclass, field
from typing import NamedTuple


class StepRecord(NamedTuple):
    step: int
    t_s: float
    dur_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_running: int
    num_waiting: int
    kv_used_blocks: int
    kv_pinned_blocks: int
    kv_cached_blocks: int
    kv_total_blocks: int
    pool_used_blocks: int
    pool_total_blocks: int
    break_reason: str
    num_preemptions: int
    num_prefix_hit_tokens: int
    num_pool_load_tokens: int


class TurnRecord(NamedTuple):
    job_id: str
    turn: int
    arrival_s: float
    first_scheduled_s: float
    first_token_s: float
    finish_s: float
    ttft_s: float
    queue_s: float
    prompt_tokens: int
    hit_tokens: int
    pool_hit_tokens: int
    computed_tokens: int
    output_tokens: int
    num_preemptions: int
    # the two counts the engine's conservation tests check (not part of the readers' contract)
    recomputed_tokens: int
    scheduled_tokens: int


class JobRecord(NamedTuple):
    job_id: str
    prefix_group: str
    arrival_s: float
    finish_s: float
    jct_s: float
    num_turns: int


STEP_COLUMNS = StepRecord._fields
TURN_COLUMNS = TurnRecord._fields
# What every reader may rely on in turns.csv (the contract of the step log, docs/scheduling.md).
TURN_CONTRACT_COLUMNS = TURN_COLUMNS[:14]
JOB_COLUMNS = JobRecord._fields


@dataclass
class EngineResult:
    """What :meth:`Engine.run` returns: records as tuples in the *_COLUMNS order, and counters."""

    steps: list = field(default_factory=list)
    turns: list = field(default_factory=list)
    jobs: list = field(default_factory=list)
    num_steps: int = 0
    num_preemptions: int = 0
    num_inline_decode_steps: int = 0  # steps run by the pure-decode loop (Engine._decode_run)
    sim_time_s: float = 0.0
    wall_s: float = 0.0
    num_gpu_blocks: int = 0
    # Whether the GPU pool ever ran short (``gpubench replay`` notes a run where it never did: the
    # KV policies then had nothing to evict, pin or offload): the most blocks holding KV (in use,
    # or free with a reusable prefix) after a step was scheduled, the cached blocks evicted for new
    # ones, and the times a request found too few free blocks (a policy's relief, a preemption or
    # a wait followed).
    peak_kv_blocks: int = 0
    num_evicted_blocks: int = 0
    num_block_shortages: int = 0
    policy_stats: dict = field(default_factory=dict)

    def step_records(self) -> list[StepRecord]:
        """The step log with named fields (the engine itself keeps plain tuples: they are cheaper)."""
        return [StepRecord._make(r) for r in self.steps]

    def turn_records(self) -> list[TurnRecord]:
        return [TurnRecord._make(r) for r in self.turns]

    def job_records(self) -> list[JobRecord]:
        return [JobRecord._make(r) for r in self.jobs]
