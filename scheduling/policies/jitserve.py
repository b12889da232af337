"""``jitserve``: SLO-aware queue order after JITServe (NSDI '26), adapted to a V1 engine.

JITServe serves a request "just in time": ahead of others when its SLO can still be met and
serving it now is worth the most per second of engine time, behind them when it has slack or is
lost anyway. Here, every time the engine admits waiting requests (at most every ``refresh_s`` of
simulated time) the waiting queue is ranked by

    priority = gain at the predicted finish / remaining service time

- remaining service time = the prefill of the turn's new tokens alone (the predictor's step cost,
  through the engine) + its expected output x the step time;
- gain = (new tokens + ``decode_weight`` x expected output tokens), discounted by
  min(1, target / predicted)^``exponent`` for TTFT (queueing so far + the prefill), for a turn that
  triggers a tool its latency (TTFT + the output), and for a streamed one its TPOT (JITServe's
  service gain, decode tokens 8x prefill, discount exponent 100: a request that will miss earns ~0);
- expected output = the largest output of the job's earlier turns (JITServe takes an upper bound
  from a quantile regression forest; the job's own history is the one this engine has), else the
  running mean over every finished turn, else ``prior_output_tokens``;
- the step time = the running mean of finished turns' time per output token (JITServe's running
  mean), else the predictor's one-token step.

The running request the ranking put last is preempted first (as ``sjf``/``las``). Blocks are freed as
under ``fcfs``. Left out of JITServe: binning the top requests by length and swapping running ones
out of the chosen bin, and the group priority of a compound call's members (an agent job runs one
turn at a time here, so its turns never compete with each other).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter

from scheduling.engine.request import Request
from scheduling.policies.base import RequestQueue, check_params
from scheduling.policies.ordering import QueueOrderPolicy


@dataclass(frozen=True)
class JITServeParams:
    """Args:
        ttft_s, tpot_s, tool_turn_s: the SLO it serves (scheduling.slo's kinds and defaults).
        decode_weight: a decode token's gain against a prefill token's (JITServe: 8).
        exponent: the discount's power (JITServe: 100).
        refresh_s: the waiting queue is re-ranked at most this often (simulated seconds).
        prior_output_tokens: expected output before any turn has finished.
    """

    ttft_s: float = 2.0
    tpot_s: float = 0.1
    tool_turn_s: float = 10.0
    decode_weight: float = 8.0
    exponent: float = 100.0
    refresh_s: float = 0.05
    prior_output_tokens: int = 256

    def __post_init__(self) -> None:
        check_params("jitserve", self, positive=("ttft_s", "tpot_s", "tool_turn_s", "decode_weight", "exponent"),
                     non_negative=("refresh_s",), counts=("prior_output_tokens",))


class RankedQueue(RequestQueue):
    """Waiting requests in the order of the policy's last ranking; a request added since goes where
    its key at arrival puts it."""

    def __init__(self) -> None:
        self.items: list[Request] = []

    def add(self, req: Request) -> None:
        items, key = self.items, req.queue_key
        lo, hi = 0, len(items)
        while lo < hi:  # bisect on the keys as they stand
            mid = (lo + hi) // 2
            if items[mid].queue_key <= key:
                lo = mid + 1
            else:
                hi = mid
        items.insert(lo, req)

    prepend = add

    def peek(self) -> Request:
        return self.items[0]

    def pop(self) -> Request:
        return self.items.pop(0)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(list(self.items))


_QUEUE_KEY = attrgetter("queue_key")


class JITServePolicy(QueueOrderPolicy):
    name = "jitserve"

    def __init__(self, params: JITServeParams | None = None) -> None:
        super().__init__()
        self.p = params or JITServeParams()
        self.queue: RankedQueue | None = None
        self._ranked_at = -math.inf
        self._job_max: dict[int, int] = {}
        self._out_sum = self._out_count = 0
        self._tpot_sum, self._tpot_count = 0.0, 0
        self.num_rankings = 0
        self._facts: dict[int, tuple[int, float | None, bool]] = {}  # request seq -> _turn_facts
        self._rank_facts: dict[int, tuple] = {}  # request seq -> _ranking_facts

    def make_queue(self) -> RequestQueue:
        self.queue = RankedQueue()
        return self.queue

    # --- estimates ------------------------------------------------------------------------------
    def expected_output(self, req: Request) -> float:
        j = req.job_state.index
        if j in self._job_max:
            return float(self._job_max[j])
        return self._out_sum / self._out_count if self._out_count else float(self.p.prior_output_tokens)

    def step_s(self) -> float:
        if self._tpot_count:
            return self._tpot_sum / self._tpot_count
        return self.ctx.estimate_prefill_s(1) if self.ctx else 0.01

    def _turn_facts(self, req: Request) -> tuple[int, float | None, bool]:
        """(new tokens, their prefill time or None without an engine, whether the turn triggers a
        tool): fixed for a request, so kept from its first ranking on (a ranking asks them of every
        waiting request)."""
        facts = self._facts.get(req.seq)
        if facts is None:
            job = req.job_state.job
            new = job.turns[req.turn].input_tokens + (job.system_tokens if req.turn == 0 else 0)
            prefill_s = self.ctx.estimate_prefill_s(max(int(new), 1)) if self.ctx else None
            facts = self._facts[req.seq] = (new, prefill_s, req.turn < job.num_turns - 1)
        return facts

    def _ranking_facts(self, req: Request) -> tuple:
        """``_turn_facts`` and what the ranking keys a request by besides its rate (job index, the
        job's arrival, turn, the turn's arrival): kept as one tuple for the ranking loop."""
        js = req.job_state
        facts = self._rank_facts[req.seq] = (*self._turn_facts(req), js.index, js.job.arrival_s, req.turn,
                                             req.arrival_s)
        return facts

    def priority(self, req: Request, now_s: float, step: float | None = None) -> float:
        """Gain at the predicted finish per second of service (module docstring); ``step``: the step
        time, when the caller ranks many requests at one moment."""
        step = self.step_s() if step is None else step
        new, prefill_s, has_tool = self._turn_facts(req)
        return self._gain_rate(new, step if prefill_s is None else prefill_s, has_tool, self.expected_output(req),
                               now_s - req.arrival_s, step)

    def _gain_rate(self, new: int, prefill_s: float, has_tool: bool, out: float, waited_s: float, step: float) -> float:
        p = self.p
        ttft = waited_s + prefill_s
        service = prefill_s + out * step
        discount = min(1.0, p.ttft_s / ttft) ** p.exponent if ttft > 0 else 1.0
        if has_tool:  # a tool waits for its last token
            latency = ttft + out * step
            discount *= min(1.0, p.tool_turn_s / latency) ** p.exponent if latency > 0 else 1.0
        elif out > 1:
            discount *= min(1.0, p.tpot_s / step) ** p.exponent if step > 0 else 1.0
        return (new + p.decode_weight * out) * discount / max(service, 1e-9)

    def _key(self, req: Request, now_s: float, step: float | None = None) -> tuple:
        return (-self.priority(req, now_s, step), req.job_state.job.arrival_s, req.job_state.index, req.turn)

    # --- hooks ----------------------------------------------------------------------------------
    def on_arrival(self, req: Request, now_s: float) -> None:
        req.queue_key = self._key(req, now_s)

    def before_admission(self, now_s: float) -> None:
        q = self.queue
        if q is None or len(q) < 2 or now_s - self._ranked_at < self.p.refresh_s:
            return
        # NOTE(perf): _gain_rate's arithmetic, inlined, for every waiting request, with what is the
        # same for all of them taken once (it runs at nearly every step where turns queue). Keep
        # the two in step: tests/scheduling/test_order_policies.py checks that they rank alike.
        p = self.p
        step = self.step_s()
        mean_out = self._out_sum / self._out_count if self._out_count else float(p.prior_output_tokens)
        ttft_s, tool_turn_s, exponent, decode_weight = p.ttft_s, p.tool_turn_s, p.exponent, p.decode_weight
        tpot_discount = min(1.0, p.tpot_s / step) ** exponent if step > 0 else 1.0
        job_max, keys_of, rank_facts = self._job_max, self._rank_facts, self._ranking_facts
        for r in q.items:
            new, prefill_s, has_tool, j, job_arrival_s, turn, arrival_s = keys_of.get(r.seq) or rank_facts(r)
            if prefill_s is None:
                prefill_s = step
            out = job_max.get(j, mean_out)
            ttft = now_s - arrival_s + prefill_s
            discount = 1.0 if ttft <= ttft_s else (ttft_s / ttft) ** exponent  # min(1, target/ttft)^exponent
            if has_tool:
                latency = ttft + out * step
                if latency > tool_turn_s:
                    discount *= (tool_turn_s / latency) ** exponent
            elif out > 1:
                discount *= tpot_discount
            service = prefill_s + out * step
            rate = (new + decode_weight * out) * discount / (service if service > 1e-9 else 1e-9)
            r.queue_key = (-rate, job_arrival_s, j, turn)
        # a job has one turn waiting at a time, so (job, turn) in the key leaves no ties for seq to break
        q.items.sort(key=_QUEUE_KEY)
        self._ranked_at = now_s
        self.num_rankings += 1

    def on_turn_finish(self, req: Request, now_s: float) -> bool:
        self._facts.pop(req.seq, None)
        self._rank_facts.pop(req.seq, None)
        j = req.job_state.index
        self._job_max[j] = max(self._job_max.get(j, 0), req.output_tokens)
        self._out_sum += req.output_tokens
        self._out_count += 1
        if req.output_tokens > 1 and req.first_token_s is not None:
            self._tpot_sum += (now_s - req.first_token_s) / (req.output_tokens - 1)
            self._tpot_count += 1
        return True

    def params(self) -> dict:
        return {k: getattr(self.p, k) for k in JITServeParams.__dataclass_fields__}

    def stats(self) -> dict:
        return {"num_rankings": self.num_rankings}
