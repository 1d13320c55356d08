"""The one progress-callback type: every long run (model download, lesson, RAG question, edit replay,
arena grid, benchmark) reports through it, so a page bar or a terminal bar can follow any of them."""

from typing import Callable

Progress = Callable[[float, str], None]
"""``progress(fraction, message)``: the share of the run done, in [0, 1], and what runs now."""


def part_of(progress: Progress, start: float, end: float) -> Progress:
    """``progress`` for a step that covers ``start``…``end`` of a longer run: its 0…1 maps onto that span."""
    return lambda fraction, message: progress(start + (end - start) * fraction, message)
