"""Per-job and per-turn state inside the engine.

Token identity is synthetic (traces carry counts, not tokens). A job's token sequence is::

    | system_tokens (shared by prefix_group) | in_0 | out_0 | in_1 | out_1 | ... |
      block i in here: identity ("g", group, i)   block i past it: identity ("j", job_id, i)

A block that straddles the end of the system prompt holds job tokens, so it is a job block. Hashes
are chained (:func:`scheduling.engine.kv_cache.chain_hash`), so two jobs of one group share exactly their
full system-prompt blocks, and turn k+1's prompt shares every full block of turn k's prompt and
output (the last sampled token of turn k has no KV: it is the first token turn k+1 computes).
"""
from __future__ import annotations

import enum

from scheduling.engine.kv_cache import BlockHash, chain_hash
from scheduling.workload.traces import Job

BLOCK_SIZE = 16


class Status(enum.IntEnum):
    WAITING = 0         # needs a prefix lookup (fresh or preempted)
    WAITING_LOADED = 1  # holds blocks loaded by a connector; continues its prefill
    LOADING = 2         # an asynchronous connector load is in flight
    RUNNING = 3
    FINISHED = 4


class JobState:
    """Engine-side state of one job: its block-hash chain, the turn waiting for admission and its
    finish time (policies keep their own state)."""

    __slots__ = ("job", "index", "hashes", "hash_index", "_group_blocks", "finish_s", "waiting_request")

    def __init__(self, job: Job, index: int, block_size: int = BLOCK_SIZE) -> None:
        self.job = job
        self.index = index  # arrival order of the job (ties broken by trace order)
        self.hashes: list[BlockHash] = []
        self.hash_index: dict[BlockHash, int] = {}  # hash -> block index in this job's chain
        self._group_blocks = job.system_tokens // block_size
        self.finish_s: float | None = None
        self.waiting_request: Request | None = None  # arrived, not admitted yet

    def block_hashes(self, num_blocks: int) -> list[BlockHash]:
        """The hash list, extended so that it covers at least ``num_blocks`` full blocks."""
        h = self.hashes
        if len(h) < num_blocks:
            parent = h[-1] if h else None
            gb, group, jid = self._group_blocks, self.job.prefix_group, self.job.job_id
            for i in range(len(h), num_blocks):
                ident = ("g", group, i) if i < gb else ("j", jid, i)
                parent = chain_hash(parent, ident)
                h.append(parent)
                self.hash_index[parent] = i
        return h

    def prompt_tokens(self, turn: int) -> int:
        """Tokens of turn ``turn``'s prompt: system + all earlier inputs and outputs + its input."""
        turns = self.job.turns
        return self.job.system_tokens + sum(t.input_tokens + t.output_tokens for t in turns[:turn]) + turns[turn].input_tokens


class Request:
    """One turn of a job being served. Token counts follow vLLM: ``num_tokens`` = prompt + sampled."""

    __slots__ = ("job_state", "turn", "seq", "prompt_tokens", "output_tokens", "num_tokens", "num_output",
                 "num_computed", "blocks", "num_cached_blocks", "status", "arrival_s", "first_scheduled_s",
                 "first_token_s", "finish_s", "hit_tokens", "pool_hit_tokens", "prompt_computed_tokens",
                 "num_preemptions", "num_scheduled_tokens", "num_recomputed_tokens", "num_admission_tokens",
                 "queue_key", "run_pos", "lag", "adm_lag", "hit_memo", "hit_log_pos")

    def __init__(self, job_state: JobState, turn: int, seq: int, arrival_s: float, prompt_tokens: int) -> None:
        self.job_state = job_state
        self.turn = turn
        self.seq = seq
        self.prompt_tokens = prompt_tokens
        self.output_tokens = job_state.job.turns[turn].output_tokens
        self.num_tokens = prompt_tokens
        self.num_output = 0
        self.num_computed = 0
        self.blocks: list[int] = []
        self.num_cached_blocks = 0
        self.status = Status.WAITING
        self.arrival_s = arrival_s
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.hit_tokens = 0           # GPU prefix hit (positions < prompt) of the final admission
        self.pool_hit_tokens = 0      # tokens from a connector (cpu-offload / lmcache), final admission
        self.prompt_computed_tokens = 0  # prompt positions prefilled in the final admission
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0    # every token ever scheduled for this turn
        self.num_recomputed_tokens = 0   # scheduled in admissions later preempted (waste)
        self.num_admission_tokens = 0    # scheduled since the current admission
        self.queue_key: tuple = ()
        self.run_pos = -1  # position in the running order (admission counter)
        # Decode group (engine fast path): while a member, num_computed = lag + step index and
        # num_admission_tokens = adm_lag + step index; the other counters follow (see Engine).
        self.lag = 0
        self.adm_lag = 0
        self.hit_memo: list[int] | None = None  # last prefix lookup (Engine._prefix_hit)
        self.hit_log_pos = 0

    @property
    def job_id(self) -> str:
        return self.job_state.job.job_id

    @property
    def is_last_turn(self) -> bool:
        return self.turn == len(self.job_state.job.turns) - 1

    def __repr__(self) -> str:
        return (f"Request({self.job_id}#{self.turn}, {self.status.name}, computed={self.num_computed}/"
                f"{self.num_tokens}, out={self.num_output}/{self.output_tokens}, blocks={len(self.blocks)})")
