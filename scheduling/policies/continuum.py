"""``continuum``: keep a job's KV cache pinned across its tool call for a time-to-live (TTL).

Continuum (Li et al. 2025, arXiv 2511.02230), as summarized in the project reference:
- on a non-final turn's finish the job's blocks stay pinned (not freed) until a deadline chosen by
  a TTL rule; at the deadline the pin is released if the job has nothing waiting, otherwise it is
  released when the waiting turn is admitted (its prefix hit then takes the blocks);
- waiting turns of pinned jobs are served first, then FCFS by the job's first arrival;
- under memory pressure the running request of the latest-arrived job is preempted (preferring
  jobs not on their last turn); when nothing else runs, the pin with the latest deadline goes.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from scheduling.engine.request import JobState, Request
from scheduling.policies.base import KVPolicy, PriorityQueue, RequestQueue, check_params

TTL_RULES = ("fixed", "tool-mean", "expected-benefit")
# The order among waiting turns that found their job unpinned (and among pinned ones): Continuum's own
# (the job's first arrival), or a queue order's (scheduling.policies.ordering, .jitserve) with its defaults.
ORDERS = ("arrival", "sjf", "las", "jitserve")


@dataclass(frozen=True)
class ContinuumParams:
    """Continuum knobs (defaults and their sources: docs/scheduling.md).

    Args:
        ttl_rule: ``fixed``, ``tool-mean`` or ``expected-benefit``.
        ttl_s: the fixed TTL, and the TTL ``tool-mean`` pins for.
        tool_mean_threshold_s: ``tool-mean`` pins only tools whose running mean is at most this.
        eta: correlation factor on the queueing-delay term of the expected benefit.
        prior_mean_s: exponential prior of tool time while a tool has few samples.
        min_samples: samples of a tool before its empirical CDF replaces the prior.
        queue_window: turns in the sliding mean of queueing delay seen by evicted requests.
        sample_window: most recent durations per tool kept for the empirical CDF.
        order: the order within pinned and within unpinned waiting turns: ``arrival`` (Continuum's:
            the job's first arrival) or the queue order of ``sjf``, ``las`` or ``jitserve``.
    """

    ttl_rule: str = "expected-benefit"
    ttl_s: float = 2.0
    tool_mean_threshold_s: float = 2.0
    eta: float = 1.0
    prior_mean_s: float = 1.0
    min_samples: int = 5
    queue_window: int = 64
    sample_window: int = 256
    order: str = "arrival"

    def __post_init__(self) -> None:
        check_params("continuum", self, positive=("prior_mean_s",), non_negative=("ttl_s", "tool_mean_threshold_s", "eta"),
                     counts=("min_samples", "queue_window", "sample_window"))
        if self.order not in ORDERS:
            from common.errors import ConfigError

            raise ConfigError(f"continuum order must be one of {', '.join(ORDERS)}, got {self.order!r}")



@dataclass(slots=True)
class _Pin:
    """Blocks a job keeps across its tool call, until ``deadline_s`` (or its next turn's admission)."""

    job_state: JobState
    blocks: list
    deadline_s: float

class ContinuumPolicy(KVPolicy):
    name = "continuum"

    def __init__(self, params: ContinuumParams | None = None) -> None:
        super().__init__()
        self.p = params or ContinuumParams()
        if self.p.ttl_rule not in TTL_RULES:
            from common.errors import ConfigError

            raise ConfigError(f"unknown TTL rule '{self.p.ttl_rule}' (known: {', '.join(TTL_RULES)})")
        self._pins: dict[int, _Pin] = {}  # job index -> the pin that job holds
        self._num_pinned_blocks = 0
        self._tool_samples: dict[str | None, deque] = {}  # recent durations (empirical CDF)
        self._tool_sum: dict[str | None, float] = {}      # running mean over all durations
        self._tool_count: dict[str | None, int] = {}
        self._evicted_queue_s: deque = deque(maxlen=self.p.queue_window)
        self._pinned_at_arrival: set[int] = set()  # request seqs that found their job pinned
        self.num_pins = self.num_pin_hits = self.num_pin_expired = self.num_pin_released_pressure = 0
        self.ttl_chosen_s: list[float] = []
        self.order: KVPolicy | None = None  # a queue order's policy, asked only for its keys and estimates
        if self.p.order != "arrival":
            from scheduling.policies.jitserve import JITServePolicy
            from scheduling.policies.ordering import LASPolicy, SJFPolicy

            self.order = {"sjf": SJFPolicy, "las": LASPolicy, "jitserve": JITServePolicy}[self.p.order]()

    # --- queue order --------------------------------------------------------------------------
    def attach(self, ctx) -> None:
        super().attach(ctx)
        if self.order is not None:
            self.order.attach(ctx)

    def make_queue(self) -> RequestQueue:
        self.queue = self.order.make_queue() if self.order is not None else PriorityQueue()
        return self.queue

    def on_arrival(self, req: Request, now_s: float) -> None:
        js = req.job_state
        pinned = js.index in self._pins
        if pinned:
            self._pinned_at_arrival.add(req.seq)
        # Pinned jobs first, then by the job's first arrival (or the queue order's key).
        if self.order is None:
            req.queue_key = (0 if pinned else 1, js.job.arrival_s, js.index, req.turn)
            return
        self.order.on_arrival(req, now_s)
        req.queue_key = (0 if pinned else 1, *req.queue_key)

    def before_admission(self, now_s: float) -> None:
        """A re-ranking order (jitserve) re-keys the waiting turns: put the pinned ones first again."""
        if self.order is None:
            return
        rankings = getattr(self.order, "num_rankings", None)
        self.order.before_admission(now_s)
        if rankings is None or getattr(self.order, "num_rankings") == rankings:
            return
        items = getattr(self.queue, "items")  # a re-ranking order's RankedQueue
        for r in items:
            r.queue_key = (0 if r.seq in self._pinned_at_arrival else 1, *r.queue_key)
        items.sort(key=lambda r: (r.queue_key, r.seq))

    def on_job_arrival_gap(self, req: Request, now_s: float) -> None:
        prev = req.job_state.job.turns[req.turn - 1]
        window = self._tool_samples.get(prev.tool)
        if window is None:
            window = self._tool_samples[prev.tool] = deque(maxlen=self.p.sample_window)
        window.append(prev.tool_s)
        self._tool_sum[prev.tool] = self._tool_sum.get(prev.tool, 0.0) + prev.tool_s
        self._tool_count[prev.tool] = self._tool_count.get(prev.tool, 0) + 1

    def on_admitted(self, req: Request, now_s: float) -> None:
        js = req.job_state
        if req.seq in self._pinned_at_arrival:
            self._pinned_at_arrival.discard(req.seq)
            if js.index in self._pins:
                self.num_pin_hits += 1
        elif req.turn > 0 and req.first_scheduled_s == now_s:
            self._evicted_queue_s.append(now_s - req.arrival_s)
        if js.index in self._pins:
            self._release(js)

    # --- pinning ------------------------------------------------------------------------------
    def on_turn_finish(self, req: Request, now_s: float) -> bool:
        if self.order is not None:
            self.order.on_turn_finish(req, now_s)  # its estimates learn from every turn; blocks stay ours
        if req.is_last_turn:
            return True
        js = req.job_state
        ttl_s = self.ttl_s(js.job.turns[req.turn].tool, req.num_computed)
        self.ttl_chosen_s.append(ttl_s)
        if ttl_s <= 0:
            return True
        pin = self._pins[js.index] = _Pin(js, req.blocks, now_s + ttl_s)
        self._num_pinned_blocks += len(req.blocks)
        self.num_pins += 1
        from scheduling.engine.events import PinExpiryEvent

        assert self.ctx is not None  # attached before the engine runs
        self.ctx.push(PinExpiryEvent, pin.deadline_s, js)
        return False

    def holds_blocks(self, job_state: JobState) -> bool:
        return job_state.index in self._pins

    def on_pin_deadline(self, js: JobState, deadline_s: float) -> None:
        """Called by the engine's pin-expiry event."""
        pin = self._pins.get(js.index)
        if pin is None or pin.deadline_s != deadline_s:
            return  # already released (hit, pressure) or re-pinned later
        if js.waiting_request is not None:
            return  # the job has a turn waiting: keep the pin until that turn is admitted
        self.num_pin_expired += 1
        self._release(js)

    def _release(self, js: JobState) -> None:
        blocks = self._pins.pop(js.index).blocks
        self._num_pinned_blocks -= len(blocks)
        assert self.ctx is not None  # attached before the engine runs
        self.ctx.free_blocks(blocks)

    def relieve_pressure(self, now_s: float, num_other_running: int) -> bool:
        if num_other_running > 0 or not self._pins:
            return False
        js = max(self._pins.values(), key=lambda pin: (pin.deadline_s, pin.job_state.index)).job_state
        self.num_pin_released_pressure += 1
        self._release(js)
        return True

    def preemption_victim(self, running: list[Request]) -> Request:
        # Latest-arrived job first, preferring requests that are not on their job's last turn.
        return max(running, key=lambda r: (not r.is_last_turn, r.job_state.job.arrival_s, r.job_state.index))

    # --- TTL rules ----------------------------------------------------------------------------
    def ttl_s(self, tool: str | None, context_tokens: int) -> float:
        """TTL for a job that just finished a turn and now runs ``tool``."""
        p = self.p
        if p.ttl_rule == "fixed":
            return p.ttl_s
        samples = self._tool_samples.get(tool, ())
        if p.ttl_rule == "tool-mean":
            count = self._tool_count.get(tool, 0)
            mean_s = self._tool_sum[tool] / count if count else p.prior_mean_s
            return p.ttl_s if mean_s <= p.tool_mean_threshold_s else 0.0
        return self._expected_benefit_ttl_s(samples, context_tokens)

    def _expected_benefit_ttl_s(self, samples, context_tokens: int) -> float:
        """argmax over τ of F_tool(τ)·(T·η + reload_s) − τ, τ ∈ {0} ∪ observed durations."""
        p = self.p
        queue_s = sum(self._evicted_queue_s) / len(self._evicted_queue_s) if self._evicted_queue_s else 0.0
        value_s = queue_s * p.eta + self.reload_s(context_tokens)
        if len(samples) < p.min_samples:
            # Exponential prior F(τ) = 1 − exp(−τ/μ): the optimum of F·V − τ is μ·ln(V/μ) when V > μ.
            mu = p.prior_mean_s
            return mu * math.log(value_s / mu) if value_s > mu else 0.0
        best_tau, best = 0.0, 0.0
        n = len(samples)
        for i, tau in enumerate(sorted(samples)):
            gain = (i + 1) / n * value_s - tau
            if gain > best:
                best_tau, best = tau, gain
        return best_tau

    def reload_s(self, context_tokens: int) -> float:
        """What losing the job's KV costs when its next turn arrives: recomputing the context."""
        assert self.ctx is not None  # attached before the engine runs
        return self.ctx.estimate_prefill_s(context_tokens)

    # --- reporting ----------------------------------------------------------------------------
    def num_pinned_blocks(self) -> int:
        return self._num_pinned_blocks

    def params(self) -> dict:
        from dataclasses import asdict

        return asdict(self.p)

    def stats(self) -> dict:
        ttl = sorted(self.ttl_chosen_s)
        return {
            "num_pins": self.num_pins, "num_pin_hits": self.num_pin_hits, "num_pin_expired": self.num_pin_expired,
            "num_pin_released_pressure": self.num_pin_released_pressure,
            "ttl_median_s": ttl[len(ttl) // 2] if ttl else None,
        }
