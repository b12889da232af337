"""Columns of a replay output directory (steps.csv, turns.csv, jobs.csv): the one definition that
the engine writes and the viewer reads (docs/scheduling.md lists what each column means).

The engine's hot loop appends plain tuples in these orders; ``StepRecord``, ``TurnRecord`` and
``JobRecord`` name their fields for readers and tests (``EngineResult.step_records()`` etc.), and
the ``*_COLUMNS`` tuples are their field names.
"""
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
