"""The KV-policy interface: hooks the engine calls, and the waiting-queue orders they choose.

A policy never sees the engine: it is attached to a :class:`PolicyContext`, the four things of
the engine a policy may use (its sizes, pushing a timed event, freeing blocks it held, and the
estimated time to recompute a context), and the engine calls its hooks.
"""
from __future__ import annotations

import heapq
from abc import ABC
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from scheduling.engine.engine_config import EngineConfig
    from scheduling.engine.request import JobState, Request


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may use of the engine that runs it.

    Args:
        config: the engine's sizes (block size and bytes, host link, KV bytes per token, ...).
        push: ``push(event_cls, time_s, *payload)`` schedules one of the engine's events.
        free_blocks: drop one reference on each of blocks the policy held (last block first).
        estimate_prefill_s: seconds to recompute a context of so many tokens alone.
    """

    config: EngineConfig
    push: Callable[..., None]
    free_blocks: Callable[[list[int]], None]
    estimate_prefill_s: Callable[[int], float]


def check_params(policy: str, params, *, positive=(), non_negative=(), counts=(), optional_positive=()) -> None:
    """Refuse (ConfigError, one line) a policy parameter that is not a number in its range: NaN,
    infinities, negatives and zeros are user errors, never silently used."""
    import math

    from common.errors import ConfigError

    def bad(name, value, want):
        raise ConfigError(f"{policy} {name} must be {want}, got {value!r}")

    for name in positive + non_negative + optional_positive:
        value = getattr(params, name)
        if value is None and name in optional_positive:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            bad(name, value, "a number")
        if name in positive and not (value > 0 and math.isfinite(value)):
            bad(name, value, "a finite number > 0")
        if name in non_negative and not (value >= 0 and math.isfinite(value)):
            bad(name, value, "a finite number >= 0")
        if name in optional_positive and not value > 0:
            bad(name, value, "> 0")
    for name in counts:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
            bad(name, value, "a whole number")
        if value < 1:
            bad(name, value, "a whole number >= 1")


@dataclass(frozen=True)
class ExternalLoad:
    """How long a connector takes to bring external tokens to the GPU.

    With ``KVPolicy.asynchronous_load`` the request waits ``load_s`` while other requests run
    (vLLM's asynchronous KV load); otherwise ``load_s`` is added to the step that admits it.
    """

    load_s: float


class KVSource(Protocol):
    """Where an engine finds tokens beyond its GPU prefix hit: its KV policy's pool or store (the
    methods of :class:`KVPolicy`), or, on a decode instance of a disaggregated pair, the prefill
    instance's KV (scheduling.cluster.pd)."""

    asynchronous_load: bool

    def external_hit(self, req: "Request", gpu_hit_tokens: int, max_tokens: int) -> int: ...

    def load_external(self, req: "Request", gpu_hit_tokens: int, num_tokens: int, now_s: float) -> ExternalLoad: ...


class RequestQueue(ABC):
    """Waiting requests in the order the policy serves them."""

    def add(self, req: "Request") -> None:
        raise NotImplementedError

    def prepend(self, req: "Request") -> None:
        """A preempted (or just loaded) request goes back ahead of new arrivals."""
        raise NotImplementedError

    def peek(self) -> "Request":
        raise NotImplementedError

    def pop(self) -> "Request":
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator["Request"]:
        raise NotImplementedError


class FCFSQueue(RequestQueue):
    """vLLM's FCFS waiting queue: a deque, arrivals at the back, preempted requests at the front."""

    def __init__(self) -> None:
        self._q: deque = deque()

    def add(self, req: "Request") -> None:
        self._q.append(req)

    def prepend(self, req: "Request") -> None:
        self._q.appendleft(req)

    def peek(self) -> "Request":
        return self._q[0]

    def pop(self) -> "Request":
        return self._q.popleft()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue(RequestQueue):
    """A heap on ``req.queue_key`` (set by the policy before ``add``); ties by request sequence."""

    def __init__(self) -> None:
        self._h: list = []

    def add(self, req: "Request") -> None:
        heapq.heappush(self._h, (req.queue_key, req.seq, req))

    prepend = add

    def peek(self) -> "Request":
        return self._h[0][2]

    def pop(self) -> "Request":
        return heapq.heappop(self._h)[2]

    def __len__(self) -> int:
        return len(self._h)

    def __iter__(self):
        return (e[2] for e in sorted(self._h))


class KVPolicy(ABC):
    """Base policy = vLLM's default behaviour; subclasses override the hooks they change.

    Hooks: ``on_arrival``, ``before_admission``, ``on_admitted``, ``on_turn_finish`` (free or keep blocks),
    ``external_hit`` (a connector lookup), ``on_prefill_complete`` (a synchronous store),
    ``make_queue`` (queue order), ``preemption_victim``, ``relieve_pressure`` (eviction choice
    beyond the LRU free queue, e.g. releasing a pin), ``on_pin_deadline`` (a pin's deadline, an
    event the policy asked for with the engine's ``PinExpiryEvent``).
    """

    name = "base"
    asynchronous_load = False  # see ExternalLoad

    def __init__(self) -> None:
        self.ctx: PolicyContext | None = None

    def attach(self, ctx: PolicyContext) -> None:
        """Called once by the engine before it runs (a policy serves one run)."""
        self.ctx = ctx

    def make_queue(self) -> RequestQueue:
        return FCFSQueue()

    def on_arrival(self, req: "Request", now_s: float) -> None:
        """Before the request joins the waiting queue (a policy may set ``req.queue_key``)."""

    def before_admission(self, now_s: float) -> None:
        """The engine is about to admit from the waiting queue (a policy may re-rank it)."""

    def on_admitted(self, req: "Request", now_s: float) -> None:
        """After the request took its prefix-hit blocks and joined the running batch."""

    def on_turn_finish(self, req: "Request", now_s: float) -> bool:
        """A turn generated its last token. Return True to let the engine free its blocks."""
        return True

    def on_job_arrival_gap(self, req: "Request", now_s: float) -> None:
        """Turn k+1 of a job arrived: the previous turn's tool time is now observable."""

    def external_hit(self, req: "Request", gpu_hit_tokens: int, max_tokens: int) -> int:
        """Tokens a connector can supply beyond the GPU hit, a whole number of blocks with
        ``gpu_hit_tokens + result <= max_tokens``. Pure: no state changes (admission may still fail)."""
        return 0

    def load_external(self, req: "Request", gpu_hit_tokens: int, num_tokens: int, now_s: float) -> ExternalLoad:
        """Admission succeeded: start loading ``num_tokens`` found by :meth:`external_hit`."""
        raise NotImplementedError(f"{self.name} reported an external hit but cannot load it")

    def on_prefill_complete(self, req: "Request", num_computed: int) -> float:
        """The request's prompt is fully computed this step; return seconds added to the step."""
        return 0.0

    def preemption_victim(self, running: list["Request"]) -> "Request":
        """FCFS: the last running request (the most recently admitted)."""
        return running[-1]

    def relieve_pressure(self, now_s: float, num_other_running: int) -> bool:
        """Blocks ran out; free something other than a running request. True if anything freed."""
        return False

    def holds_blocks(self, job_state: "JobState") -> bool:
        """Whether the policy keeps blocks of this job outside any request (a Continuum pin)."""
        return False

    def on_pin_deadline(self, job_state: "JobState", deadline_s: float) -> None:
        """A deadline this policy scheduled (``PinExpiryEvent``) passed; only pinning policies set one."""

    # --- what the step log and summary read -----------------------------------------------
    def num_pinned_blocks(self) -> int:
        return 0

    def pool_used_blocks(self) -> int:
        return 0

    def pool_total_blocks(self) -> int:
        return 0

    def params(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {}
