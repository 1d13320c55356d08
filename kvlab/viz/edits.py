"""Figures of the code-edit page: edit timeline, FLOPs share per component, adjacent-layer similarity."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.workloads.code.costs import COMPONENTS, component_shares

COMPONENT_COLOURS = {
    "q_proj": "#4e79a7", "k_proj": "#f28e2b", "v_proj": "#e15759",
    "o_proj": "#76b7b2", "attention": "#59a14f", "mlp": "#bab0ac",
}
TICK_CHARS = 28  # an edit's label on the time line: longer ones are cut, the hover shows them whole


def timeline_figure(edits: pd.DataFrame) -> go.Figure:
    """Reuse % (bars) and time saved against a full prefill (line) per edit."""
    # slanted ticks of a long edit label ran off the figure: a tick holds its start, the hover the whole of it
    labels = [f"{row.index}. {_cut(row.label)} (L{row.line})" for row in edits.itertuples()]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=labels, y=edits["reuse_pct"], name="prefix reused (%)", marker_color="#4e79a7",
                         customdata=edits[["reused", "new_tokens", "label"]],
                         hovertemplate="%{customdata[2]}<br>%{y:.1f}% (%{customdata[0]} of %{customdata[1]} tokens)"
                                       "<extra></extra>"))
    # each run times both back to back: the saving is the median of the runs' savings, its bar from the run that saved
    # least to the one that saved most (older records: the medians' difference, no bar)
    paired = "saved_ms" in edits and edits["saved_ms"].notna().all()
    saved = edits["saved_ms"].astype(float) if paired else edits["full_ms"] - edits["reprefill_ms"]
    low = edits["saved_low_ms"].astype(float) if paired else saved
    high = edits["saved_high_ms"].astype(float) if paired else saved
    timed = "one run each" if set(edits["runs"]) <= {1} else "median of the runs"
    fig.add_trace(go.Scatter(x=labels, y=saved, name=f"time saved (ms, {timed})",
                             mode="lines+markers", marker_color="#e15759",
                             error_y={"type": "data", "symmetric": False, "array": high - saved,
                                      "arrayminus": saved - low}),
                  secondary_y=True)
    fig.update_yaxes(title_text="prefix reused (%)", range=[0, 100], secondary_y=False)
    # ticks of its own (an overlaying axis would take the left one's tick positions: −185, 1,267…); whole ms with
    # separators: plotly's "6.6k" reads oddly
    fig.update_yaxes(title_text="time saved vs full prefill (ms)", range=time_range(low, high),
                     tickformat=",.0f", tickmode="auto", showgrid=False, zeroline=False, secondary_y=True)
    # where a re-prefill stops saving time, named in the legend: a bare rule read as a threshold of the bars' axis,
    # and a label on the line sat on the last bar
    zero = {"dash": "dot", "color": "#e15759", "width": 1}
    fig.add_hline(y=0, line=zero, secondary_y=True)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=zero, name="no time saved (0 ms)",
                             hoverinfo="skip"), secondary_y=True)
    fig.update_layout(title="Edits: prefix reuse and time saved",  # the legend above: the edits' labels slant below
                      legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1.0, xanchor="right"),
                      margin=dict(b=120))
    fig.update_xaxes(automargin=True)  # the slanted labels get the room they need, at either end
    return fig


def _cut(label: str, width: int = TICK_CHARS) -> str:
    """``label`` cut to ``width`` characters, an ellipsis marking the cut."""
    return label if len(label) <= width else label[: width - 1].rstrip() + "…"


def time_range(lows: pd.Series, highs: pd.Series) -> list[float]:
    """An axis range over every value drawn (error bars' ends) and zero, with a 5 % margin: the line where no time is
    saved stays in sight (an axis of −5,100 to −4,700 ms read a loss as a saving)."""
    low, high = min(float(lows.min()), 0.0), max(float(highs.max()), 0.0)
    pad = 0.05 * (high - low) or 0.05 * abs(high) or 1.0  # one edit (or equal savings) still gets a range
    return [low - pad, high + pad]


def cost_share_figure(costs: pd.DataFrame) -> go.Figure:
    """Stacked FLOPs per component as a share of Full's re-prefill, with the notes' claim as a marker."""
    shares = component_shares(costs)
    fig = go.Figure()
    for name in COMPONENTS:
        part = shares[shares["component"] == name]
        fig.add_trace(go.Bar(x=part["scheme"], y=part["share"], name=name,
                             marker_color=COMPONENT_COLOURS[name], hovertemplate="%{y:.3f}<extra>" + name + "</extra>"))
    fig.add_trace(go.Scatter(x=costs["scheme"], y=costs["claim_share"], mode="markers", name="claim: N/ratio",
                             marker=dict(symbol="diamond", size=12, color="black")))
    fig.update_layout(barmode="stack", title="Re-prefill FLOPs as a share of Full (per component)",
                      yaxis_title="share of Full's FLOPs", yaxis_range=[0, 1.05])
    return fig


def similarity_heatmap(similarity: pd.DataFrame) -> go.Figure:
    """Cosine similarity of layer l and l+1, per KV head (and mean), for K and for V side by side."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("K", "V"), shared_yaxes=True, horizontal_spacing=0.05)
    for col, tensor in enumerate(("K", "V"), start=1):
        grid = similarity[similarity["tensor"] == tensor].pivot(index="layer", columns="head", values="cosine")
        fig.add_trace(go.Heatmap(
            z=grid.values, x=[f"head {h}" if h != "mean" else "mean" for h in grid.columns],
            y=[f"{layer}→{layer + 1}" for layer in grid.index], zmin=-1, zmax=1, colorscale="RdBu", reversescale=True,
            showscale=col == 2, hovertemplate="layers %{y}, %{x}: %{z:.3f}<extra>" + tensor + "</extra>",
        ), row=1, col=col)
    fig.update_yaxes(title_text="layer pair", autorange="reversed", row=1, col=1)
    fig.update_layout(title="Adjacent-layer K/V cosine similarity (MiniCache observation)",
                      height=max(400, 16 * similarity["layer"].nunique()))
    return fig


def similarity_curve(similarity: pd.DataFrame) -> go.Figure:
    """Mean cosine similarity over KV heads per layer pair, K and V."""
    fig = go.Figure()
    for tensor, colour in (("K", "#4e79a7"), ("V", "#e15759")):
        rows = similarity[(similarity["tensor"] == tensor) & (similarity["head"] == "mean")]
        fig.add_trace(go.Scatter(x=rows["layer"], y=rows["cosine"], name=tensor, mode="lines+markers",
                                 marker_color=colour))
    fig.update_layout(title="Mean adjacent-layer cosine similarity", xaxis_title="layer l (compared with l+1)",
                      yaxis_title="cosine similarity", yaxis_range=[-1, 1])
    return fig
