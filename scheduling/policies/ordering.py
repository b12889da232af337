"""Queue-order baselines for agent jobs: ``sjf`` (shortest estimated turn first), ``srtf`` (shortest
estimated remaining output first) and ``las`` (least attained service of the job first, Autellix's
program-level LAS).

None of them changes what happens to blocks: a finished turn frees them as under ``fcfs``. Each sets
a request's priority when it arrives, serves the waiting queue in that order, and preempts the running
request the order puts last, as vLLM V1's ``priority`` scheduling policy does with a request's
``priority`` (its victim is the running request with the largest (priority, arrival)). Under ``sjf``
and ``las`` a request's priority is fixed at its arrival, as there; ``srtf`` re-keys the running
requests when it picks a victim.

- ``sjf``: the turn whose output is expected to be shortest first. Its length is not known when it
  arrives, so it is estimated: the mean output of the job's earlier turns, else the running mean
  over every finished turn, else ``prior_output_tokens``. ``oracle=true`` takes the trace's true
  length instead: an upper bound on what any length estimate can give, never a policy a server has.
- ``srtf``: shortest remaining time first, on the same estimate: a turn's remaining output is the
  estimate less what it has generated (at least one token: a turn past its estimate is taken to end
  next). A waiting turn that has generated nothing is keyed as under ``sjf``; what differs is
  preemption, where the remaining output is what counts: the victim is the running turn with the
  most left (``sjf`` takes the one with the longest estimate, however far along it is), and a
  preempted turn waits keyed by what it had left. vLLM's ``priority`` policy fixes a request's
  priority when it is added, so the real engine cannot say this.
- ``las``: the turn of the job that has received the least service first, service counted as the
  tokens the engine scheduled for the job's earlier turns (prompt, output and recomputation), in
  quanta of ``quantum_tokens`` (Autellix discretizes attained service into queues; within one
  quantum, jobs are served by arrival). A job's first turn has attained nothing, so new jobs go
  ahead of long-running ones: what LAS is for, the starvation of long jobs what it costs.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduling.engine.request import Request
from scheduling.policies.base import KVPolicy, PriorityQueue, RequestQueue, check_params


@dataclass(frozen=True)
class SJFParams:
    """Args:
        prior_output_tokens: the estimate before any turn has finished.
        oracle: use the trace's true output length (an upper bound, not a deployable policy).
    """

    prior_output_tokens: int = 256
    oracle: bool = False

    def __post_init__(self) -> None:
        check_params(self.policy, self, counts=("prior_output_tokens",))
        if not isinstance(self.oracle, bool):
            from common.errors import ConfigError

            raise ConfigError(f"{self.policy} oracle must be true or false, got {self.oracle!r}")

    @property
    def policy(self) -> str:
        return "sjf"


@dataclass(frozen=True)
class SRTFParams(SJFParams):
    """``sjf``'s: the same estimate, before and as the turn generates."""

    @property
    def policy(self) -> str:
        return "srtf"


@dataclass(frozen=True)
class LASParams:
    """Args:
        quantum_tokens: tokens of attained service per priority level (jobs within one level are
            served by arrival).
    """

    quantum_tokens: int = 400

    def __post_init__(self) -> None:
        check_params("las", self, counts=("quantum_tokens",))


class QueueOrderPolicy(KVPolicy):
    """A priority set at arrival orders the waiting queue; the running request it puts last is the victim."""

    def make_queue(self) -> RequestQueue:
        return PriorityQueue()

    def preemption_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.queue_key, r.run_pos))


class SJFPolicy(QueueOrderPolicy):
    name = "sjf"

    def __init__(self, params: SJFParams | None = None) -> None:
        super().__init__()
        self.p = params or SJFParams()
        self._job_sum: dict[int, int] = {}  # job index -> output tokens of its finished turns
        self._job_count: dict[int, int] = {}
        self._all_sum = self._all_count = 0

    def estimate(self, req: Request) -> float:
        """Expected output tokens of ``req`` (its true length with ``oracle``)."""
        if self.p.oracle:
            return float(req.output_tokens)
        j = req.job_state.index
        if self._job_count.get(j):
            return self._job_sum[j] / self._job_count[j]
        if self._all_count:
            return self._all_sum / self._all_count
        return float(self.p.prior_output_tokens)

    def on_arrival(self, req: Request, now_s: float) -> None:
        req.queue_key = (self.estimate(req), req.job_state.job.arrival_s, req.job_state.index, req.turn)

    def on_turn_finish(self, req: Request, now_s: float) -> bool:
        j = req.job_state.index
        # the turn has generated all of its output now: its length is observed, not foreseen
        self._job_sum[j] = self._job_sum.get(j, 0) + req.output_tokens
        self._job_count[j] = self._job_count.get(j, 0) + 1
        self._all_sum += req.output_tokens
        self._all_count += 1
        return True

    def params(self) -> dict:
        return {"prior_output_tokens": self.p.prior_output_tokens, "oracle": self.p.oracle}


class SRTFPolicy(SJFPolicy):
    name = "srtf"

    def __init__(self, params: SRTFParams | None = None) -> None:
        super().__init__(params or SRTFParams())

    def remaining(self, req: Request) -> float:
        """Output tokens ``req`` is expected still to generate: its estimate less what it has, at least 1."""
        return max(self.estimate(req) - req.num_output, 1.0)

    def _key(self, req: Request) -> tuple:
        return (self.remaining(req), req.job_state.job.arrival_s, req.job_state.index, req.turn)

    def on_arrival(self, req: Request, now_s: float) -> None:
        req.queue_key = self._key(req)

    def preemption_victim(self, running: list[Request]) -> Request:
        # keyed now, by what each has left; the victim waits keyed by that (the engine queues it next)
        for r in running:
            r.queue_key = self._key(r)
        return max(running, key=lambda r: (r.queue_key, r.run_pos))


class LASPolicy(QueueOrderPolicy):
    name = "las"

    def __init__(self, params: LASParams | None = None) -> None:
        super().__init__()
        self.p = params or LASParams()
        self._attained: dict[int, int] = {}  # job index -> tokens scheduled for its finished turns

    def level(self, req: Request) -> int:
        """The priority level of ``req``'s job: its attained service in whole quanta."""
        return self._attained.get(req.job_state.index, 0) // self.p.quantum_tokens

    def on_arrival(self, req: Request, now_s: float) -> None:
        req.queue_key = (self.level(req), req.job_state.job.arrival_s, req.job_state.index, req.turn)

    def on_turn_finish(self, req: Request, now_s: float) -> bool:
        j = req.job_state.index
        scheduled = req.num_recomputed_tokens + req.num_admission_tokens  # as the turn record counts it
        self._attained[j] = self._attained.get(j, 0) + scheduled
        return True

    def params(self) -> dict:
        return {"quantum_tokens": self.p.quantum_tokens}
