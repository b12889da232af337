"""What one multi-agent example is, and how B's answers to it are scored.

``kvcomm.tasks`` and ``kvcomm.handoff_tasks`` generate examples; the protocols (``kvcomm.layout``,
``kvcomm.protocols``) read them; ``kvcomm.evaluate`` scores B's replies with ``score``.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class AgentMessage:
    """What one sender agent wrote, and the chat it wrote it in.

    Attributes:
        agent: the sender's name ("A", "C", ...).
        system_prompt: the sender's own system prompt.
        instruction: the user turn the sender answered (its context before the message).
        text: the message itself (the sender's assistant turn): the span a receiver imports.
    """

    agent: str
    system_prompt: str
    instruction: str
    text: str


@dataclass(frozen=True)
class Example:
    """One task instance: sender messages, B's question, and the known answer.

    ``answer_prefix`` starts B's reply (it is part of B's prompt, after the assistant header), so that
    the answer is the continuation ("The code for the red box is" -> " 4821."): a short, checkable
    completion instead of free text, and few decode steps. The hand-off tasks have none: B writes its
    own reply, scored by ``choice`` (see ``score``) among ``candidates``.
    """

    task: str
    index: int
    messages: tuple[AgentMessage, ...]
    question: str
    answer: str
    answer_prefix: str = ""
    # How B's prompt introduces each sender's notes; ``{agent}`` is the sender's name.
    notes_header: str = "Notes from agent {agent}:\n"
    # "exact": a short answer, scored by exact match and token F1; "rouge_l": free text (a summary),
    # scored by ROUGE-L F1 against ``answer`` (exact match is then reported but says little);
    # "choice": a free reply, right when the first of ``candidates`` it names is ``answer``
    scoring: str = "exact"
    answer_tokens: int = 0  # tokens B may decode for this example; 0: the run's --max-tokens
    candidates: tuple[str, ...] = ()  # the answers the notes offer ("choice" scoring)
    template: str = ""  # the task template the example was drawn from ("" for one-template tasks)

    @property
    def example_id(self) -> str:
        return f"{self.task}:{self.index}"


# ---- scoring ---------------------------------------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize(text: str) -> str:
    """SQuAD-style normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def extract_answer(generated: str) -> str:
    """B's answer: the first non-empty line of what it generated (it is told to reply with the answer only)."""
    for line in generated.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def exact_match(prediction: str, answer: str) -> float:
    """1.0 when the normalized prediction equals the normalized answer."""
    return float(normalize(prediction) == normalize(answer))


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (Lin, 2004; beta = 1) on normalized tokens: the longest common subsequence over the
    lengths of prediction (precision) and reference (recall)."""
    pred, ref = normalize(prediction).split(), normalize(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    previous = [0] * (len(ref) + 1)
    for p in pred:  # LCS by dynamic programming, one row at a time
        current = [0]
        for j, r in enumerate(ref):
            current.append(previous[j] + 1 if p == r else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def first_named(prediction: str, candidates: tuple[str, ...]) -> str | None:
    """The candidate whose first mention (whole words, normalized) comes earliest in ``prediction``."""
    words = f" {normalize(prediction)} "
    found = [(words.find(f" {normalize(c)} "), c) for c in candidates]
    found = [(at, c) for at, c in found if at >= 0]
    return min(found)[1] if found else None


def score(example: Example, prediction: str) -> tuple[float, float]:
    """(exact match, F1) of ``prediction``; F1 is ROUGE-L for a free-text (``rouge_l``) task. For
    ``choice``, both are 1 when the first candidate the reply names is the answer, else 0."""
    if example.scoring == "choice":
        right = float(first_named(prediction, example.candidates) == example.answer)
        return right, right
    second = rouge_l if example.scoring == "rouge_l" else token_f1
    return exact_match(prediction, example.answer), second(prediction, example.answer)


def token_f1(prediction: str, answer: str) -> float:
    """Token-level F1 between normalized prediction and answer (SQuAD definition)."""
    pred, gold = normalize(prediction).split(), normalize(answer).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)
