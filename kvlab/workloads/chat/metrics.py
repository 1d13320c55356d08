"""How a turn's reply is scored against its answer: kvlab's rule and SCBench's and RULER's per-task metrics.

A turn's ``answer`` is one reference, or several, one per line. Every metric gives a turn right or wrong:

- ``contains`` (kvlab's rule; RULER's ``string_match_all``, all or nothing per turn): every reference
  occurs in the reply, case-insensitively.
- ``contains_any`` (SCBench ``longdialogue_qa_eng`` for ``scbench_qa_eng`` and ``scbench_many_shot``;
  RULER's ``string_match_part``): some reference occurs in the reply, case-insensitively.
- ``first_number`` (SCBench ``passkey``, ``number_string``, ``math_find``): the reply's first number is the
  answer (exact match).
- ``option`` (SCBench ``longbook_choice_eng`` for ``scbench_choice_eng``): the answer is the option letter,
  then the option's text; the reply's chosen option is read as MInference's ``compute_scores.py`` reads it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kvlab.errors import KvlabError
from kvlab.registry import Registry

_LETTERS = "ABCD"
_ANSWER_PREFIXES = ("answer is:", "answer:", "answer is", "option is")


def references(answer: str) -> list[str]:
    """The answer's references: its non-blank lines, stripped."""
    return [line.strip() for line in answer.split("\n") if line.strip()]


def check_metric(metric: str) -> None:
    """Refuse a metric name kvlab does not know, in one sentence naming the known ones."""
    METRICS.key(metric)


def _first_number(reply: str) -> str:
    match = re.search(r"\d+(?:\.\d+)?", reply)
    return "" if match is None else match.group(0)


def _option(reply: str, letter: str, text: str) -> bool:
    """SCBench's reading of a multiple-choice reply: a leading letter, the option's text, an
    'answer is X' phrase, else the first standalone A-D word."""
    pred = reply.strip()
    if not pred:
        return False
    if pred[0] in _LETTERS:
        return pred[0] == letter
    if pred in (letter, text):
        return True
    for c in "\n\"'.,?!{}":
        pred = pred.replace(c, " ")
    pred = " ".join(pred.split())
    for prefix in _ANSWER_PREFIXES:
        at = pred.find(prefix)
        if at != -1:
            after = pred[at + len(prefix) + 1:]
            return after.startswith(letter) or bool(text) and after.startswith(text)
    return next((word == letter for word in pred.split() if word in _LETTERS), False)


def _first_number_equal(refs: list[str], reply: str) -> bool:
    number = _first_number(reply)
    return bool(number) and float(number) == float(_first_number(refs[0]) or "nan")


@dataclass(frozen=True)
class Metric:
    """One way a reply is scored: ``rule`` reads the references (the answer's lines) and the reply; ``shortest``
    is the least a reply must say to be right (every reference, the shortest one, the number, the letter)."""

    name: str
    label: str
    summary: str
    rule: Callable[[list[str], str], bool]
    shortest: Callable[[list[str]], str]


METRICS: Registry[Metric] = Registry("metric", (
    Metric("contains", "contains", "every reference occurs in the reply (kvlab; RULER string_match_all)",
           lambda refs, reply: all(r.lower() in reply.lower() for r in refs), " ".join),
    Metric("contains_any", "contains any", "some reference occurs in the reply (SCBench QA; RULER string_match_part)",
           lambda refs, reply: any(r.lower() in reply.lower() for r in refs), lambda refs: min(refs, key=len)),
    Metric("first_number", "first number", "the reply's first number equals the answer (SCBench passkey, math_find)",
           _first_number_equal, lambda refs: _first_number(refs[0])),
    Metric("option", "option", "the reply picks the answer's option letter (SCBench multiple choice)",
           lambda refs, reply: _option(reply, refs[0], refs[1] if len(refs) > 1 else ""), lambda refs: refs[0]),
))


def shortest_answer(answer: str, metric: str = "contains") -> str:
    """The least a reply must say to answer ``answer`` right by ``metric``: a reply cut shorter cannot be right."""
    return METRICS[metric].shortest(references(answer))


def score_reply(answer: str, reply: str, metric: str = "contains") -> bool:
    """Whether ``reply`` (the model's continuation after any prefill) answers ``answer`` by ``metric``."""
    rule = METRICS[metric].rule
    refs = references(answer)
    if not refs:
        raise KvlabError("the answer is empty")
    return rule(refs, reply)
