"""The decode group: how the replay engine decodes (scheduling.engine.loop).

Between steps every decoding request (prompt computed, one token per step) is a member of the
group, its counters kept as offsets from the step index ``_g`` (``num_computed = lag + _g``), so a
step touches only the members that need a new block or finish. A group decode is scheduled in one
place, ``_group_step``: by the scheduling pass when the step is provably the one vLLM's loop would
take (the NOTE(perf) above ``Engine._schedule`` says when), and by ``_decode_run`` for stretches of
pure-decode steps in which nothing else happens. When a step cannot take it (a member would not get
its token, or a block it needs is not free), the members are materialized and vLLM's loop schedules
them like any running request, one new token each; at the end of that step they rejoin the group.
The differential test against vLLM's scheduler runs the engine both ways.

A mixin of :class:`scheduling.engine.loop.Engine`, not an object of its own: these methods run in the
replay's hot loop on the engine's own attributes, which stay one attribute lookup away.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from scheduling.engine.engine_config import EngineConfig
    from scheduling.engine.kv_cache import BlockPool
    from scheduling.engine.kv_manager import KVCacheManager
    from scheduling.engine.outputs import EngineResult
    from scheduling.engine.request import JobState, Request
    from scheduling.engine.step_cost import StepCost


class DecodeGroup:
    """The decode-group half of the engine (see the module docstring)."""

    # the engine's state these methods use, set by Engine.__init__
    config: EngineConfig
    pool: BlockPool
    kv: KVCacheManager
    step_cost: StepCost
    result: EngineResult
    jobs: list[JobState]
    block_size: int
    _heap: list
    horizon_s: float  # no inline run passes it (Engine.__init__)
    _progress: Callable[[int, int, float], None] | None
    _num_jobs_done: int
    _g: int  # index of the next step
    _dec: dict[int, Request]  # the group's members by request sequence number
    _prefilling: list[Request]  # running requests outside the group, in running order
    _alloc_due: dict[int, list[Request]]  # step index -> members whose next token needs a new block
    _fin_due: dict[int, list[Request]]  # step index -> members that have all their tokens after it
    _lag_sum: int
    _dec_max_pos: int
    _dec_max_pos_dirty: bool

    def _decode_run(self, now_s: float, dur_s: float) -> float:
        """Run consecutive pure-decode steps inline; return the end of the step left in flight.

        NOTE(perf): at light load most steps decode a few requests and nothing else happens: no
        prefill, an empty queue, no event before the step ends. Such a step only moves the group's
        step index, takes a block for members that cross a block boundary and adds its duration to
        the clock. This loop does exactly that, with the same float additions in the same order
        as the event loop, until a step would differ: an event falls due, a member finishes, or a
        block it needs is not free. The step log is off here (``record_steps=False``), so no row
        is skipped.
        """
        g = self._g  # the step in flight, scheduled at now_s
        heap = self._heap
        next_event_s = heap[0][0] if heap else float("inf")  # nothing is pushed inside the run
        if self.horizon_s < next_event_s:
            next_event_s = self.horizon_s
        fin_due, alloc_due, pool = self._fin_due, self._alloc_due, self.pool
        num_decode_seqs = len(self._dec)
        quantum = self.step_cost.decode_quantum
        group_step = self._group_step
        res, progress = self.result, self._progress
        t, end = now_s, now_s + dur_s
        dmax = -1
        while next_event_s > end and g not in fin_due:
            due = alloc_due.get(g + 1)
            if due is not None and len(due) > pool.num_free_blocks:
                break  # the exact scheduler decides who gets the blocks
            # Step g ends with nothing to apply; step g + 1 starts at its end.
            g += 1
            t = end
            decode_context_tokens = group_step(g)
            if decode_context_tokens > dmax:
                dur_s, dmax = quantum(num_decode_seqs, decode_context_tokens)
            end = t + dur_s
            res.num_steps += 1
            if progress and not res.num_steps & 511:
                progress(self._num_jobs_done, len(self.jobs), t)
        res.num_inline_decode_steps += g - self._g
        self._g = g
        return end

    def _group_step(self, g: int) -> int:
        """Start step ``g`` of the decode group, the one place a group decode is scheduled (by the
        scheduling pass and by ``_decode_run`` alike): every member gets its one token, and a new
        block if that token starts one (the caller checked they are free). Returns the step's decode
        context tokens (the members' computed tokens, summed)."""
        alloc_due = self._alloc_due
        due = alloc_due.pop(g, None)
        if due is not None:
            # NOTE(perf): the pool directly, not KVCacheManager.allocate: a member crossing a block
            # boundary takes exactly one block, which the caller checked is free, and at ~300k
            # decode steps/s one more call per member and block costs ~10 % of the step.
            get_new, nxt = self.kv.pool.get_new_blocks, g + self.block_size
            for r in due:
                r.blocks.extend(get_new(1))
                if nxt <= r.output_tokens + r.prompt_tokens - 2 - r.lag:  # still decoding then: due again
                    alloc_due.setdefault(nxt, []).append(r)
        return self._lag_sum + len(self._dec) * g

    def _fast_plan(self) -> bool:
        """True when this step can run on the decode-group fast path (see the NOTE above)."""
        num_decode_seqs = len(self._dec)
        left = self.config.max_num_batched_tokens - num_decode_seqs
        if left < 0:
            return False
        pre = self._prefilling
        demand = 0
        for r in pre:
            demand += r.num_tokens - r.num_computed
        if demand > left and num_decode_seqs:
            # Prefills do not all fit: decodes still all run iff they come first in running order.
            if self._dec_max_pos_dirty:
                self._dec_max_pos = max(r.run_pos for r in self._dec.values())
                self._dec_max_pos_dirty = False
            if min(r.run_pos for r in pre) < self._dec_max_pos:
                return False
        need = len(self._alloc_due.get(self._g, ()))
        num_new_blocks = self.kv.num_new_blocks
        for r in pre:
            if left == 0:
                break
            c = r.num_computed
            n = r.num_tokens - c
            if n > left:
                n = left
            k = num_new_blocks(r, c + n)
            if k > 0:
                need += k
            left -= n
        return need <= self.pool.num_free_blocks

    def _join_decode_group(self, r: Request, next_g: int) -> None:
        """``r`` sampled a token and will decode from step ``next_g`` on."""
        lag = r.num_computed - next_g
        r.lag = lag
        r.adm_lag = r.num_admission_tokens - next_g
        self._dec[r.seq] = r
        self._lag_sum += lag
        if r.run_pos > self._dec_max_pos:
            self._dec_max_pos = r.run_pos
        fin = r.output_tokens + r.prompt_tokens - 2 - lag  # step after which it has all its tokens
        self._fin_due.setdefault(fin, []).append(r)
        alloc = len(r.blocks) * self.block_size - lag  # step at which computed + 1 overflows its blocks
        if alloc < next_g:
            alloc = next_g  # (cannot happen: blocks cover the computed tokens + 1)
        if alloc <= fin:
            self._alloc_due.setdefault(alloc, []).append(r)

    def _materialize(self, r: Request, g: int) -> None:
        """Write a decode-group member's counters as of the start of step ``g``."""
        c = r.lag + g
        r.num_computed = c
        r.num_tokens = c + 1
        r.num_output = c + 1 - r.prompt_tokens
        r.num_admission_tokens = r.adm_lag + g
        self.kv.cache_full_blocks(r)

    def _leave_fast_mode(self) -> None:
        """Materialize every decode-group member; the exact loop takes over for this step."""
        g = self._g
        for r in self._dec.values():
            self._materialize(r, g)
        self._dec.clear()
        self._alloc_due.clear()
        self._fin_due.clear()
        self._lag_sum = 0
        self._dec_max_pos = -1
        self._dec_max_pos_dirty = False
