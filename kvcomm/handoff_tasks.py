"""Hand-off tasks a 135M model answers well as text: one or two senders, three templates, no answer prefix.

Every earlier task (``kvcomm.tasks``) leaves SmolLM2-135M-Instruct at 0.6-0.7 exact match as text, and
ends B's prompt with an answer prefix ("The code for the red box is"), which turns the answer into a
copy of a continuation. Here B's prompt ends with the assistant header and B writes its own reply.

What the 135M model can and cannot do without a prefix was measured first (design seed 100, 30
examples per variant, text only; docs/kvcomm-eval.md): asked one of two or three entries *of the same
kind* ("Which city does Greta Brandt travel to?" among three travellers), it restates the first entry
whatever the question, and lands at chance (0.40-0.60 over templates and layouts). It does answer a
question about one entity whose facts are *of different kinds* (a city, a day, a hotel). So:

- **One entity, three facts of different kinds** (a traveller's city, day and hotel; a parcel's room,
  day and courier; a meeting's day, host and room). B is asked one of them.
- **Scoring (``choice``):** the reply is right when, of every value of the asked kind (all 20 cities,
  all 5 weekdays, ...), the first one it names is the gold one. "Oslo.", "Greta Brandt flies to Oslo
  on Tuesday." and "She flies to Oslo." all score right for "Oslo"; a reply naming another city first,
  or none, is wrong. Chance, guessing a value of the asked kind, is 1/5 at most (the weekdays);
  ``TASK_CHANCE`` uses that bound.
- **Drift.** Each sender first reads a tool output (a change log: its message starts 230-370 SmolLM2
  tokens later in its own chat than in B's prompt, median ~330 with one sender, ~270 with two; in which
  about half the facts were first set to another value, then changed) in its own chat and under its
  own system prompt, then writes its notes; B needs the notes near the top of its own prompt. The
  superseded values are in what the exported K/V attended to.
- **Templates:** ``TEMPLATES`` (travel, parcels, meetings), each with its own sender role, log and
  phrasing. Example i draws its template from its own seeded generator; ``Example.template`` names it,
  so results split by template.

``handoff``: one sender (A) states all three facts. ``handoff2``: two senders, each reading its own
log: A states the first two facts, C the third (the travel desk and the hotel desk); the question is
about any of the three, so one time in three the answer sits in the second imported chunk.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvcomm.agent_tasks import CITIES, FIRST_NAMES, LAST_NAMES
from kvcomm.example import AgentMessage, Example

ANSWER_TOKENS = 24  # B often restates the question before the value ("Greta Brandt flies to Oslo on ...")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
HOTELS = tuple(f"Hotel {h}" for h in ("Astoria", "Bellevue", "Central", "Excelsior", "Metropole", "Regina",
                                      "Savoy", "Victoria"))
ROOMS = tuple(f"Room {r}" for r in (12, 27, 31, 45, 58, 63, 74, 86, 90))
COURIERS = ("DHL", "UPS", "FedEx", "GLS", "DPD", "TNT")
ITEMS = ("laptop", "printer", "camera", "projector", "monitor", "router", "scanner", "tablet", "speaker")
MEETINGS = ("design review", "budget meeting", "safety briefing", "sales call", "hiring panel", "board update",
            "code review")


@dataclass(frozen=True)
class Fact:
    """One kind of fact about the entity: its values, how the notes and the log state it, the question."""

    values: tuple[str, ...]
    note: str  # "{k} flies to {v}"; joined by the template's ``joiner``
    log_set: str
    log_change: str
    question: str


@dataclass(frozen=True)
class Template:
    """A hand-off scenario: who the senders are, what their logs look like, the entity and its three facts."""

    name: str
    roles: tuple[str, str]  # the first sender's role (facts 0 and 1), the second's (fact 2)
    log_titles: tuple[str, str]
    keys: tuple[str, ...]
    facts: tuple[Fact, Fact, Fact]
    routine: tuple[str, ...]


def _people() -> tuple[str, ...]:
    return tuple(f"{f} {s}" for f in FIRST_NAMES for s in LAST_NAMES)


TEMPLATES = (
    Template(
        name="travel", roles=("the travel desk", "the hotel desk"),
        log_titles=("BOOKING SYSTEM CHANGE LOG", "HOTEL RESERVATIONS LOG"), keys=_people(),
        facts=(Fact(CITIES, "{k} flies to {v}", "flight for {k} booked to {v}",
                    "flight for {k} rebooked from {old} to {v}", "Which city does {k} fly to?"),
               Fact(WEEKDAYS, "{k} leaves on {v}", "departure of {k} set for {v}",
                    "departure of {k} moved from {old} to {v}", "On which day does {k} leave?"),
               Fact(HOTELS, "{k} stays at the {v}", "room for {k} reserved at the {v}",
                    "reservation of {k} moved from the {old} to the {v}", "Which hotel does {k} stay at?")),
        routine=("hotel voucher sent to {p}", "seat request from {p} noted", "invoice {n} paid",
                 "visa letter for {p} issued", "train leg for {p} added", "expense claim {n} filed")),
    Template(
        name="parcels", roles=("the mail room", "the courier desk"),
        log_titles=("PARCEL TRACKING LOG", "COURIER PICKUP LOG"), keys=tuple(f"the {i}" for i in ITEMS),
        facts=(Fact(ROOMS, "{K} goes to {v}", "{k} registered for {v}", "{k} redirected from {old} to {v}",
                    "Which room does {k} go to?"),
               Fact(WEEKDAYS, "{K} arrives on {v}", "delivery of {k} planned for {v}",
                    "delivery of {k} moved from {old} to {v}", "On which day does {k} arrive?"),
               Fact(COURIERS, "{K} ships with {v}", "{k} assigned to {v}", "{k} reassigned from {old} to {v}",
                    "Which courier does {k} ship with?")),
        routine=("courier arrived, {n} parcels scanned", "letter for {p} sorted", "pallet {n} unloaded",
                 "signature from {p} collected", "return label {n} printed", "shelf check done by {p}")),
    Template(
        name="meetings", roles=("the office manager", "the facilities desk"),
        log_titles=("CALENDAR CHANGE LOG", "ROOM BOOKING LOG"), keys=tuple(f"the {m}" for m in MEETINGS),
        facts=(Fact(WEEKDAYS, "{K} is on {v}", "{k} scheduled for {v}", "{k} moved from {old} to {v}",
                    "On which day is {k}?"),
               Fact(_people(), "{K} is hosted by {v}", "{k} host set to {v}", "{k} host changed from {old} to {v}",
                    "Who hosts {k}?"),
               Fact(ROOMS, "{K} takes place in {v}", "{k} booked in {v}", "{k} moved from {old} to {v}",
                    "In which room does {k} take place?")),
        routine=("room booking {n} confirmed", "{p} declined an invitation", "catering order {n} placed",
                 "{p} asked for a projector", "reminder sent by {p}", "visitor pass {n} issued")),
)

SENDER_SYSTEM = ("You are agent {agent}, {role}. You read the system's logs and keep the other agents up to date "
                 "with short notes.")
SENDER_INSTRUCTION = ("Here is the {title}.\n\n{log}\n\nWrite a short note for the other agents with the final "
                      "value of every entry that appears in the log.")
NOTES_HEADER = "Notes from agent {agent}:\n"
NUM_ROUTINE = 14  # routine log lines per sender: what puts hundreds of tokens before the message


def _log(rng: random.Random, template: Template, title: str, key: str,
         facts: list[tuple[Fact, str]]) -> str:
    """A change log that ends with ``facts``' values for ``key``; about half were first set to another value."""
    people = [f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}" for _ in range(5)]
    lines = [rng.choice(template.routine).format(p=rng.choice(people), n=rng.randint(100, 999))
             for _ in range(NUM_ROUTINE)]
    for fact, value in facts:
        slot = rng.randrange(0, NUM_ROUTINE // 2)
        if rng.random() < 0.5:
            old = rng.choice([v for v in fact.values if v != value])
            lines.insert(slot, fact.log_set.format(k=key, v=old))
            lines.insert(rng.randrange(slot + 1, len(lines) + 1), fact.log_change.format(k=key, old=old, v=value))
        else:
            lines.insert(slot, fact.log_set.format(k=key, v=value))
    minute = rng.randint(8 * 60, 9 * 60)
    stamped = []
    for line in lines:
        minute += rng.randint(2, 25)
        stamped.append(f"{minute // 60:02d}:{minute % 60:02d} | {line}")
    return f"{title}\n" + "\n".join(stamped)


def _note(key: str, facts: list[tuple[Fact, str]]) -> str:
    capital = key[0].upper() + key[1:]
    return " ".join(f.note.format(k=key, K=capital, v=v) + "." for f, v in facts)


def _message(rng: random.Random, template: Template, sender: int, agent: str, key: str,
             facts: list[tuple[Fact, str]]) -> AgentMessage:
    title = template.log_titles[sender]
    return AgentMessage(agent=agent, system_prompt=SENDER_SYSTEM.format(agent=agent, role=template.roles[sender]),
                        instruction=SENDER_INSTRUCTION.format(title=title,
                                                              log=_log(rng, template, title, key, facts)),
                        text=_note(key, facts))


def _draw(rng: random.Random) -> tuple[Template, str, list[tuple[Fact, str]], int]:
    template = TEMPLATES[rng.randrange(len(TEMPLATES))]
    key = rng.choice(template.keys)
    facts = [(f, rng.choice(f.values)) for f in template.facts]
    return template, key, facts, rng.randrange(len(facts))


def _example(task: str, index: int, template: Template, key: str, messages: tuple[AgentMessage, ...],
             facts: list[tuple[Fact, str]], asked: int) -> Example:
    fact, value = facts[asked]
    return Example(task=task, index=index, messages=messages, question=fact.question.format(k=key), answer=value,
                   notes_header=NOTES_HEADER, scoring="choice", answer_tokens=ANSWER_TOKENS,
                   candidates=fact.values, template=template.name)


def handoff(rng: random.Random, index: int) -> Example:
    """One sender read a change log and states the entity's three facts; B is asked one."""
    template, key, facts, asked = _draw(rng)
    return _example("handoff", index, template, key, (_message(rng, template, 0, "A", key, facts),), facts, asked)


def handoff2(rng: random.Random, index: int) -> Example:
    """A states the first two facts, C (another desk, its own log) the third; B is asked one of the three."""
    template, key, facts, asked = _draw(rng)
    messages = (_message(rng, template, 0, "A", key, facts[:2]), _message(rng, template, 1, "C", key, facts[2:]))
    return _example("handoff2", index, template, key, messages, facts, asked)
