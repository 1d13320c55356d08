"""Each policy's colour and markers, the same on every chart: a colour of its own for every built-in policy, a
palette for plug-ins, and a symbol per place so that coinciding points stay apart without colour."""

from __future__ import annotations

from kvlab.viz import SYMBOLS

POLICY_COLOURS = {"full": "#222222", "streamingllm": "#1f77b4", "window": "#8c564b", "h2o": "#2ca02c",
                  "snapkv": "#d62728", "pyramidkv": "#9467bd", "tova": "#ff7f0e", "knorm": "#17becf",
                  "expected_attention": "#bcbd22", "keydiff": "#e377c2", "oracle": "#7f7f7f", "adakv": "#8c6d31",
                  "quest": "#393b79", "kivi": "#637939", "recompute": "#e7969c",
                  "duoattention": "#17a589", "kvzip": "#006d2c"}
# for plug-ins and anything unnamed above: each far from every named colour and from each other (CIELAB ΔE ≥ 25)
OTHER_COLOURS = ["#ff00ff", "#00008b", "#ffbb78", "#98df8a", "#800000", "#aec7e8", "#ffd700", "#00ff7f"]


def policy_colour(policy: str, i: int = 0) -> str:
    """A policy's colour on every chart (``i``, its place in the chart, picks one for a policy without its own)."""
    return POLICY_COLOURS.get(policy, OTHER_COLOURS[i % len(OTHER_COLOURS)])


def policy_marker(policy: str, i: int = 0, **more: object) -> dict:
    """A policy's markers on every chart: its colour and the ``i``-th symbol, so that policies whose points coincide
    stay apart without colour; ``more``: other marker settings (size)."""
    return {"color": policy_colour(policy, i), "symbol": SYMBOLS[i % len(SYMBOLS)], **more}
