"""Figures for the policy arena, built from ``kvlab.arena``'s summary tables (pure functions)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.viz.chat import POLICY_COLOURS

_SYMBOLS = ["circle", "square", "diamond", "triangle-up", "cross", "x", "star", "hexagon"]
METRICS = {
    "accuracy": ("accuracy (answers found)", False),
    "kl": ("KL(Full ‖ policy), nats/token", True),
    "top1": ("top-1 agreement with Full", False),
}


def _colour(policy: str, i: int) -> str:
    return POLICY_COLOURS.get(policy, _fallback(i))


def _fallback(i: int) -> str:
    return ["#e377c2", "#7f7f7f", "#bcbd22", "#aec7e8"][i % 4]


def _line(policy: str) -> dict:
    return {"dash": "dash", "width": 2} if policy == "full" else {"width": 2}


def per_turn_figure(per_turn: pd.DataFrame, metric: str = "accuracy") -> go.Figure:
    """One panel per budget: ``metric`` per turn, a line per policy.

    The SCBench question: does query-aware eviction (SnapKV, PyramidKV, H2O) hold on turn 1 and
    fall on later turns, when the question is about something turn 1 did not ask for?
    """
    label, log = METRICS[metric]
    budgets = sorted(per_turn["budget"].unique())
    fig = make_subplots(rows=1, cols=max(len(budgets), 1), shared_yaxes=True,
                        subplot_titles=[f"budget {b}" for b in budgets], horizontal_spacing=0.03)
    for i, (policy, rows) in enumerate(per_turn.groupby("policy", sort=False)):
        for col, budget in enumerate(budgets, start=1):
            r = rows[rows["budget"] == budget].sort_values("turn")
            fig.add_trace(go.Scatter(
                x=r["turn"], y=r[metric].clip(lower=1e-6) if log else r[metric], mode="lines+markers",
                name=policy, legendgroup=policy, showlegend=col == 1, line=_line(policy),
                marker={"color": _colour(policy, i), "symbol": _SYMBOLS[i % len(_SYMBOLS)]},
                hovertemplate=f"{policy}, budget {budget}<br>turn %{{x}}<br>{metric} %{{y:.3g}}<extra></extra>",
            ), row=1, col=col)
    fig.update_xaxes(title_text="turn", dtick=1)
    fig.update_yaxes(title_text=label, row=1, col=1)
    if log:
        fig.update_yaxes(type="log")
    elif metric in ("accuracy", "top1"):
        fig.update_yaxes(range=[-0.05, 1.05])
    fig.update_layout(title=f"{label} per turn — does query-aware eviction fall after turn 1?", height=380,
                      legend={"orientation": "h", "y": -0.25}, margin={"l": 60, "r": 20, "t": 70, "b": 60})
    return fig


def fidelity_vs_budget_figure(summary: pd.DataFrame) -> go.Figure:
    """KL, top-1 agreement and accuracy against the budget, a line per policy (log₂ budget axis)."""
    panels = ["kl", "top1", "accuracy"]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[METRICS[m][0] for m in panels], horizontal_spacing=0.08)
    for i, (policy, rows) in enumerate(summary.groupby("policy", sort=False)):
        r = rows.sort_values("budget")
        for col, metric in enumerate(panels, start=1):
            y = r[metric].clip(lower=1e-6) if metric == "kl" else r[metric]
            fig.add_trace(go.Scatter(
                x=r["budget"], y=y, mode="lines+markers", name=policy, legendgroup=policy, showlegend=col == 1,
                line=_line(policy), marker={"color": _colour(policy, i), "symbol": _SYMBOLS[i % len(_SYMBOLS)]},
                hovertemplate=f"{policy}<br>budget %{{x}}<br>{metric} %{{y:.3g}}<extra></extra>",
            ), row=1, col=col)
    fig.update_xaxes(type="log", dtick=0.30103, title_text="budget (tokens per layer per KV head)")
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_yaxes(range=[-0.05, 1.05], row=1, col=2)
    fig.update_yaxes(range=[-0.05, 1.05], row=1, col=3)
    fig.update_layout(title="Fidelity vs budget (mean over workloads and turns; Full's KL is 0, drawn at 1e-6)",
                      height=380, legend={"orientation": "h", "y": -0.3}, margin={"l": 60, "r": 20, "t": 70, "b": 60})
    return fig


def memory_vs_fidelity_figure(memory: pd.DataFrame) -> go.Figure:
    """KV memory held vs KL to Full, one marker per policy and budget (labelled with the budget)."""
    fig = go.Figure()
    for i, (policy, rows) in enumerate(memory.groupby("policy", sort=False)):
        r = rows.sort_values("budget")
        fig.add_trace(go.Scatter(
            x=r["kv_kib"] / 1024, y=r["kl"].clip(lower=1e-6), mode="markers+text+lines", name=policy,
            text=[str(b) for b in r["budget"]], textposition="top center", line=_line(policy) | {"width": 1},
            marker={"color": _colour(policy, i), "symbol": _SYMBOLS[i % len(_SYMBOLS)], "size": 10},
            customdata=r[["budget", "compression", "accuracy"]].to_numpy(),
            hovertemplate=(f"{policy}<br>budget %{{customdata[0]}}<br>KV %{{x:.2f}} MiB"
                           "<br>kept share %{customdata[1]:.1%}<br>KL %{y:.3g}<br>accuracy %{customdata[2]:.0%}"
                           "<extra></extra>"),
        ))
    fig.update_layout(title="Memory vs fidelity (labels: budget; lower left is better)",
                      xaxis_title="KV cache held after a turn (MiB, mean)", yaxis_title=METRICS["kl"][0],
                      yaxis_type="log", height=420, margin={"l": 60, "r": 20, "t": 60, "b": 50})
    return fig
