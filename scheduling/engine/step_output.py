"""Step output: applying a finished step to its requests (scheduling.engine.loop).

vLLM's ``Scheduler.update_from_output()`` in the simulator: computed tokens advance by what was
scheduled, a request whose known tokens are all computed samples one, a turn that has all its
output finishes (its blocks freed or kept by the KV policy, its record written) and the job's next
turn arrives after the tool call. Decode-group members advance by the group's step index instead
(``scheduling.engine.decode_group``); those that finish or join the group are handled here.

A mixin of :class:`scheduling.engine.loop.Engine`, on the engine's own state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from scheduling.engine.request import JobState, Request, Status

if TYPE_CHECKING:
    from scheduling.engine.kv_manager import KVCacheManager
    from scheduling.engine.outputs import EngineResult
    from scheduling.policies.base import KVPolicy


class StepOutput:
    """The step-completion half of the engine (see the module docstring)."""

    # the engine's state these methods use, set by Engine.__init__
    kv: KVCacheManager
    policy: KVPolicy
    running: list[Request]
    result: EngineResult
    block_size: int
    _g: int
    _dec: dict[int, Request]
    _prefilling: list[Request]
    _fin_due: dict[int, list[Request]]
    _lag_sum: int
    _dec_max_pos: int
    _dec_max_pos_dirty: bool
    _step_fast: bool
    _sched_reqs: list[Request]
    _sched_n: list[int]
    _num_jobs_done: int

    if TYPE_CHECKING:  # another part of the engine defines these (no runtime stub can shadow them)
        def next_turn(self, js: JobState, turn: int, time_s: float) -> None: ...  # Engine
        def _check_step(self, budget: int) -> None: ...  # Engine
        def _materialize(self, r: Request, g: int) -> None: ...  # DecodeGroup
        def _join_decode_group(self, r: Request, next_g: int) -> None: ...  # DecodeGroup

    def _finish_step(self, now_s: float) -> None:
        """Apply the step in flight: computed tokens, sampled tokens, finished turns."""
        g = self._g
        finished = None
        joined = None
        for r, n in zip(self._sched_reqs, self._sched_n):
            # Every request the scheduling pass listed (decode-group members are not listed): its
            # computed tokens advance by what was scheduled, as in vLLM, whether it decoded one token
            # or prefilled a chunk; its full blocks were hashed when the scheduler allocated them.
            c = r.num_computed
            p = r.prompt_tokens
            if c < p:
                r.prompt_computed_tokens += (c + n if c + n < p else p) - c
            c += n
            r.num_computed = c
            r.num_admission_tokens += n
            if c < r.num_tokens:
                continue  # a chunk of a longer prefill: nothing sampled yet
            r.num_output += 1
            r.num_tokens += 1
            if r.first_token_s is None:
                r.first_token_s = now_s
            if r.num_output == r.output_tokens:
                if finished is None:
                    finished = []
                finished.append(r)
            elif self._step_fast:
                if joined is None:
                    joined = []
                joined.append(r)
        if self._step_fast:
            for r in self._fin_due.pop(g, ()):
                self._materialize(r, g + 1)
                del self._dec[r.seq]
                self._lag_sum -= r.lag
                if r.run_pos == self._dec_max_pos:
                    self._dec_max_pos_dirty = True
                if finished is None:
                    finished = []
                finished.append(r)
            if joined:
                for r in joined:
                    self._join_decode_group(r, g + 1)
        if finished:
            for r in finished:
                self._finish_turn(r, now_s)
            self.running[:] = [r for r in self.running if r.status == Status.RUNNING]
        if not self._step_fast or finished or joined:
            if not self._step_fast:  # exact mode: every decoding request joins the group
                for r in self.running:
                    if r.num_output and r.num_computed == r.num_tokens - 1:
                        self._join_decode_group(r, g + 1)
            dec = self._dec
            self._prefilling = [r for r in self.running if r.seq not in dec]
        self._g = g + 1
        self._check_step(0)

    def _release_turn(self, r: Request, now_s: float) -> None:
        """A finished turn gives its blocks back (unless its policy holds them: it frees them itself)."""
        r.status = Status.FINISHED
        r.finish_s = now_s
        if self.policy.on_turn_finish(r, now_s):
            self.kv.free(r)
        r.blocks = []

    def _finish_turn(self, r: Request, now_s: float) -> None:
        self._release_turn(r, now_s)
        js = r.job_state
        scheduled = r.num_recomputed_tokens + r.num_admission_tokens
        # a finished turn was scheduled and generated its first token
        assert r.first_token_s is not None and r.first_scheduled_s is not None
        self.result.turns.append((
            js.job.job_id, r.turn, r.arrival_s, r.first_scheduled_s, r.first_token_s, now_s,
            r.first_token_s - r.arrival_s, r.first_scheduled_s - r.arrival_s, r.prompt_tokens, r.hit_tokens,
            r.pool_hit_tokens, r.prompt_computed_tokens, r.output_tokens, r.num_preemptions,
            r.num_recomputed_tokens, scheduled,
        ))
        turns = js.job.turns
        if r.turn + 1 < len(turns):
            self.next_turn(js, r.turn + 1, now_s + turns[r.turn].tool_s)
        else:
            js.finish_s = now_s
            self._num_jobs_done += 1
            self.result.jobs.append((js.job.job_id, js.job.prefix_group, js.job.arrival_s, now_s,
                                     now_s - js.job.arrival_s, len(turns)))

