"""The running tally of one step's batch, as the step cost prices it (scheduling.engine.loop).

vLLM's scheduler has no prefill or decode phase, only tokens scheduled per request; the step cost
does distinguish them. One rule decides, wherever a request enters or leaves a batch: a request
that has sampled (``num_output > 0``) and is scheduled exactly its last known token (``n == 1``,
``num_computed == num_tokens - 1``) is a decode; anything else, including a one-token chunk of a
prompt, is a prefill chunk. A preempted request that is re-admitted with all but its last token
hit in the prefix cache is therefore a decode, whether the admission loop or the running loop
schedules it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduling.engine.request import Request
    from scheduling.engine.step_cost import StepCost


def is_decode(r: Request, num_new_tokens: int, num_computed: int) -> bool:
    """True when scheduling ``num_new_tokens`` of ``r`` after ``num_computed`` is one decode."""
    return bool(r.num_output) and num_new_tokens == 1 and num_computed == r.num_tokens - 1


class BatchTally:
    """Prefill tokens, sequences and context, decode sequences and context of the step being built,
    and what else the pass adds to it: seconds the KV policy charges inside the step (``extra_s``),
    prefix-hit and connector tokens of admitted requests, and requests preempted."""

    __slots__ = ("num_prefill_tokens", "num_prefill_seqs", "prefill_context_tokens", "num_decode_seqs",
                 "decode_context_tokens", "extra_s", "num_hit_tokens", "num_pool_tokens", "num_preempted")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_prefill_tokens = self.num_prefill_seqs = self.prefill_context_tokens = 0
        self.num_decode_seqs = self.decode_context_tokens = 0
        self.extra_s = 0.0
        self.num_hit_tokens = self.num_pool_tokens = self.num_preempted = 0

    def add_decodes(self, num_seqs: int, context_tokens: int) -> None:
        """The decode group's members, one token each, ``context_tokens`` computed in all."""
        self.num_decode_seqs += num_seqs
        self.decode_context_tokens += context_tokens

    def add(self, r: Request, num_new_tokens: int, num_computed: int) -> bool:
        """Count ``r`` in the batch; True when it is a decode (see :func:`is_decode`)."""
        if r.num_output and num_new_tokens == 1 and num_computed == r.num_tokens - 1:
            self.num_decode_seqs += 1
            self.decode_context_tokens += num_computed
            return True
        self.num_prefill_tokens += num_new_tokens
        self.num_prefill_seqs += 1
        self.prefill_context_tokens += num_computed
        return False

    def remove(self, r: Request, num_new_tokens: int, num_computed: int) -> None:
        """Take back an :meth:`add` of the same request in the same pass (a preempted victim)."""
        if is_decode(r, num_new_tokens, num_computed):
            self.num_decode_seqs -= 1
            self.decode_context_tokens -= num_computed
        else:
            self.num_prefill_tokens -= num_new_tokens
            self.num_prefill_seqs -= 1
            self.prefill_context_tokens -= num_computed

    def step_s(self, step_cost: StepCost) -> float:
        """The step's duration under ``step_cost``, with what the policy charges inside it."""
        return step_cost.step_s(
            num_prefill_tokens=self.num_prefill_tokens, num_prefill_seqs=self.num_prefill_seqs,
            prefill_context_tokens=self.prefill_context_tokens, num_decode_seqs=self.num_decode_seqs,
            decode_context_tokens=self.decode_context_tokens) + self.extra_s
