"""Columns of a replay output directory (steps.csv, turns.csv, jobs.csv): the one definition that
the engine writes and the viewer reads (docs/scheduling.md lists what each column means)."""

STEP_COLUMNS = (
    "step", "t_s", "dur_s", "num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs", "num_decode_seqs",
    "num_running", "num_waiting", "kv_used_blocks", "kv_pinned_blocks", "kv_cached_blocks", "kv_total_blocks",
    "pool_used_blocks", "pool_total_blocks", "break_reason", "num_preemptions", "num_prefix_hit_tokens",
    "num_pool_load_tokens",
)
# What every reader may rely on in turns.csv (the contract of the step log, docs/scheduling.md).
TURN_CONTRACT_COLUMNS = (
    "job_id", "turn", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s", "ttft_s", "queue_s",
    "prompt_tokens", "hit_tokens", "pool_hit_tokens", "computed_tokens", "output_tokens", "num_preemptions",
)
# The engine also writes the two counts its conservation tests check.
TURN_COLUMNS = TURN_CONTRACT_COLUMNS + ("recomputed_tokens", "scheduled_tokens")
JOB_COLUMNS = ("job_id", "prefix_group", "arrival_s", "finish_s", "jct_s", "num_turns")
