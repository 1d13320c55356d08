"""Figures for the RAG page: RoPE drift, per-layer deviation, strategy trade-offs, prefix reuse."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.viz import SYMBOLS
from kvlab.viz.titles import titled

ZERO_DEVIATION = 1e-6  # a relative deviation this small is float32 rounding: the strategy equals full prefill
_DASHES = ["solid", "dash", "dot", "dashdot", "longdashdot"]
_COLORS = ["#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692"]


def rotation_heatmap(angles: np.ndarray, deltas: list[int], layer: int) -> go.Figure:
    """Rotation angle of each frequency pair of ``layer`` after a shift Δp, wrapped to [-π, π] (angles [pairs,
    deltas])."""
    fig = go.Figure(go.Heatmap(
        z=np.asarray(angles), x=list(deltas), y=list(range(len(angles))), zmin=-math.pi, zmax=math.pi,
        colorscale="Twilight", colorbar={"title": "angle (rad)"},
        hovertemplate="Δp %{x}<br>pair %{y}<br>angle %{z:.2f} rad<extra></extra>",
    ))
    fig.update_layout(title=f"RoPE rotation per frequency pair vs position shift Δp, layer {layer}",
                      xaxis_title="Δp (positions)", yaxis_title="frequency pair (0 = fastest)", height=420)
    return fig


def qk_drift_figure(drift: dict, layer: int, head: int) -> go.Figure:
    """Mean |q·k score error| and attention-row TV distance vs Δp under naive reuse."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=drift["delta"], y=drift["score_abs_error"], name="mean |score error|",
                             mode="lines"), secondary_y=False)
    fig.add_trace(go.Scatter(x=drift["delta"], y=drift["attention_tv"], name="attention TV distance",
                             mode="lines", line={"dash": "dot"}), secondary_y=True)
    # a legend entry, not a label on the line: the TV curve crosses it anywhere
    span = [min(drift["delta"]), max(drift["delta"])]
    fig.add_trace(go.Scatter(x=span, y=[drift["score_std"]] * 2, name="std of true scores", mode="lines",
                             line={"dash": "dash", "color": "#444"}, hoverinfo="skip"), secondary_y=False)
    fig.update_layout(title=f"q·k error under naive reuse, layer {layer} head {head}", xaxis_title="Δp (positions)",
                      height=380, legend={"orientation": "h", "y": -0.25})
    fig.update_yaxes(title_text="score error", secondary_y=False)
    fig.update_yaxes(title_text="TV distance", range=[0, 1], tickmode="auto", showgrid=False,  # not synced ticks
                     secondary_y=True)
    return fig


def deviation_figure(dev: pd.DataFrame, over: str) -> go.Figure:
    """Per-layer relative K and V deviation from full prefill, one line per strategy.

    ``over`` says which questions the lines are drawn from ("the last question", "mean over 4 questions"),
    so a page showing both never draws two charts with one title. A strategy at 0 on every layer (full prefill
    itself, an exact one) is named in the title instead: several lines along 0 would show only the last drawn. A
    line equal to lines drawn before it in its panel (re-rotation moves keys only, so recomposition's values are naive
    reuse's) is dashed, dotted, …, one pattern per line beneath, and each line is drawn wider, with larger markers,
    the more equal lines lie above it, so every one shows around and through those above it.
    """
    fig = make_subplots(rows=1, cols=2, subplot_titles=("keys ‖K−K_full‖/‖K_full‖", "values ‖V−V_full‖/‖V_full‖"))
    at_zero, lines = [], []
    for i, (name, group) in enumerate(dev.groupby("strategy", sort=False)):
        both = group[["K", "V"]]
        if both.notna().all().all() and float(both.abs().max().max()) <= ZERO_DEVIATION:
            at_zero.append(name)
        else:
            lines.append((i, name, group))
    # dashes and widths rather than the arena's side-by-side markers: across 30 layers an offset of a fraction of one
    # is too small to see, and on a narrow panel a dash between markers a few pixels apart reads as solid
    for col, what in ((1, "K"), (2, "V")):
        ys = [group[what].to_numpy() for _, _, group in lines]
        for k, ((i, name, group), y) in enumerate(zip(lines, ys)):
            same = [len(y) == len(d) and np.allclose(y, d, rtol=1e-3, equal_nan=True) for d in ys]
            above, beneath = sum(same[k + 1 :]), sum(same[:k])
            fig.add_trace(go.Scatter(x=group.layer, y=y, name=name, legendgroup=name, mode="lines+markers",
                                     line={"color": _COLORS[i % len(_COLORS)], "width": 2 + 3 * above,
                                           "dash": _DASHES[min(beneath, len(_DASHES) - 1)]},
                                     marker={"symbol": SYMBOLS[i % len(SYMBOLS)], "size": 6 + 4 * above},
                                     showlegend=col == 1),
                          row=1, col=col)
    fig.update_xaxes(title_text="layer")
    notes = [f"0 on every layer, not drawn: {', '.join(at_zero)}"] if at_zero else []
    fig.update_layout(**titled(f"Deviation of document-token KV from full prefill: {over}", notes, panels=True),
                      height=400)
    return fig


def tradeoff_figure(summary: pd.DataFrame, over: str) -> go.Figure:
    """Each strategy's TTFT speed-up (with its low–high range) against its mean KL from full prefill.

    One legend entry per strategy rather than text at the points: close points would print over each other.
    ``over`` names the questions summarised.
    """
    fig = go.Figure()
    for i, (_, row) in enumerate(summary.iterrows()):
        speed, low, high = row["speed-up"], row["speed-up low"], row["speed-up high"]
        fig.add_trace(go.Scatter(
            x=[speed], y=[row["mean KL"]], name=row["strategy"], mode="markers",
            # open, each its own shape: a strategy equal to full prefill (fixed ordering) sits on its very point
            marker={"size": 14, "color": _COLORS[i % len(_COLORS)], "symbol": f"{SYMBOLS[i % len(SYMBOLS)]}-open",
                    "line": {"width": 2.5}},
            error_x={"type": "data", "symmetric": False, "array": [high - speed], "arrayminus": [speed - low]},
            hovertemplate=f"%{{x:.2f}}× ({low:.2f}–{high:.2f}) · KL %{{y:.4f}} · top-1 {row['top-1']:.0%}"
                          f"<extra>{row['strategy']}</extra>",
        ))
    fig.add_vline(x=1.0, line_dash="dot", line_color="grey")
    ranged = bool((summary["speed-up high"] > summary["speed-up low"]).any())  # one timed run has no range
    bars = "bars: the speed-up's range over the timed runs" if ranged else "timed once: a single run, no range"
    fig.update_layout(title=f"Speed vs fidelity, {over} ({bars})",
                      xaxis_title="TTFT speed-up over full prefill (×)", yaxis_title="mean KL vs full prefill",
                      height=420, legend={"orientation": "h", "y": -0.25})
    return fig


def prefix_reuse_figure(sim: pd.DataFrame) -> go.Figure:
    """Prefix-cache hit rates for rank order vs id order as k grows."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("token hit rate", "queries reusing ≥ 1 whole document"))
    for i, (order, group) in enumerate(sim.groupby("order", sort=False)):
        color = _COLORS[i % len(_COLORS)]
        for col, what in ((1, "token hit rate"), (2, "query hit rate")):
            fig.add_trace(go.Scatter(x=group.k, y=group[what], name=f"{order} order", legendgroup=order,
                                     mode="lines+markers", line={"color": color}, showlegend=col == 1),
                          row=1, col=col)
    fig.update_xaxes(title_text="k (documents retrieved)", dtick=1)
    fig.update_yaxes(range=[0, 1])
    fig.update_layout(title="Fixed ordering: prefix-cache reuse over the question stream", height=380)
    return fig

