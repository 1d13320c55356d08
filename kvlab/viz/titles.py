"""A figure's title with its notes on a smaller line beneath, and the top margin that leaves them room.

Notes go under the title rather than beside it: on the title's own line a long note runs under the chart's
tools and off its edge at 1000 px, and plotly titles do not wrap.
"""

from __future__ import annotations

from collections.abc import Sequence

TITLE_TOP = 50  # px above the plot for a title alone
NOTES_LINE = 30  # the smaller line of notes
PANEL_TITLES = 15  # subplot titles between the notes and the panels


def titled(title: str, notes: Sequence[str] = (), panels: bool = False) -> dict:
    """``update_layout`` fields: ``title`` with ``notes`` joined on one smaller line beneath it (no notes: the title
    alone) and a top margin with room for them, and for the panels' own titles below with ``panels``."""
    text = title + (f"<br><sup>{'; '.join(notes)}</sup>" if notes else "")
    return {"title": text, "margin_t": TITLE_TOP + NOTES_LINE * bool(notes) + PANEL_TITLES * panels}
