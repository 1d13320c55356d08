"""The pieces of kvlab's self-contained HTML reports (arena, RAG, stream): a page, its tables and its figures, with
plotly.js embedded inline once, so that a report opens without a network connection."""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from kvlab.export import whole_numbers, without_quiet

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}caption{text-align:left;font-weight:600;padding:4px 0}.note{color:#555}
"""


def table_html(df: pd.DataFrame, caption: str = "", headers: dict[str, str] | None = None,
               quiet: tuple[str, ...] = ("error", "past_context")) -> str:
    """A report's table: floats by the pages' rule (``whole_numbers``; three decimals where it says not whole), yes
    and no for True and False, every empty cell as "—" (``to_html`` writes None and pandas' NA as such), the columns
    in ``headers`` headed in words, the caption (if any) above; ``quiet`` columns only where a row says something
    in them (``without_quiet``: an error column only where something failed, a past-context one only where a query
    passed the trained context)."""
    df = without_quiet(df, quiet)
    shown = {}
    for c in df.columns:
        col = df[c]
        if pd.api.types.is_float_dtype(col):
            if len(known := col.dropna()) and whole_numbers(str(c), known.abs().max()):
                shown[c] = ["—" if pd.isna(v) else f"{v:,.0f}" for v in col]
        elif not pd.api.types.is_numeric_dtype(col) or pd.api.types.is_bool_dtype(col):
            shown[c] = [_cell(v) for v in col]
        elif col.isna().any():  # pandas' nullable integers
            shown[c] = col.astype(object).where(col.notna(), "—")
    df = df.assign(**shown).rename(columns=headers or {})
    body = df.to_html(index=False, float_format=lambda x: f"{x:.3f}", na_rep="—", border=0)
    # to_html has no caption argument; the caption goes right after the opening <table …> tag
    return body.replace(">", f"><caption>{html.escape(caption)}</caption>", 1) if caption else body


def _cell(value: object) -> object:
    """A text or mixed column's cell: yes and no for True and False, "—" for nothing, anything else as it is."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return ("yes" if value else "no") if isinstance(value, (bool, np.bool_)) else value


def figures_html(figures: list[go.Figure], plotly_js: bool = True) -> str:
    """A report's figures, plotly.js embedded inline once, with the first (``plotly_js``), so the file opens
    offline."""
    return "".join(pio.to_html(f, full_html=False, include_plotlyjs=plotly_js and i == 0)
                   for i, f in enumerate(figures))


def page(body: str, title: str) -> str:
    """A standalone HTML page around ``body``, with the reports' table style."""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}</body></html>")
