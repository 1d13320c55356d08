"""A figure's title with its notes on a smaller line beneath, and the top margin that leaves them room.

Notes go under the title rather than beside it: on the title's own line a long note runs under the chart's
tools and off its edge at 1000 px, and plotly titles do not wrap.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

import plotly.graph_objects as go

TITLE_TOP = 50  # px above the plot for a title alone
NOTES_LINE = 30  # the smaller line of notes
PANEL_TITLES = 15  # subplot titles between the notes and the panels


def titled(title: str, notes: Sequence[str] = (), panels: bool = False) -> dict:
    """``update_layout`` fields: ``title`` with ``notes`` joined on one smaller line beneath it (no notes: the title
    alone) and a top margin with room for them, and for the panels' own titles below with ``panels``."""
    text = title + (f"<br><sup>{'; '.join(notes)}</sup>" if notes else "")
    return {"title": text, "margin_t": TITLE_TOP + NOTES_LINE * bool(notes) + PANEL_TITLES * panels}


TITLE_CHARS = 50  # a title's line at most: plotly cut a longer one at the edge of a 440 px chart (a 900 px window)
NOTES_CHARS = 70  # a line of the smaller notes beneath it
PANEL_CHARS = 36  # the panels' titles of one row, all together (at PANEL_FONT)
PANEL_FONT = 13  # px: a wrapped panel title (plotly's own 16 took two panels' width on a 440 px chart)
LINE_PX = {"title": 22, "notes": 16, "panel": 20}  # what one more line of each takes from the top margin


def _wrapped(text: str, width: int) -> str:
    """``text`` with every <br>-separated line longer than ``width`` characters broken at spaces (markup that
    wraps a whole line, <sup>…</sup> or <b>…</b>, is kept around each of its pieces)."""
    out = []
    for line in text.split("<br>"):
        match = re.fullmatch(r"(<(sup|b|i)>)(.*)(</\2>)", line)
        opening, inner, closing = (match.group(1), match.group(3), match.group(4)) if match else ("", line, "")
        pieces = textwrap.wrap(inner, width, break_long_words=False, break_on_hyphens=False) or [inner]
        out += [f"{opening}{p}{closing}" for p in pieces]
    return "<br>".join(out)


def _axis_order(name: str) -> int:
    """xaxis → 1, xaxis2 → 2, …: the panels' order, left to right in a row."""
    return int(name.removeprefix("xaxis").removeprefix("yaxis") or 1) if name[:5] in ("xaxis", "yaxis") else 0


def fit_titles(fig: go.Figure) -> go.Figure:
    """``fig`` with its title, its notes and its panels' titles broken into lines that fit a narrow chart (plotly
    neither wraps nor shrinks them: they ran off the edge or over each other), and the top margin grown by the
    lines added. Idempotent: titles already broken are left as they are."""
    extra = 0
    title = fig.layout.title.text
    if title:
        notes_at = title.find("<sup>")
        head, notes = (title, "") if notes_at < 0 else (title[:notes_at].removesuffix("<br>"), title[notes_at:])
        head_fit, notes_fit = _wrapped(head, TITLE_CHARS), _wrapped(notes, NOTES_CHARS)
        fitted = head_fit + (f"<br>{notes_fit}" if notes else "")
        extra += (LINE_PX["title"] * (head_fit.count("<br>") - head.count("<br>"))
                  + LINE_PX["notes"] * (notes_fit.count("<br>") - notes.count("<br>")))
        # at the top: plotly centres a title in the top margin, so the margin grown for its lines moved it down too
        fig.layout.title.update(text=fitted, yref="container", y=1, yanchor="top", pad={"t": 20})
    panels = [a for a in fig.layout.annotations if a.yanchor == "bottom" and a.xanchor == "center"
              and a.showarrow is False and a.xref == "paper" and a.yref == "paper" and a.text]
    rows: dict[float, list] = {}
    for a in panels:
        rows.setdefault(round(a.y, 6), []).append(a)
    top = max(rows, default=None)  # the row under the title: only its added lines need the top margin
    for y, row in rows.items():
        fitted = [_wrapped(a.text, max(12, PANEL_CHARS // len(row))) for a in row]
        added = max(f.count("<br>") - a.text.count("<br>") for f, a in zip(fitted, row))
        if added:  # the row's titles at one smaller size
            for a, f in zip(row, fitted):
                a.text, a.font.size = f, PANEL_FONT
        extra += LINE_PX["panel"] * added if y == top else 0
    xaxes = [fig.layout[name] for name in sorted(fig.layout, key=_axis_order)
             if name.startswith("xaxis") and fig.layout[name].title.text]
    if len(xaxes) > 1 and len({a.title.text for a in xaxes}) == 1 and len(xaxes[0].title.text) > PANEL_CHARS // len(
            xaxes):  # one title too long for a panel, said once: three side by side ran into each other
        keep = len(xaxes) // 2 if len(xaxes) % 2 else 0  # under the middle panel, or the first of an even row
        for i, axis in enumerate(xaxes):
            axis.title.text = axis.title.text if i == keep else None
    for frame in fig.frames:  # an animation's frames carry their own titles, shown as it plays
        if frame.layout.title.text:
            frame.layout.title.text = _wrapped(frame.layout.title.text, TITLE_CHARS)
    if extra:
        fig.layout.margin.t = (fig.layout.margin.t if fig.layout.margin.t is not None else TITLE_TOP * 2) + extra
        if fig.layout.height is not None:
            fig.layout.height += extra
    return fig
