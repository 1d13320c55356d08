"""What a lesson is: a claim of the notes, a calibrated preset, a live run, figures and a verdict.

A lesson's run returns plain JSON (numbers, token texts, replies) so that the verdict and the
figures are pure functions of it: they can be tested on hand-built results and recomputed from a
downloaded file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd
import plotly.graph_objects as go

from kvlab.engine.chatformat import DEFAULT_SYSTEM
from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import Progress
from kvlab.stats import Interval, wilson

Result = dict  # a lesson run's record: JSON-ready

OUTCOMES = ("supports", "contradicts", "mixed", "inconclusive")
CHAT_SYSTEM = DEFAULT_SYSTEM  # SmolLM2 holds a conversation only with a system message
# The fewest cases for which n of n and 0 of n have disjoint 95 % Wilson intervals ([0.51, 1] against [0, 0.49]):
# below it no recall rate can tell two policies apart, however they did.
MIN_CASES = 4


@dataclass(frozen=True)
class Verdict:
    """What a run says about its claim: an outcome (one of ``OUTCOMES``) and a sentence with the run's numbers."""

    outcome: str
    text: str

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, not {self.outcome!r}")


@dataclass(frozen=True)
class Figure:
    """A chart and the one-line reading under it, written from the run's numbers."""

    figure: go.Figure
    reading: str


@dataclass(frozen=True)
class Lesson:
    """One claim turned into a live experiment."""

    key: str
    title: str
    claim: str  # the notes' claim in one sentence
    preset: str  # what the Run button runs, in words
    run: Callable[[LoadedModel, Progress], Result]
    verdict: Callable[[Result], Verdict]
    figures: Callable[[Result], list[Figure]]
    unavailable: Callable[[LoadedModel], str | None] = lambda lm: None  # why this model cannot run it
    table: Callable[[Result], pd.DataFrame] | None = None  # the run's numbers, with readable column names

    @property
    def name(self) -> str:  # the registry's three words for key, title and claim
        return self.key

    @property
    def label(self) -> str:
        return self.title

    @property
    def summary(self) -> str:
        return self.claim


def inconclusive(n: int, what: str, needed: int, text: str, change: str) -> Verdict:
    """The verdict of a run with too few cases: it says so first, then what was measured and what would decide."""
    return Verdict("inconclusive", f"Inconclusive (n = {n} {what}; a verdict on this claim needs at least {needed}). "
                                   f"{text} {change}")


def rate(hits: int, n: int) -> tuple[str, Interval]:
    """'5/8 (62 % [31–86 %])' and the Wilson interval it reads."""
    interval = wilson(hits, n)
    return f"{hits}/{n} ({interval.text(percent=True)})", interval


def needs_rope(lm: LoadedModel) -> str | None:
    """Why a RoPE lesson cannot run on ``lm`` (None: it can)."""
    if lm.facts.has_rope:
        return None
    return f"{lm.facts.name} has no rotary position embedding, so RoPE drift does not apply"


def span_text(positions: list[int]) -> str:
    """'31–34' for consecutive positions, '12' for one."""
    return f"{positions[0]}–{positions[-1]}" if len(positions) > 1 else str(positions[0])


def pct(x: float) -> str:
    """A share as a whole percent ('42%')."""
    return f"{100 * x:.0f}%"
