"""Realistic sender contexts for the agent-like tasks in ``kvcomm.tasks`` (``drift``, ``multihop``).

This module only writes text and random structure from a seeded ``random.Random``; ``kvcomm.tasks``
turns it into examples. Two generators:

- ``access_log``: a plausible building-access log (~15-20 timestamped lines, ~420-630 SmolLM2 tokens,
  median ~515) in which some storage codes are set and later changed. A sender reads it before
  writing its notes, so its message starts hundreds of tokens into its own sequence while the
  receiver needs it near the top.
  The old (superseded) codes are in the log on purpose: the exported message K/V attended to them.
- ``entity_graph_question``: a random world of people, companies and cities with relations (works for, based
  in, married to, born in, founded by), from which two-hop questions are drawn whose two facts are
  stated in different documents (2WikiMultiHopQA / MuSiQue style, but generated here: nothing is
  downloaded).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_NAMES = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kira",
               "Luca", "Marta", "Nils", "Oksana", "Pavel", "Rosa", "Sven", "Tomas", "Ulla", "Vera", "Wim", "Yara",
               "Zeno")
LAST_NAMES = ("Moreau", "Lindqvist", "Okafor", "Brandt", "Costa", "Novak", "Haddad", "Kowalski", "Jansen",
              "Rossi", "Tanaka", "Berg", "Silva", "Weber", "Dumont", "Varga")
COMPANY_STEMS = ("Norvik", "Alder", "Brightwater", "Castell", "Dunmore", "Elmfield", "Greystone", "Halberg",
                 "Ironwood", "Juniper", "Kestrel", "Larkspur", "Marlow", "Northgate", "Oakridge", "Pemberton")
COMPANY_KINDS = ("Systems", "Logistics", "Foods", "Energy", "Textiles", "Robotics", "Media", "Pharma")
CITIES = ("Lyon", "Porto", "Oslo", "Krakow", "Tampere", "Ghent", "Leeds", "Bergen", "Turin", "Seville", "Graz",
          "Utrecht", "Aarhus", "Bilbao", "Dresden", "Brno", "Galway", "Split", "Riga", "Basel")

# Log vocabulary: who did what where; the routine lines carry no codes.
PLACES = ("main entrance", "loading dock 2", "loading dock 4", "server room", "east stairwell", "archive",
           "parking level B", "mail room", "lab 3", "cafeteria")
_ROUTINE = ("badge scan accepted", "badge scan rejected, retried", "door held open 40 s, alarm cleared",
            "visitor signed in, escorted", "delivery of {n} parcels logged", "patrol round completed",
            "maintenance ticket {t} opened", "lights left on, switched off", "contractor badge issued",
            "fire door checked")


def person_name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def access_log(rng: random.Random, final_codes: list[tuple[str, str]], num_routine: int = 8) -> str:
    """A day's access log that sets every (item, code) of ``final_codes`` and changes some codes once.

    The last code set for an item is the one in ``final_codes``; a changed item also has an earlier,
    different code in the log (a superseded value the notes must not report).
    """
    staff = [person_name(rng) for _ in range(6)]
    events: list[str] = []
    for _ in range(num_routine):
        action = rng.choice(_ROUTINE).format(n=rng.randint(2, 19), t=rng.randint(10000, 99999))
        events.append(f"{rng.choice(PLACES)} | {rng.choice(staff)} | {action}")
    code_events: list[tuple[int, str]] = []  # (order key, line): an item's old code always comes first
    for item, code in final_codes:
        if rng.random() < 0.5:
            old = str(rng.randint(1000, 9999))
            while old == code:
                old = str(rng.randint(1000, 9999))
            first = rng.randrange(0, num_routine // 2)
            code_events.append((first, f"security office | {rng.choice(staff)} | code for the {item} set to {old}"))
            code_events.append((rng.randrange(first + 1, num_routine + 1),
                                f"security office | {rng.choice(staff)} | code for the {item} changed from {old} to {code}"))
        else:
            code_events.append((rng.randrange(0, num_routine + 1),
                                f"security office | {rng.choice(staff)} | code for the {item} set to {code}"))
    # stable merge: code events go in front of the routine line with the same index, in their own order
    for slot, line in sorted(code_events, key=lambda e: e[0], reverse=True):
        events.insert(slot, line)
    minute = rng.randint(6 * 60, 7 * 60)
    day = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    lines = []
    for event in events:
        minute += rng.randint(3, 29)
        lines.append(f"{day} {minute // 60:02d}:{minute % 60:02d} | {event}")
    return f"ACCESS LOG, building {rng.choice('ABCDEFGH')}{rng.randint(1, 9)}, {day}\n" + "\n".join(lines)


@dataclass(frozen=True)
class Fact:
    """One edge of the entity graph: ``subject`` --relation--> ``obj``, and how a document states it."""

    subject: str
    relation: str
    obj: str

    @property
    def sentence(self) -> str:
        return RELATION_SENTENCES[self.relation].format(s=self.subject, o=self.obj)


RELATION_SENTENCES = {
    "works_for": "{s} works for {o}.",
    "based_in": "{s} is based in {o}.",
    "married_to": "{s} is married to {o}.",
    "born_in": "{s} was born in {o}.",
    "founded_by": "{s} was founded by {o}.",
}

# Two-hop question templates: (first relation, second relation, question, answer prefix). The first
# hop's object is the second hop's subject; the answer is the second hop's object (always a city).
HOPS = (
    ("works_for", "based_in", "In which city is the company that {x} works for based?",
     "The company that {x} works for is based in"),
    ("married_to", "born_in", "In which city was the spouse of {x} born?", "The spouse of {x} was born in"),
    ("founded_by", "born_in", "In which city was the founder of {x} born?", "The founder of {x} was born in"),
)


@dataclass(frozen=True)
class TwoHop:
    """A two-hop question over the graph, with the facts each of the two documents states."""

    question: str
    answer_prefix: str
    answer: str
    first_hop: Fact  # stated only in document 1
    second_hop: Fact  # stated only in document 2
    document_1: tuple[Fact, ...]  # the first hop among same-relation distractors
    document_2: tuple[Fact, ...]  # the second hop among same-relation distractors


def entity_graph_question(rng: random.Random, num_chains: int = 3) -> TwoHop:
    """A random two-hop question whose hops sit in two different documents.

    Each document lists ``num_chains`` facts of its relation; the distractor facts form complete
    chains of their own (distractor subject -> some entity -> another city), so answering needs the
    right first hop, not just any city in document 2. All bridge entities and answer cities differ.
    """
    first_rel, second_rel, question, prefix = HOPS[rng.randrange(len(HOPS))]
    people = rng.sample([f"{f} {s}" for f in FIRST_NAMES for s in LAST_NAMES], 2 * num_chains)
    companies = rng.sample([f"{s} {k}" for s in COMPANY_STEMS for k in COMPANY_KINDS], num_chains)
    cities = rng.sample(CITIES, num_chains)
    if first_rel == "works_for":
        subjects, bridges = people[:num_chains], companies
    elif first_rel == "married_to":
        subjects, bridges = people[:num_chains], people[num_chains:]
    else:  # founded_by: company -> founder
        subjects, bridges = companies, people[:num_chains]
    doc1 = [Fact(s, first_rel, b) for s, b in zip(subjects, bridges)]
    doc2 = [Fact(b, second_rel, c) for b, c in zip(bridges, cities)]
    asked = rng.randrange(num_chains)
    rng.shuffle(doc2)  # the second hop's place in document 2 is independent of the first's
    second = next(f for f in doc2 if f.subject == bridges[asked])
    return TwoHop(question=question.format(x=subjects[asked]), answer_prefix=prefix.format(x=subjects[asked]),
                  answer=second.obj, first_hop=doc1[asked], second_hop=second, document_1=tuple(doc1),
                  document_2=tuple(doc2))


_DOC_FILLER = (
    "The register is updated every quarter by the records office.",
    "Entries are listed in the order they were received.",
    "Some entries were corrected after a review in the spring.",
    "Questions about this register go to the records desk on the second floor.",
    "Earlier editions of this register are kept in the archive.",
)


def document(rng: random.Random, title: str, facts: tuple[Fact, ...]) -> str:
    """A short register-style document stating ``facts`` among filler sentences, in its own order."""
    sentences = [f.sentence for f in facts] + rng.sample(_DOC_FILLER, 3)
    rng.shuffle(sentences)
    return f"{title}\n" + " ".join(sentences)
