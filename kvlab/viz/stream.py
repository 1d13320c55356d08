"""Figures of a stream: perplexity vs tokens streamed, and the sink ablation (pure functions of their tables)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from kvlab.viz.axes import log_axis_over
from kvlab.viz.colours import policy_colour
from kvlab.viz.titles import titled


def perplexity_figure(running: pd.DataFrame, context_length: int, cache: int, window: int) -> go.Figure:
    """Running perplexity (over the last ``window`` tokens) vs tokens streamed, a line per runner, log scale.

    ``running`` has the columns of ``StreamResult.running``. Where a runner's queries sat past the trained
    context its line turns dotted: those positions are ones the model never saw in training. The trained
    context and the cache size are marked.
    """
    fig = go.Figure()
    for i, (policy, rows) in enumerate(running.groupby("policy", sort=False)):
        colour, label = policy_colour(policy, i), rows["label"].iloc[0]
        inside = rows[~rows["past_context"]]
        past = rows[rows["past_context"]]
        fig.add_trace(go.Scatter(x=inside["position"], y=inside["ppl"], mode="lines", name=label,
                                 legendgroup=policy, line={"color": colour, "width": 2}))
        if len(past):
            fig.add_trace(go.Scatter(x=past["position"], y=past["ppl"], mode="lines",
                                     name=f"{label}, past its trained positions", legendgroup=policy,
                                     line={"color": colour, "width": 2, "dash": "dot"}))
    end = int(running["position"].max()) if len(running) else 0
    # each label on the side of its line that faces the plot's middle (the cache's, left of its line, sat on the
    # y axis's ticks), a row apart and on a backing, so that neither covers the other or is struck through by a line
    backing = "rgba(255,255,255,0.85)"
    fig.add_vline(x=cache, line={"color": "#888", "dash": "dash"}, annotation_bgcolor=backing,
                  annotation_text=f"cache full ({cache:,})", annotation_position="top right")
    if context_length <= end:
        fig.add_vline(x=context_length, line={"color": "#d62728", "dash": "dash"}, annotation_bgcolor=backing,
                      annotation_text=f"trained context ({context_length:,})", annotation_position="top left",
                      annotation_yshift=-18)
        notes = []
    else:
        notes = [f"the trained context, {context_length:,}, lies past this stream"]
    yaxis = log_axis_over(running.get("ppl", pd.Series(dtype=float)))
    fig.update_layout(**titled("Perplexity vs tokens streamed", notes), xaxis_title="tokens streamed",
                      yaxis_title=f"perplexity over the last {window:,} tokens (log)", yaxis=yaxis,
                      legend={"orientation": "h", "y": -0.2})
    return fig


def sink_ablation_figure(table: pd.DataFrame) -> go.Figure:
    """Perplexity per sink count at one cache size (StreamingLLM's Table 1), over the whole stream and after
    the cache first filled; log scale, since a window without sinks can be orders of magnitude worse."""
    rows = table[table["error"].isna()] if "error" in table else table
    fig = go.Figure()
    for column, name, colour in (("ppl", "whole stream", "#1f77b4"),
                                 ("ppl_after_cache_filled", "after the cache first filled", "#ff7f0e")):
        fig.add_trace(go.Bar(x=rows["cache"], y=rows[column], name=name, marker_color=colour,
                             text=[f"{v:.2f}" if pd.notna(v) else "" for v in rows[column]], textposition="outside"))
    # bars rise from perplexity 1 (log 0): from plotly's own floor near the smallest bar they misstate the ratios
    yaxis = log_axis_over(pd.concat([rows["ppl"], rows["ppl_after_cache_filled"]]), floor=True)
    fig.update_layout(title="Attention sinks: sinks + recent tokens at one cache size", barmode="group",
                      xaxis_title="sinks + recent tokens", yaxis_title="perplexity (log)", yaxis=yaxis,
                      margin={"t": 60})
    return fig


def stream_bars_figure(table: pd.DataFrame) -> go.Figure:
    """One bar per runner (``table``: policy, label, ppl; rows with no ppl are left out): its perplexity, log scale
    from 1, so that bar heights keep the runners' ratios."""
    rows = table.dropna(subset=["ppl"])
    fig = go.Figure(go.Bar(x=rows["label"], y=rows["ppl"],
                           marker_color=[policy_colour(p, i) for i, p in enumerate(rows["policy"])],
                           text=[f"{v:.2f}" for v in rows["ppl"]], textposition="outside"))
    yaxis = log_axis_over(rows["ppl"], floor=True)
    fig.update_layout(title="Perplexity after the cache first evicted", yaxis_title="perplexity (log)", yaxis=yaxis,
                      margin={"t": 60})
    return fig
