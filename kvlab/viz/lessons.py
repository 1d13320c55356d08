"""Figures of the Lessons page that the other pages do not draw (pure functions of a lesson's record)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.policies.memory import MIB
from kvlab.viz import SIDE_BY_SIDE
from kvlab.viz.chat import retained_map
from kvlab.viz.colours import policy_colour, policy_marker

SPAN_COLOUR = "#d62728"


def sink_layers_figure(result: dict) -> go.Figure:
    """Per layer: attention share on the first tokens, and on the most attended other token."""
    share = result["first_share"]
    layers = [f"L{i}" for i in range(len(share))]
    other = result["other"]
    fig = go.Figure([
        go.Bar(x=layers, y=share, name=f"first {result['sink_tokens']} tokens", marker_color="#4e79a7",
               hovertemplate="%{x}: %{y:.1%} on the first tokens<extra></extra>"),
        go.Bar(x=layers, y=[o["share"] for o in other], name="most attended other token", marker_color="#f28e2b",
               customdata=[[o["token"], o["position"]] for o in other],
               hovertemplate="%{x}: %{y:.1%} on %{customdata[0]|s} (position %{customdata[1]})<extra></extra>"),
    ])
    uniform = result["sink_tokens"] / result["tokens"]  # named in the legend: a label on the line sat on the bars
    fig.add_hline(y=uniform, line_dash="dot", showlegend=True,
                  name=f"uniform share of the first {result['sink_tokens']} ({uniform:.1%})")
    fig.update_layout(title=f"Where the last {result['queries']} queries look, per layer (mean over heads)",
                      barmode="group", yaxis_tickformat=".0%", yaxis_title="share of attention", height=380,
                      legend={"orientation": "h", "y": -0.2}, margin={"l": 50, "r": 20, "t": 50, "b": 40})
    return fig


def retained_with_span(
    retained: list[list[list[int]]], total: int, segments: list[dict], texts: list[str], span: list[int], title: str,
) -> go.Figure:
    """``retained_map`` with the token's text on hover and a marked span (the planted fact)."""
    fig = retained_map(retained, total, segments, title, texts=texts)
    if span:
        fig.add_vrect(x0=span[0] - 0.5, x1=span[-1] + 0.5, line={"color": SPAN_COLOUR, "width": 2},
                      fillcolor="rgba(0,0,0,0)", annotation_text="fact", annotation_position="outside top",
                      annotation_font_color=SPAN_COLOUR)  # above the map: inside, it covered layer 0's cells
    return fig


def outcome(case: dict) -> str:
    """A policy's answer to a lesson's question in a word: recalled, missed, or failed."""
    return "failed" if case.get("error") else "recalled" if case["correct"] else "missed"


def fact_kept_figure(result: dict, labels: dict[str, str]) -> go.Figure:
    """Per policy: share of the fact's keys it held when the question came, and whether it recalled it."""
    names = list(result["policies"])
    pols = result["policies"]
    fig = go.Figure(go.Bar(
        x=[labels.get(n, n) for n in names], y=[pols[n]["kept_share"] for n in names],
        marker_color=[policy_colour(n, i) for i, n in enumerate(names)],
        text=[outcome(pols[n]) for n in names],
        textposition="outside",
        customdata=[pols[n]["reply"] for n in names],
        hovertemplate="%{x}: %{y:.0%} of the fact's keys held<br>reply: %{customdata}<extra></extra>",
    ))
    fig.update_layout(title=f"Who still held the fact ({result['fact']}) when the question came, and who recalled it",
                      yaxis_range=[0, 1.15], yaxis_tickformat=".0%",
                      yaxis_title="fact's keys held (all layers, KV heads)",
                      height=360, margin={"l": 50, "r": 20, "t": 50, "b": 40})
    return fig


def spread_budget_figure(result: dict, labels: dict[str, str]) -> go.Figure:
    """Full's attention spread per layer (keys for 90% of it) next to SnapKV's and PyramidKV's layer budgets.

    One axis: both are counts of tokens, so a budget below a bar means the layer cannot keep what it attends to.
    """
    spread = result["spread"]
    layers = list(range(len(spread)))
    fig = go.Figure(go.Bar(x=layers, y=spread, name="keys holding 90% of Full's attention", marker_color="#bab0ac",
                           opacity=0.7))
    for i, (name, budgets) in enumerate(result["layer_budgets"].items()):
        fig.add_trace(go.Scatter(x=layers, y=budgets, mode="lines", name=f"{labels.get(name, name)} budget",
                                 line={"color": policy_colour(name, i), "shape": "hvh", "width": 3}))
    fig.update_layout(title="Layer budgets vs how widely each layer attends (at the question)", height=380,
                      xaxis_title="layer", yaxis_title="tokens", yaxis_rangemode="tozero",
                      legend={"orientation": "h", "y": -0.25}, margin={"l": 50, "r": 20, "t": 50, "b": 40})
    return fig


def recompute_figure(points: list[dict]) -> go.Figure:
    """CacheBlend: mean KL to full prefill and answers right against the share of tokens recomputed."""
    shares = [p["share"] for p in points]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=shares, y=[p["kl"] for p in points], mode="lines+markers",
                             name="mean KL to full prefill",
                             line={"color": "#4e79a7"}), secondary_y=False)
    fig.add_trace(go.Bar(x=shares, y=[p["right"] / p["n"] for p in points], name="answers right", opacity=0.35,
                         marker_color="#59a14f", width=0.02), secondary_y=True)
    fig.update_xaxes(title_text="share of document tokens recomputed (0: re-rotated reuse)", tickformat=".0%",
                     tickvals=shares, range=[-0.03, max(shares) + 0.03])  # the shares run, and no negative share
    fig.update_yaxes(title_text="KL (nats)", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="answers right", range=[0, 1], tickvals=[0, 0.5, 1], tickformat=".0%",
                     showgrid=False, secondary_y=True)
    fig.update_layout(title="What recomputing buys back", height=360, legend={"orientation": "h", "y": -0.25},
                      margin={"l": 50, "r": 50, "t": 50, "b": 40})
    return fig


def reuse_figure(edits: list[dict]) -> go.Figure:
    """Per edit: tokens reused from the prefix and tokens prefilled again (stacked)."""
    labels = [e["label"] for e in edits]
    fig = go.Figure([
        go.Bar(x=labels, y=[e["reused"] for e in edits], name="reused (prefix before the edit)",
               marker_color="#4e79a7"),
        go.Bar(x=labels, y=[e["suffix"] for e in edits], name="prefilled again (from the edit on)",
               marker_color="#e15759"),
    ])
    fig.update_layout(barmode="stack", title="Prefix reuse after an edit", yaxis_title="tokens", height=360,
                      legend={"orientation": "h", "y": -0.2}, margin={"l": 50, "r": 20, "t": 50, "b": 40})
    return fig



def recall_interval_figure(rates: dict[str, tuple[int, int, float, float]], labels: dict[str, str],
                           title: str) -> go.Figure:
    """Per policy: the share of questions it recalled, with its 95 % Wilson interval as error bars.

    ``rates`` maps a policy's name to (recalled, questions, interval low, interval high); a policy with no
    questions is drawn empty and written 0/0.
    """
    names = list(rates)
    share = [h / n if n else None for h, n, _, _ in rates.values()]
    counts = [f"{h}/{n}" for h, n, _, _ in rates.values()]
    fig = go.Figure(go.Bar(  # the counts under the bars: above them, they sat on the error bars
        x=[f"{labels.get(n, n)}<br>{c}" for n, c in zip(names, counts)], y=share,
        marker_color=[policy_colour(n, i) for i, n in enumerate(names)],
        error_y={"type": "data", "symmetric": False,
                 "array": [0 if s is None else hi - s for s, (_, _, _, hi) in zip(share, rates.values())],
                 "arrayminus": [0 if s is None else s - lo for s, (_, _, lo, _) in zip(share, rates.values())]},
        customdata=[[labels.get(n, n), c] for n, c in zip(names, counts)],
        hovertemplate="%{customdata[0]}: %{y:.0%} recalled (%{customdata[1]})<extra></extra>"))
    fig.update_layout(title=title, yaxis_range=[0, 1.05], yaxis_tickformat=".0%",
                      yaxis_title="recalled (95 % interval)", height=380, margin={"l": 50, "r": 20, "t": 50, "b": 60})
    return fig


def case_grid_figure(policies: list[str], cases: list[str], cells: list[list[dict]]) -> go.Figure:
    """Policy × question: green where it recalled the fact, red where it missed, blank where it failed; each cell
    written with the share of the fact's keys it held when the question came. ``cells[i][j]`` is policy i's record
    of question j (``correct``, ``kept_share``, ``error``)."""
    z = [[None if c["error"] else float(bool(c["correct"])) for c in row] for row in cells]
    def written(c: dict) -> str:
        if c["error"]:
            return "failed"
        held = "" if c["kept_share"] is None else f" {100 * c['kept_share']:.0f}%"  # None: nothing to count
        return ("✓" if c["correct"] else "✗") + held

    text = [[written(c) for c in row] for row in cells]
    fig = go.Figure(go.Heatmap(z=z, x=cases, y=policies, text=text, texttemplate="%{text}", zmin=0, zmax=1,
                               colorscale=[[0, "#f4a6a6"], [1, "#9fd89f"]], showscale=False, xgap=2, ygap=2,
                               hovertemplate="%{y}, %{x}: %{text} of the fact's keys held<extra></extra>"))
    fig.update_layout(title="Each question: recalled (✓) or missed (✗), and the fact's keys still held",
                      yaxis_autorange="reversed", height=80 + 40 * len(policies),
                      margin={"l": 120, "r": 20, "t": 50, "b": 40})
    return fig


def bytes_per_turn_figure(held: dict[str, list[int | None]], labels: dict[str, str], budget_bytes: int,
                          title: str) -> go.Figure:
    """K/V bytes each policy (by name) held after each turn, in MiB, with the byte budget as a dotted line;
    Full dashed, the oracle long-dashed (not deployable). Policies that fill the budget alike (SnapKV, KVzip and the
    oracle at it on every turn) stand side by side around each turn, each with its own symbol."""
    fig = go.Figure()
    dash = {"full": "dash", "oracle": "longdash"}
    for i, (name, values) in enumerate(held.items()):
        fig.add_trace(go.Scatter(x=list(range(1, len(values) + 1)),
                                 y=[None if v is None else v / MIB for v in values], mode="lines+markers",
                                 name=labels.get(name, name), offsetgroup=name,
                                 marker=policy_marker(name, i, size=8),
                                 line={"color": policy_colour(name, i), "dash": dash.get(name, "solid")}))
    fig.add_hline(y=budget_bytes / MIB, line_dash="dot", annotation_text="budget")
    fig.update_layout(title=title, xaxis_title="turn", yaxis_title="MiB of K/V held", yaxis_rangemode="tozero",
                      height=360, legend={"orientation": "h", "y": -0.25}, margin={"l": 50, "r": 20, "t": 50, "b": 40},
                      xaxis_dtick=1, **SIDE_BY_SIDE)
    return fig
