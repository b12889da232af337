"""Seeded multi-agent tasks with known answers, and their scoring.

An ``Example`` is one exchange: one or more sender agents (A, C, ...) each wrote a ``message`` in their
own chat (their own system prompt and instruction); receiver B gets those messages and must answer a
``question`` whose ``answer`` is a fact from them. How B receives the messages (text or KV) is the
protocol's business (``kvcomm.protocols``); this module only makes the content and scores answers.

Tasks (chosen so that SmolLM2-135M-Instruct answers well above chance when B reads the text; see
docs/kvcomm-eval.md for the measured text accuracy):

- ``keycode``: agent A's notes list ``NUM_FACTS`` (4) facts "The code for the red box is 4821."; B is
  asked the code of one item. Chance (picking one of the listed codes) is 1/4; an exact 4-digit
  string by luck is ~1e-4.
- ``twoagent``: two senders A and C each send ``NUM_ROOMS_PER_SENDER`` (3) facts "Alice's room number
  is 412."; B is asked one person's number, which is in either sender's notes, so B must read across
  two imported chunks (what CacheBlend is built for). Chance: 1/6.

Agent-like tasks (their sender contexts come from ``kvcomm.agent_tasks``): in ``keycode`` the message
sits 7 tokens from where B needs it and every seam falls on a newline, which no protocol can fail;
these two tasks remove both crutches.

- ``drift``: agent A (a security clerk, its own system prompt) first reads a day's access log
  (~515 SmolLM2 tokens, with superseded codes in it) and then writes notes with the ``NUM_FACTS``
  current codes, so A's message starts ~550 tokens (457-671 over the first 200 examples) later in
  A's sequence than where B needs it (position 37). B's template
  puts the notes on the header's line ("Notes from agent A: The code ..."), so tokenizing B's prompt
  in one go would merge the space into the message's first token: the seam is not aligned. Question
  and answer as in ``keycode`` (chance 1/4).
- ``drift3``: three senders (A, C, D), clerks of three wings, each read their own wing's access log
  (8 lines with its 2 items' codes, some superseded) and write notes with their 2 current codes;
  B gets three imported chunks, each from a different sequence and each drifted by hundreds of
  tokens, and is asked one of the 6 codes (chance 1/6 picking among the listed codes).
- ``summary``: agent A (a duty officer) reads a building log with an incident in it (who reported
  what, where; who fixed it, how, and the state now) and writes a two-sentence summary; B is asked
  what happened and who fixed it, in one sentence (up to ``SUMMARY_ANSWER_TOKENS`` tokens), and is
  scored by ROUGE-L F1 against a one-sentence reference built from the same facts (text: mean 0.44
  on 8 examples; asked to "summarize the notes", the 135M model described them instead).
- ``multihop``: a random entity graph (``agent_tasks.entity_graph_question``); agent A reads one
  register (e.g. who works for which company), agent C another (which company is based in which city),
  each among distractor chains, and each sends its facts; B is asked a question that needs one fact
  from each ("In which city is the company that Alice Moreau works for based?"). Chance with one hop
  right: 1/3 (a city from C's notes).

- ``handoff``, ``handoff2`` (``kvcomm.handoff_tasks``): one entity's three facts of different kinds sent
  by one or two senders after a change log, three templates, **no answer prefix** (B writes its own
  reply, scored by the first value of the asked kind it names); the tasks the 135M model answers at
  >= 0.8 as text.

Every task is answered under every protocol; ``text`` is the baseline with the very same information
and template (B re-encodes the message tokens instead of importing them).

The sizes come from a first measurement of text accuracy on small samples (docs/kvcomm-eval.md has
the numbers): harder versions left the 135M model too little headroom above chance.

Every example is generated from ``random.Random(f"{task}:{seed}:{index}")``: example i does not depend
on how many examples are drawn, so a run with a larger ``n`` extends a smaller one and resume is exact.
"""
from __future__ import annotations

import random
from collections.abc import Callable

from common.errors import KVCommError, suggest
from kvcomm.agent_tasks import PLACES, access_log, document, entity_graph_question, person_name
from kvcomm.example import AgentMessage, Example
from kvcomm.handoff_tasks import handoff, handoff2

# Sender agents have their own system prompt (different from B's, on purpose: the imported message's
# positions and context differ between A's sequence and B's, which is what the protocols must handle).
SENDER_SYSTEM = "You are agent {agent}, a note-taking assistant. You read records and write short notes for other agents."
SENDER_INSTRUCTION = "Write the notes for the other agents."
RECEIVER_SYSTEM = "You are agent B. Answer the question using the notes from the other agents. Reply with the answer only."

COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple", "brown", "pink", "gray", "silver")
OBJECTS = ("box", "door", "key", "car", "bag", "cup", "lamp", "book", "chair", "desk", "phone", "clock")
NUM_FACTS = 4
NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack", "Kate", "Leo",
         "Mia", "Noah", "Olga", "Paul")
NUM_ROOMS_PER_SENDER = 3


def _code(rng: random.Random) -> str:
    return str(rng.randint(1000, 9999))


def _facts(rng: random.Random, num_facts: int) -> list[tuple[str, str]]:
    """``num_facts`` distinct (item, code) pairs with distinct codes."""
    items = rng.sample([f"{c} {o}" for c in COLORS for o in OBJECTS], num_facts)
    codes: list[str] = []
    while len(codes) < num_facts:
        code = _code(rng)
        if code not in codes:
            codes.append(code)
    return list(zip(items, codes))


def _notes(facts: list[tuple[str, str]]) -> str:
    return "\n".join(f"The code for the {item} is {code}." for item, code in facts)


def _sender(agent: str, text: str) -> AgentMessage:
    return AgentMessage(agent=agent, system_prompt=SENDER_SYSTEM.format(agent=agent),
                        instruction=SENDER_INSTRUCTION, text=text)


def keycode(rng: random.Random, index: int) -> Example:
    """A's notes hold NUM_FACTS item codes; B is asked one of them."""
    facts = _facts(rng, NUM_FACTS)
    item, code = facts[rng.randrange(len(facts))]
    return Example(task="keycode", index=index, messages=(_sender("A", _notes(facts)),),
                   question=f"What is the code for the {item}?", answer=code,
                   answer_prefix=f"The code for the {item} is")


def twoagent(rng: random.Random, index: int) -> Example:
    """A and C each send NUM_ROOMS_PER_SENDER people's room numbers; B is asked one, from either sender."""
    num_facts = 2 * NUM_ROOMS_PER_SENDER
    names = rng.sample(NAMES, num_facts)
    rooms = [str(r) for r in rng.sample(range(100, 1000), num_facts)]
    facts = list(zip(names, rooms))
    who, room = facts[rng.randrange(num_facts)]

    def notes(part: list[tuple[str, str]]) -> str:
        return "\n".join(f"{name}'s room number is {number}." for name, number in part)

    messages = (_sender("A", notes(facts[:NUM_ROOMS_PER_SENDER])), _sender("C", notes(facts[NUM_ROOMS_PER_SENDER:])))
    return Example(task="twoagent", index=index, messages=messages, question=f"What is {who}'s room number?",
                   answer=room, answer_prefix=f"{who}'s room number is")


DRIFT_SYSTEM = ("You are agent {agent}, the security clerk of the building. You read the access logs and keep "
                "the other agents up to date with short notes.")
DRIFT_INSTRUCTION = ("Here is today's access log.\n\n{log}\n\nWrite a short note for the other agents with the "
                     "current code of every storage item that appears in the log.")
# no newline after the colon: B reads the notes on the header's own line (see the module docstring)
DRIFT_NOTES_HEADER = "Notes from agent {agent}: "


def drift(rng: random.Random, index: int) -> Example:
    """A read a long access log before writing its notes (drift of hundreds of tokens, unaligned seam)."""
    facts = _facts(rng, NUM_FACTS)
    log = access_log(rng, facts)
    item, code = facts[rng.randrange(len(facts))]
    notes = "Current codes from today's log. " + " ".join(f"The code for the {i} is {c}." for i, c in facts)
    sender = AgentMessage(agent="A", system_prompt=DRIFT_SYSTEM.format(agent="A"),
                          instruction=DRIFT_INSTRUCTION.format(log=log), text=notes)
    return Example(task="drift", index=index, messages=(sender,), question=f"What is the code for the {item}?",
                   answer=code, answer_prefix=f"The code for the {item} is", notes_header=DRIFT_NOTES_HEADER)


DRIFT3_SENDERS = ("A", "C", "D")
DRIFT3_FACTS_PER_SENDER = 2


def drift3(rng: random.Random, index: int) -> Example:
    """Three clerks each read their own wing's access log and send its current codes; B is asked one."""
    facts = _facts(rng, DRIFT3_FACTS_PER_SENDER * len(DRIFT3_SENDERS))
    messages = []
    for i, agent in enumerate(DRIFT3_SENDERS):
        mine = facts[i * DRIFT3_FACTS_PER_SENDER:(i + 1) * DRIFT3_FACTS_PER_SENDER]
        notes = f"Current codes from the log of wing {agent}. " + " ".join(f"The code for the {it} is {c}." for it, c in mine)
        messages.append(AgentMessage(agent=agent, system_prompt=DRIFT_SYSTEM.format(agent=agent),
                                     instruction=DRIFT_INSTRUCTION.format(log=access_log(rng, mine, num_routine=6)),
                                     text=notes))
    item, code = facts[rng.randrange(len(facts))]
    return Example(task="drift3", index=index, messages=tuple(messages), question=f"What is the code for the {item}?",
                   answer=code, answer_prefix=f"The code for the {item} is", notes_header=DRIFT_NOTES_HEADER)


MULTIHOP_SYSTEM = ("You are agent {agent}, a research assistant. You read registers and pass the facts that "
                   "matter to the other agents.")
MULTIHOP_INSTRUCTION = "Read this register and list its facts for the other agents.\n\n{document}"


def multihop(rng: random.Random, index: int) -> Example:
    """A and C each read one register; B's question needs a fact from each (two hops)."""
    hop = entity_graph_question(rng)
    messages = []
    for agent, title, facts in (("A", "REGISTER 1", hop.document_1), ("C", "REGISTER 2", hop.document_2)):
        messages.append(AgentMessage(
            agent=agent, system_prompt=MULTIHOP_SYSTEM.format(agent=agent),
            instruction=MULTIHOP_INSTRUCTION.format(document=document(rng, title, facts)),
            text=" ".join(f.sentence for f in facts)))
    return Example(task="multihop", index=index, messages=tuple(messages), question=hop.question,
                   answer=hop.answer, answer_prefix=hop.answer_prefix)


SUMMARY_SYSTEM = ("You are agent {agent}, the duty officer of the building. You read incident reports and send "
                  "the other agents a short summary.")
SUMMARY_INSTRUCTION = "Here is an incident report.\n\n{report}\n\nWrite a two-sentence summary for the other agents."
SUMMARY_QUESTION = "What happened, and who fixed it? Answer in one sentence."
SUMMARY_ANSWER_TOKENS = 40
_PROBLEMS = ("a water leak", "a broken window", "a jammed door", "a power cut", "a smell of smoke", "a flooded floor",
             "a faulty alarm", "a blocked fire exit")
_FIXES = ("shut the main valve", "replaced the glass", "reset the lock", "restarted the generator", "called the fire "
          "service", "pumped out the water", "rewired the sensor", "cleared the corridor")
_STATUSES = ("open again", "closed until Monday", "under watch", "back to normal")


def summary(rng: random.Random, index: int) -> Example:
    """A reads an incident report among routine entries and sends a two-sentence summary; B is asked what
    happened and who fixed it, in one sentence, scored by ROUGE-L against the one-sentence reference."""
    reporter, fixer = person_name(rng), person_name(rng)
    problem, fix = rng.choice(_PROBLEMS), rng.choice(_FIXES)
    place, status = rng.choice(PLACES), rng.choice(_STATUSES)
    log = access_log(rng, [], num_routine=8).splitlines()
    log.insert(rng.randrange(2, len(log)), f"incident | {reporter} reported {problem} at the {place}")
    log.append(f"incident | {fixer} {fix}; the {place} is {status}")
    notes = f"{reporter} reported {problem} at the {place}. {fixer} {fix}, and the {place} is {status}."
    sender = AgentMessage(agent="A", system_prompt=SUMMARY_SYSTEM.format(agent="A"),
                          instruction=SUMMARY_INSTRUCTION.format(report="\n".join(log)), text=notes)
    reference = f"{reporter} reported {problem} at the {place}, and {fixer} {fix}."
    return Example(task="summary", index=index, messages=(sender,), question=SUMMARY_QUESTION, answer=reference,
                   notes_header=DRIFT_NOTES_HEADER, scoring="rouge_l", answer_tokens=SUMMARY_ANSWER_TOKENS)


TASKS: dict[str, Callable[[random.Random, int], Example]] = {"keycode": keycode, "twoagent": twoagent,
                                                             "drift": drift, "drift3": drift3, "multihop": multihop,
                                                             "summary": summary, "handoff": handoff,
                                                             "handoff2": handoff2}


def check_task(name: str) -> str:
    """The task name, or ``KVCommError`` naming the known ones."""
    if name not in TASKS:
        raise KVCommError(f"unknown task '{name}'{suggest(name, TASKS)}; known: {', '.join(TASKS)}")
    return name


def generate(task: str, n: int, seed: int = 0) -> list[Example]:
    """Examples 0..n-1 of ``task``; example i depends only on (task, seed, i)."""
    make = TASKS[check_task(task)]
    if n < 1:
        raise KVCommError(f"need n >= 1 examples (got {n})")
    return [make(random.Random(f"{task}:{seed}:{i}"), i) for i in range(n)]
