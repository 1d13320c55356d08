"""Tables laid out to fit the page's width, their numbers printed by the one rule (``kvlab.export.whole_numbers``)."""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st

from kvlab.export import whole_numbers, without_quiet


def short_number(column: str, value: object) -> str:
    """A cell as text by ``whole_numbers``' rule, an empty score as a blank (never 0)."""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return f"{value:,.0f}" if whole_numbers(column, abs(value)) else f"{value:.3g}"
    return str(value)


def transposed(df: pd.DataFrame, by: str) -> pd.DataFrame:
    """One column per value of ``by`` (a strategy, a policy) and one row per measure, so a wide table fits.

    Each measure keeps its own format (a row mixes no units), which a plain ``df.T`` would lose.
    """
    measures = [c for c in df.columns if c != by]
    return pd.DataFrame({str(row[by]): [short_number(c, row[c]) for c in measures] for _, row in df.iterrows()},
                        index=pd.Index(measures, name="measure"))


NOT_SCORED = "n/a"  # a turn with no answer to check


def mark(value: bool | None) -> str:
    """An answer check as a plain mark any font draws: ✓ right, ✗ wrong, n/a no answer to check (no emoji font
    needed; a missing number is "—", which a dash would be mistaken for)."""
    return NOT_SCORED if value is None or value != value else "✓" if value else "✗"


def marked(df: pd.DataFrame, column: str) -> pd.DataFrame:
    """``df`` with ``column``'s answer checks drawn as marks (a copy: CSV downloads keep the raw values)."""
    return df.assign(**{column: [mark(v) for v in df[column]]})


PAST_MARK = "⚠ past"  # a policy's turn whose rotary positions passed the model's trained context


def past_marked(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with its ``past_context`` flags drawn as a warning where they are set (a copy, as ``marked``)."""
    return df.assign(past_context=[PAST_MARK if v is True else "" for v in df["past_context"]])


def dashed(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` for display with an empty cell (nothing measured, no error) drawn as "—", every table's placeholder,
    instead of None; a column with one becomes text, so that it stays one type."""
    return df.assign(**{c: ["—" if pd.isna(v) else short_number(c, v) for v in df[c]]
                        for c in df.columns if df[c].isna().any()})


RESULT_HEADERS = {  # the chat's and the arena's result columns in words (the downloads keep the names)
    "kl": "mean KL", "kl 95 %": "KL 95 %", "kl multi-turn": "KL multi-turn", "kl single-shot": "KL single-shot",
    "top1": "top-1 agreement", "scored": "questions scored", "failed": "failed turns", "kl_low": "KL 95 % low",
    "kl_high": "KL 95 % high", "accuracy_low": "accuracy 95 % low", "accuracy_high": "accuracy 95 % high",
    "accuracy_turn1": "accuracy, turn 1", "accuracy_later": "accuracy, later turns", "kl_rise": "KL rise",
    "kv_kib": "K/V held KiB", "paged_kib": "paged blocks KiB", "kept_tokens": "tokens kept",
    "fragmented_share": "fragmented blocks share", "compaction_copy_kib": "compaction copy KiB",
    "own_s": "own s", "shared_s": "shared s", "extra_prefill_tokens": "extra prefill tokens",
    "extra_prefill_s": "extra prefill s", "budget_tokens": "its token budget", "budget_kib": "budget allows KiB",
    "held_vs_budget": "held vs budget", "held_kib_max": "most held KiB", "held_share": "held / Full's",
    "read_share_of_full": "read / Full's", "held_kib": "held KiB", "read_kib": "read per token KiB",
    "correct": "answer found", "metric": "answer check", "past_context": "past trained context",
    "max_position": "largest position", "total_tokens": "conversation tokens",
    "free_blocks": "free blocks", "fragmented_blocks": "fragmented blocks", "full_blocks": "full blocks",
    "turn_s": "turn s", "evict_ms": "eviction ms", "read_share": "read share",
}


def compact_table(df: pd.DataFrame, headers: dict[str, str] | None = None, pinned: str | None = None,
                  quiet: tuple[str, ...] = ()) -> tuple[pd.DataFrame, dict]:
    """``df`` and the ``column_config`` that print its floats short by ``whole_numbers``' rule, so wide tables fit;
    heads the columns in ``headers`` with words (the downloads keep the names), and pins ``pinned`` as the table
    scrolls. Whole columns come back rounded: Streamlit's step-1 format cuts decimals off (133.7 showed as 133
    here and 134 in ``transposed``). A ``quiet`` column is left out where no row says anything in it
    (``without_quiet``)."""
    df = without_quiet(df, quiet)
    headers = headers or {}
    config, whole = {}, []
    for c in df.columns:
        label, pin = headers.get(c), True if c == pinned else None
        if pd.api.types.is_float_dtype(df[c]):
            if whole_numbers(c, df[c].abs().max()):
                whole.append(c)
            short = {"format": "localized", "step": 1} if c in whole else {"format": "%.3g"}
            config[c] = st.column_config.NumberColumn(label, pinned=pin, **short)  # step 1: no decimals
        elif label or pin:
            config[c] = st.column_config.Column(label, pinned=pin)
    return df.assign(**{c: df[c].round() for c in whole}), config
