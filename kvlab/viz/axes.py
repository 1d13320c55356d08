"""The one log axis the figures draw: labels a reader takes at face value, as few as still show the scale."""

from __future__ import annotations

import math

import pandas as pd

DECADES_LABELLED_IN_FULL = 3  # over more decades 1-2-3-5 labels crowd: one a decade


def log_axis(low: float, high: float, floor: bool = False) -> dict:
    """A log axis over ``low``…``high`` (both > 0) whose ticks are 1, 2, 3 and 5 times powers of ten (every digit
    where that leaves fewer than three, as in a span of 3.1 to 7; the powers of ten alone over more than three
    decades), labelled in full: plotly's own labels a decade's 2 and 5 with a bare small digit, which reads as 2
    where it means 20. With ``floor`` it starts at 1 (bars rising from perplexity 1 keep their ratios)."""
    low = 1.0 if floor else low
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    steps = ((1,),) if math.log10(high / low) > DECADES_LABELLED_IN_FULL else ((1, 2, 3, 5), range(1, 10))
    for digits in steps:
        ticks = [m * 10.0**e for e in decades for m in digits if low <= m * 10.0**e <= high * 1.4]
        if len(ticks) >= 3:
            break
    shown = {"range": [0, math.log10(high) + 0.15]} if floor else {}
    if len(ticks) < 2:  # a span inside one digit's step (one value drawn): plotly's own ticks show it
        return {"type": "log"} | shown
    return {"type": "log", "tickvals": ticks,
            "ticktext": [f"{v:,.0f}" if v >= 1 else f"{v:g}" for v in ticks]} | shown


def on_log_axis(values: pd.Series) -> pd.Series:
    """``values`` as a log axis can place them: a 0 or below becomes a gap (plotly would draw a line down off the
    axis to it)."""
    return values.where(values > 0)


def log_axis_over(values: pd.Series, floor: bool = False) -> dict:
    """``log_axis`` over the values a log axis can place (with ``floor``, from 1 up to the largest); plotly's own
    without any, or with ``floor`` when none rises above 1."""
    drawn = on_log_axis(values).dropna()
    if not len(drawn) or (floor and drawn.max() <= 1):
        return {"type": "log"}
    return log_axis(float(drawn.min()), float(drawn.max()), floor)
