"""The events of the replay engine (``scheduling.engine.loop``) and their order at one instant.

Events are frozen dataclasses kept in the engine's ``heapq`` as ``(time_s, priority, seq, event)``;
``seq`` comes from the engine's own ``itertools.count()``, so ties are broken first by kind
(:class:`EventPriority`) and then by creation order. ``handle(engine)`` changes the engine's state
through its ``on_*`` methods and pushes what it causes itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, ClassVar

from scheduling.engine.request import JobState, Request

if TYPE_CHECKING:
    from scheduling.engine.loop import Engine


class EventPriority(IntEnum):
    """Order of events at the same instant: finish the step, then loads, arrivals, pin expiries;
    scheduling last so that every arrival of an instant can join the step it triggers."""

    STEP_END = 0
    LOAD_DONE = 1
    ARRIVAL = 2
    PIN_EXPIRY = 3
    SCHEDULE = 4


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happens at ``time_s``. The contract: ``handle`` changes the engine's state and
    puts any event it causes on the heap itself (``Engine.push``, or ``Engine.wake`` for a
    scheduling pass); it returns nothing."""

    time_s: float
    seq: int
    priority: ClassVar[int] = EventPriority.SCHEDULE

    def handle(self, engine: "Engine") -> None:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ArrivalEvent(Event):
    """Turn ``turn`` of a job arrives (the job's arrival, or the previous turn's finish + tool gap)."""

    job_state: JobState
    turn: int
    priority: ClassVar[int] = EventPriority.ARRIVAL

    def handle(self, engine: "Engine") -> None:
        engine.on_arrival(self.job_state, self.turn, self.time_s)


@dataclass(frozen=True, slots=True)
class LoadDoneEvent(Event):
    """An asynchronous connector load finished: the request may continue its prefill."""

    request: Request
    num_computed: int
    priority: ClassVar[int] = EventPriority.LOAD_DONE

    def handle(self, engine: "Engine") -> None:
        engine.on_load_done(self.request, self.num_computed, self.time_s)


@dataclass(frozen=True, slots=True)
class BlocksReleaseEvent(Event):
    """Blocks a policy held past their request's finish (a KV store still copying them out, as a
    vLLM connector delays freeing) go back to the pool."""

    blocks: list
    priority: ClassVar[int] = EventPriority.LOAD_DONE

    def handle(self, engine: "Engine") -> None:
        engine.pool.free_blocks(self.blocks, True)
        engine.wake(self.time_s)


@dataclass(frozen=True, slots=True)
class PinExpiryEvent(Event):
    """A Continuum pin's deadline."""

    job_state: JobState
    priority: ClassVar[int] = EventPriority.PIN_EXPIRY

    def handle(self, engine: "Engine") -> None:
        engine.policy.on_pin_deadline(self.job_state, self.time_s)
        engine.wake(self.time_s)


@dataclass(frozen=True, slots=True)
class ScheduleEvent(Event):
    priority: ClassVar[int] = EventPriority.SCHEDULE

    def handle(self, engine: "Engine") -> None:
        engine.schedule_pending = False
        engine.try_step(self.time_s)
