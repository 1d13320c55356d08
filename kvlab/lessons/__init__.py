"""Guided lessons: each claim of the notes as a live experiment with a verdict computed from the run."""

from kvlab.lessons import agnostic, chat, code, rag, streams, windows
from kvlab.lessons.base import OUTCOMES, Figure, Lesson, Verdict
from kvlab.registry import Registry

LESSONS: Registry[Lesson] = Registry("lesson", (lesson for group in (chat, rag, code, windows, agnostic, streams)
                                                for lesson in group.LESSONS))

__all__ = ["LESSONS", "OUTCOMES", "Figure", "Lesson", "Verdict"]
