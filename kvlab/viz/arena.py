"""Figures for the policy arena, built from ``kvlab.experiments.tables``' summary tables (pure functions)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.viz import SIDE_BY_SIDE
from kvlab.viz.axes import log_axis_over, on_log_axis
from kvlab.viz.colours import policy_colour, policy_marker
from kvlab.viz.titles import titled

METRICS = {
    "accuracy": ("accuracy (answers found)", False),
    "kl": ("KL(Full ‖ policy), nats/token", True),
    "top1": ("top-1 agreement with Full", False),
}


HEADROOM = "oracle"  # drawn as the headroom line: what any eviction policy at that budget could still gain
# Markers and error bars side by side (``SIDE_BY_SIDE``) on linear and category axes; on a log₂ budget axis, where
# grouping would spread them unevenly, a shift of OCTAVE_STEP octaves apart (less where many policies would reach the
# next budget's points)
OCTAVE_STEP = 0.06


def _line(policy: str) -> dict:
    """Full dashed, the oracle's headroom long-dashed, every deployable policy solid."""
    return {"dash": "dash", "width": 2} if policy == "full" else (
        {"dash": "longdash", "width": 3} if policy == HEADROOM else {"width": 2})


def _name(policy: str, rows: pd.DataFrame) -> str:
    """The legend entry; a policy that failed says so (its failed points have no score and are not drawn)."""
    name = f"{policy}: headroom, not deployable" if policy == HEADROOM else policy
    return f"{name} (failed)" if rows["failed"].any() else name


def _error_bars(rows: pd.DataFrame, metric: str) -> dict | None:
    """The 95 % interval of ``metric`` as asymmetric error bars, where the table has one (``<metric>_low/_high``)."""
    if f"{metric}_low" not in rows:
        return None
    return {"type": "data", "symmetric": False, "array": (rows[f"{metric}_high"] - rows[metric]).tolist(),
            "arrayminus": (rows[metric] - rows[f"{metric}_low"]).tolist(), "thickness": 1, "width": 3}


CELL_CHARS = 10  # a line of a seed-table cell at 11 px: about 60 px, in a grid of eight columns or more
NOTHING_SCORED = "no answer to check in these workloads"


def _say_unscored(fig: go.Figure, values: pd.Series, panels: list[tuple[int, int]]) -> None:
    """Write in each (row, col) accuracy panel that nothing was scored where no turn had an answer to check: blank,
    such a panel reads as a chart that failed to draw."""
    if values.notna().any():
        return
    for row, col in panels:
        fig.add_annotation(text=NOTHING_SCORED, x=0.5, y=0.5, xref="x domain", yref="y domain", showarrow=False,
                           font={"color": "#777"}, row=row, col=col)


def _drawn(values: pd.Series, log: bool) -> pd.Series:
    """``values`` as a chart draws them: on a log axis a 0 (Full's KL, or a cache that has evicted nothing yet) is a
    gap in its line."""
    return on_log_axis(values) if log else values


ZERO_OFF_LOG = "0 (Full, or nothing evicted yet) is off the log axis"


def _budget_panels(budgets: list) -> go.Figure:
    """One panel per budget, side by side, sharing the y axis."""
    return make_subplots(rows=1, cols=max(len(budgets), 1), shared_yaxes=True,
                         subplot_titles=[f"budget {b}" for b in budgets], horizontal_spacing=0.03)


def _panel_cells(table: pd.DataFrame, budgets: list, log: bool) -> Iterator[tuple]:
    """Each (policy, budget) a per-turn chart draws: the policy's colour index, name and rows, the budget's panel
    column, the budget and the policy's rows at it by turn. Full is left out on a log axis: its KL is exactly 0."""
    for i, (policy, rows) in enumerate(table.groupby("policy", sort=False)):
        if log and policy == "full":
            continue
        for col, budget in enumerate(budgets, start=1):
            yield i, policy, rows, col, budget, rows[rows["budget"] == budget].sort_values("turn")


def per_turn_figure(per_turn: pd.DataFrame, metric: str = "accuracy") -> go.Figure:
    """One panel per budget: ``metric`` per turn, a line per policy.

    The SCBench question: does query-aware eviction (SnapKV, PyramidKV, H2O) hold on turn 1 and
    fall on later turns, when the question is about something turn 1 did not ask for?
    """
    label, log = METRICS[metric]
    budgets = sorted(per_turn["budget"].unique())
    fig = _budget_panels(budgets)
    for i, policy, rows, col, budget, r in _panel_cells(per_turn, budgets, log):
        fig.add_trace(go.Scatter(
            x=r["turn"], y=_drawn(r[metric], log), mode="lines+markers", error_y=_error_bars(r, metric),
            name=_name(policy, rows), legendgroup=policy, showlegend=col == 1, line=_line(policy), offsetgroup=policy,
            marker=policy_marker(policy, i), cliponaxis=False,  # a point on the axis's edge is drawn whole
            hovertemplate=f"{policy}, budget {budget}<br>turn %{{x}}<br>{metric} %{{y:.3g}}<extra></extra>",
        ), row=1, col=col)
    fig.update_xaxes(title_text="turn", dtick=1)
    fig.update_yaxes(title_text=label, row=1, col=1)
    if log:
        fig.update_yaxes(**log_axis_over(per_turn[metric]))
    elif metric in ("accuracy", "top1"):
        fig.update_yaxes(range=[-0.05, 1.05])
    if metric == "accuracy":
        _say_unscored(fig, per_turn[metric], [(1, col) for col in range(1, len(budgets) + 1)])
    spans = per_turn[f"{metric}_high"] - per_turn[f"{metric}_low"] if f"{metric}_low" in per_turn else None
    notes = [ZERO_OFF_LOG] * log + ([] if spans is None else ["bars: 95 % intervals"] if (spans > 0).any() else
                                    ["no bars: a point of one question has no interval"])
    if per_turn["turn"].max() == 1:  # single questions (RULER, one-turn SCBench): the question needs a later turn
        notes.insert(0, "every workload here has one turn: nothing after turn 1 to compare")
    fig.update_layout(**titled(f"{label} per turn: does query-aware eviction fall after turn 1?", notes, panels=True),
                      height=400, **SIDE_BY_SIDE, legend={"orientation": "h", "y": -0.25},
                      margin={"l": 60, "r": 20, "b": 60})
    return fig


def modes_figure(drop: pd.DataFrame, metric: str = "accuracy") -> go.Figure:
    """One panel per budget: ``metric`` per turn multi-turn (solid) and single-shot (dotted), a colour per policy.

    Built from ``kvlab.experiments.tables.mode_drop``. The gap between the two lines of a colour is what carrying
    the conversation costs that policy on that question; turn 1 is the same run in both modes.
    """
    label, log = METRICS[metric]
    budgets = sorted(drop["budget"].unique())
    fig = _budget_panels(budgets)
    for i, policy, _rows, col, budget, r in _panel_cells(drop, budgets, log):
        for mode, dash in (("multi-turn", "solid"), ("single-shot", "dot")):
            fig.add_trace(go.Scatter(
                x=r["turn"], y=_drawn(r[f"{metric} {mode}"], log), mode="lines+markers", name=f"{policy} {mode}",
                legendgroup=f"{policy} {mode}", showlegend=col == 1, line={"width": 2, "dash": dash},
                offsetgroup=f"{policy} {mode}",
                marker=policy_marker(policy, i),
                hovertemplate=(f"{policy} {mode}, budget {budget}<br>turn %{{x}}<br>{metric} %{{y:.3g}}"
                               "<extra></extra>"),
            ), row=1, col=col)
    fig.update_xaxes(title_text="turn", dtick=1)
    fig.update_yaxes(title_text=label, row=1, col=1)
    both = pd.concat([drop[f"{metric} {mode}"] for mode in ("multi-turn", "single-shot")])  # every value drawn
    if log:
        fig.update_yaxes(**log_axis_over(both))
    else:
        fig.update_yaxes(range=[-0.05, 1.05])
    if metric == "accuracy":
        _say_unscored(fig, both, [(1, col) for col in range(1, len(budgets) + 1)])
    # the turns that are the same run in both modes (``mode_drop``'s ``modes can differ``): shaded, and said
    same = drop.loc[~drop["modes can differ"], "turn"]
    if len(same):
        for col in range(1, len(budgets) + 1):
            fig.add_vrect(x0=same.min() - 0.4, x1=same.max() + 0.4, fillcolor="#999", opacity=0.15, line_width=0,
                          row=1, col=col)
    title = f"{label}: multi-turn (solid) vs single-shot (dotted)"
    notes = ["fine on one question, worse over turns?"]
    if len(same) == len(drop):
        title, notes = f"{label}: single-shot equals multi-turn by construction here", [f"no turn past {same.max()}"]
    elif len(same):
        span = f"turn {same.min()}" if same.min() == same.max() else f"turns {same.min()}–{same.max()}"
        notes.append(f"shaded: {span}, the same run in both modes")
    fig.update_layout(**titled(title, notes + [ZERO_OFF_LOG] * log, panels=True), height=420,
                      legend={"orientation": "h", "y": -0.25}, margin={"l": 60, "r": 20, "b": 60}, **SIDE_BY_SIDE)
    return fig


SHARE_STEP = 0.015  # how far apart (in shares of Full's bytes) the memory-equal chart draws points that coincide
EQUAL_AXES = (("held_share", "KV bytes held / Full's"),
              ("read_share_of_full", "bytes read per generated token / Full's"))


def _spread(summary: pd.DataFrame, x: str, metric: str) -> pd.Series:
    """Where each row of ``summary`` is drawn on the ``x`` axis of its ``metric`` panel: at its measured share, or,
    where several policies' points coincide (Full, Quest and KIVI at one share, with every answer), side by side
    around it, ``SHARE_STEP`` apart in the summary's policy order."""
    y = summary[metric].astype(float)
    if metric == "kl":  # a log axis: KLs coincide by their ratio, and a KL of 0 is not drawn at all
        y = np.log10(y.where(y > 0))
    spot = pd.DataFrame({"x": summary[x].round(3), "y": y.round(2), "policy": summary["policy"]})
    order = {p: i for i, p in enumerate(summary["policy"].unique())}
    shift = pd.Series(0.0, index=summary.index)
    for _, same in spot.groupby(["x", "y"], dropna=True):
        if same["policy"].nunique() > 1:
            rank = same["policy"].map(order).rank(method="dense") - 1  # [points here]
            shift[same.index] = (rank - rank.max() / 2) * SHARE_STEP
    return summary[x] + shift


def memory_equal_figure(summary: pd.DataFrame) -> go.Figure:
    """Accuracy (top) and KL (bottom) against KV bytes held (left) and bytes read per generated token
    (right), both as shares of Full's; a marker per policy and budget, from ``kvlab.experiments.tables.memory_equal``.

    The x positions are measured, so "keep 25 % of the tokens", "everything at 4 bits" and "read 25 % of
    the pages" land where their bytes put them; points of several policies at one spot stand side by side
    (``_spread``; the hover gives the measured share). Full sits at 1 (its KL, 0, is not drawn on the log axis).
    """
    fig = make_subplots(rows=2, cols=2, shared_xaxes="columns", shared_yaxes="rows", vertical_spacing=0.08,
                        horizontal_spacing=0.04)
    summary = summary.reset_index(drop=True)
    at = {(metric, x): _spread(summary if metric == "accuracy" else summary[summary["policy"] != "full"], x, metric)
          for metric in ("accuracy", "kl") for x, _ in EQUAL_AXES}
    for i, (policy, rows) in enumerate(summary.groupby("policy", sort=False)):
        r = rows.sort_values("budget")
        for row, metric in enumerate(("accuracy", "kl"), start=1):
            if metric == "kl" and policy == "full":
                continue
            for col, (x, _) in enumerate(EQUAL_AXES, start=1):
                fig.add_trace(go.Scatter(
                    x=at[metric, x].reindex(r.index), y=_drawn(r[metric], metric == "kl"), mode="markers+lines",
                    name=_name(policy, rows),
                    legendgroup=policy, showlegend=row == 1 and col == 1, text=[f"b{b}" for b in r["budget"]],
                    customdata=r[x], line=_line(policy) | {"width": 1},
                    marker=policy_marker(policy, i, size=9),
                    hovertemplate=(f"{policy}<br>budget %{{text}}<br>{x} %{{customdata:.2f}}<br>{metric} %{{y:.3g}}"
                                   "<extra></extra>"),
                ), row=row, col=col)
    for col, (_, title) in enumerate(EQUAL_AXES, start=1):
        fig.update_xaxes(title_text=title, row=2, col=col)
    fig.update_yaxes(title_text=METRICS["accuracy"][0], range=[-0.05, 1.05], row=1, col=1)
    _say_unscored(fig, summary["accuracy"], [(1, 1), (1, 2)])
    kl = summary.loc[summary["policy"] != "full", "kl"]
    kl = kl[kl > 0]
    # the log axis spans the drawn KLs (left to itself, plotly's range ran to 10^4 above KLs near 1)
    kl_range = None if kl.empty else [math.log10(kl.min()) - 0.15, math.log10(kl.max()) + 0.15]
    fig.update_yaxes(title_text=METRICS["kl"][0], range=kl_range, **log_axis_over(kl), row=2, col=1)
    fig.update_yaxes(range=kl_range, **log_axis_over(kl), row=2, col=2)
    fig.update_layout(**titled("Memory-equal: fidelity against measured bytes held and read (hover a point for its "
                               "budget)", ["Full's KL, 0, lies off the log axis"]),
                      height=620, legend={"orientation": "h", "y": -0.12}, margin={"l": 60, "r": 20, "b": 60})
    return fig


def fidelity_vs_budget_figure(summary: pd.DataFrame, unit: str = "tokens per layer per KV head") -> go.Figure:
    """KL, top-1 agreement and accuracy against the budget, a line per policy (log₂ budget axis)."""
    panels = ["kl", "top1", "accuracy"]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[METRICS[m][0] for m in panels], horizontal_spacing=0.08)
    groups = list(summary.groupby("policy", sort=False))
    octaves = np.diff(np.log2(np.unique(summary["budget"].to_numpy(dtype=float))))  # between neighbouring budgets
    step = min(OCTAVE_STEP, 0.5 * float(octaves.min(initial=1.0)) / len(groups))  # spread over half the gap at most
    for i, (policy, rows) in enumerate(groups):
        r = rows.sort_values("budget")
        shift = 2 ** ((i - (len(groups) - 1) / 2) * step)  # side by side on the log axis; hover the budget
        for col, metric in enumerate(panels, start=1):
            if metric == "kl" and policy == "full":
                continue
            fig.add_trace(go.Scatter(
                x=r["budget"] * shift, y=_drawn(r[metric], metric == "kl"), mode="lines+markers",
                name=_name(policy, rows), legendgroup=policy,
                showlegend=col == 2, error_y=_error_bars(r, metric), customdata=r["budget"],
                line=_line(policy), marker=policy_marker(policy, i),
                hovertemplate=f"{policy}<br>budget %{{customdata}}<br>{metric} %{{y:.3g}}<extra></extra>",
            ), row=1, col=col)
    ran = sorted(summary["budget"].unique())  # ticks at the budgets run, whatever their spacing (20 and 50 %)
    fig.update_xaxes(type="log", tickvals=ran, ticktext=[f"{b:g}" for b in ran], title_text=f"budget ({unit})")
    if len(summary):  # half an octave either side: one budget's points stand near its tick, not at the panel's edges
        budgets = summary["budget"].astype(float)
        fig.update_xaxes(range=[math.log10(budgets.min()) - 0.15, math.log10(budgets.max()) + 0.15])
    others = summary[summary["policy"] != "full"]
    kl = pd.concat([others[c] for c in ("kl", "kl_low", "kl_high") if c in others])  # the bars' ends too
    fig.update_yaxes(**log_axis_over(kl), row=1, col=1)
    fig.update_yaxes(range=[-0.05, 1.05], row=1, col=2)
    fig.update_yaxes(range=[-0.05, 1.05], row=1, col=3)
    _say_unscored(fig, summary["accuracy"], [(1, 3)])
    notes = ["bars: 95 % intervals of accuracy (Wilson) and KL (bootstrap)", ZERO_OFF_LOG]
    fig.update_layout(**titled("Fidelity vs budget, mean over workloads and turns", notes, panels=True),
                      height=400, legend={"orientation": "h", "y": -0.3}, margin={"l": 60, "r": 20, "b": 60})
    return fig


def memory_vs_fidelity_figure(memory: pd.DataFrame) -> go.Figure:
    """KV memory a paged allocator still reserves vs KL to Full, one marker per policy and budget.

    Policies keep the same number of tokens at a budget; what differs is how many blocks those
    tokens pin (holes left by importance scoring) and what they cost in fidelity. Full, exact and
    uncompressed, is the vertical line.
    """
    fig = go.Figure()
    groups = [(policy, rows, rows.dropna(subset=["paged_kib", "kl"]).sort_values("budget"))  # drop always-failed
              for policy, rows in memory.groupby("policy", sort=False)]
    # one policy's points carry the budget labels: the most spread out, whose labels stay clear of the others'
    spread = {p: r["paged_kib"].max() - r["paged_kib"].min() for p, _, r in groups if p != "full" and len(r)}
    labelled = max(spread, key=spread.get, default=None)
    for i, (policy, rows, r) in enumerate(groups):
        if policy == "full":
            mib = r["paged_kib"].mean() / 1024
            fig.add_vline(x=mib, line_dash="dash", line_color=policy_colour(policy, i),
                          annotation_text=f"Full: {mib:.1f} MiB, KL 0", annotation_position="top left")
            continue
        fig.add_trace(go.Scatter(
            x=r["paged_kib"] / 1024, y=_drawn(r["kl"], True), name=_name(policy, rows),
            mode="markers+lines" + ("+text" if policy == labelled else ""),
            text=[f"b{b}" for b in r["budget"]], textposition="top center", line=_line(policy) | {"width": 1},
            marker=policy_marker(policy, i, size=10),
            customdata=r[["budget", "kv_kib", "compression", "accuracy"]].to_numpy(),
            hovertemplate=(f"{policy}<br>budget %{{customdata[0]}}<br>paged %{{x:.2f}} MiB"
                           "<br>dense %{customdata[1]:.0f} KiB<br>kept share %{customdata[2]:.1%}"
                           "<br>KL %{y:.3g}<br>accuracy %{customdata[3]:.0%}<extra></extra>"),
        ))
    labels = f"budgets labelled on {labelled}'s points; " if labelled else ""
    fig.update_layout(title=f"Memory vs fidelity ({labels}lower left is better)",
                      xaxis_title="KV blocks reserved after a turn without compaction (MiB, mean)",
                      yaxis_title=METRICS["kl"][0], yaxis=log_axis_over(memory.loc[memory["policy"] != "full", "kl"]),
                      height=420, margin={"l": 60, "r": 20, "t": 60, "b": 50})
    return fig


def seed_table_figure(cells: pd.DataFrame, unit: str = "tokens") -> go.Figure:
    """The seed's table as a grid: families down, workload × budget across, coloured by the share of
    Full's answers kept (``kvlab.experiments.seed_table.seed_cells``); each cell is written as its mark.

    Cells with no measurement (not run, failed, not measured) are blank with their status written in; a
    workload not measured at any budget gets one column.
    """
    families = list(dict.fromkeys(cells["family"]))
    budgets = sorted(cells["budget"].unique())
    unmeasured = cells.groupby("workload", sort=False)["status"].agg(lambda s: (s == "not measured").all())
    columns = [(w, b) for w in unmeasured.index for b in (budgets[:1] if unmeasured[w] else budgets)]
    at = cells.set_index(["family", "workload", "budget"])
    grid = [[at.loc[(family, workload, budget)] for workload, budget in columns] for family in families]
    z = [[None if pd.isna(c["accuracy_of_full"]) else float(c["accuracy_of_full"]) for c in row] for row in grid]
    # a cell's words wrapped and at one size: plotly shrinks a line wider than its cell until it cannot be read
    text = [["<br>".join(textwrap.wrap(c["verdict"], CELL_CHARS)) if pd.isna(c["accuracy_of_full"])
             else f"{c['verdict']} {c['accuracy_of_full']:.0%}" for c in row] for row in grid]
    coloured = any(v is not None for row in z for v in row)
    scale = [[0, "#d62728"], [0.5, "#f2c14e"], [0.9, "#59a14f"], [1, "#2c7a2c"]]
    if not coloured:  # plotly draws no cell, and so no cell's words, for a grid without one value: a blank grid
        z, scale = [[0.0] * len(columns) for _ in families], [[0, "white"], [1, "white"]]
    names = ["<br>".join(textwrap.wrap(f, 26)) for f in families]  # two lines, the scale below: cells keep room
    fig = go.Figure(go.Heatmap(
        z=z, x=[w if unmeasured[w] else f"{w} · {b}" for w, b in columns], y=names, text=text,
        texttemplate="%{text}", textfont={"size": 11}, customdata=[[c["cell"] for c in row] for row in grid],
        hovertemplate="%{y}<br>%{x}<br>%{customdata}<extra></extra>", zmin=0, zmax=1, xgap=2, ygap=2,
        colorscale=scale, showscale=coloured, colorbar=dict(title="share of Full's answers", tickformat=".0%",
                                                            orientation="h", y=-0.35, yanchor="top", thickness=12)))
    fig.update_layout(height=220 + 48 * len(families), margin=dict(l=10, r=20, t=30 + 30 * (not coloured), b=150),
                      plot_bgcolor="white", title=None if coloured else (
                          "No cell has a share of Full's answers to colour: each says why (hover for its numbers)"))
    fig.update_xaxes(title=f"workload · budget ({unit})", type="category")
    fig.update_yaxes(autorange="reversed", type="category", automargin=True)
    return fig


def _held_name(name: str, rows: pd.DataFrame) -> str:
    """A legend entry with the share of Full's bytes its cells held: a policy no budget bounds (DuoAttention's
    retrieval heads keep every key) stands beside the others at one budget while holding several times their bytes."""
    held = rows["held_share"].dropna()
    if held.empty:
        return name
    low, high = f"{100 * held.min():.0f}", f"{100 * held.max():.0f}"
    return f"{name} · held {low if low == high else f'{low}–{high}'}% of Full's bytes"


def seed_headroom_figure(cells: pd.DataFrame, unit: str = "tokens") -> go.Figure:
    """The seed's table as lines: each family's share of Full's answers (95 % Wilson bars) against the budget, one
    panel per mode, with the oracle long-dashed as the headroom line — what any eviction policy at that budget
    could still gain. The hover says how far each family is below the oracle. Unmeasured cells are not drawn."""
    measured = cells[cells["status"] == "measured"].dropna(subset=["accuracy_of_full"])
    modes = list(dict.fromkeys(measured["workload"])) or ["multi-turn"]
    fig = make_subplots(rows=1, cols=len(modes), shared_yaxes=True, subplot_titles=modes, horizontal_spacing=0.04)
    for col, mode in enumerate(modes, start=1):
        at_mode = measured[measured["workload"] == mode]
        oracle = at_mode[at_mode["policy"] == HEADROOM].set_index("budget")["accuracy_of_full"]
        for i, (family, rows) in enumerate(at_mode.groupby("family", sort=False)):
            rows = rows.sort_values("budget")
            headroom = rows["policy"].eq(HEADROOM).all()
            line = _line(HEADROOM) | {"color": "black"} if headroom else {
                "width": 2, "color": policy_colour(rows["policy"].iloc[0], i)}
            gap = [f"oracle {oracle[b]:.0%}: {100 * (oracle[b] - a):+.0f} points of headroom" if b in oracle
                   else "oracle not run at this budget" for b, a in zip(rows["budget"], rows["accuracy_of_full"])]
            gap = [f"{g}<br>held {h:.0%} of Full's bytes" if pd.notna(h) else g
                   for g, h in zip(gap, rows["held_share"])]
            fig.add_trace(go.Scatter(
                x=[f"{b:g}" for b in rows["budget"]], y=rows["accuracy_of_full"], mode="lines+markers",
                name=_held_name(f"{family}: headroom" if headroom else family, measured[measured["family"] == family]),
                legendgroup=family, showlegend=col == 1,
                line=line, offsetgroup=family,
                error_y=_error_bars(rows.rename(columns={"share_low": "accuracy_of_full_low",
                                                         "share_high": "accuracy_of_full_high"}), "accuracy_of_full"),
                customdata=[[p, g] for p, g in zip(rows["policy"], gap)],
                hovertemplate=f"{family}<br>budget %{{x}}: %{{y:.0%}} of Full's answers (%{{customdata[0]}})"
                              + ("" if headroom else "<br>%{customdata[1]}") + "<extra></extra>"), row=1, col=col)
        fig.update_xaxes(title=f"budget ({unit})", type="category", row=1, col=col)
    fig.update_yaxes(title="share of Full's answers kept", tickformat=".0%", range=[-0.03, 1.05], row=1, col=1)
    title = ("Each family's best member against the oracle's headroom (dashed, not deployable)"
             if measured["policy"].eq(HEADROOM).any() else
             "Each family's best member (add the oracle to the run to see the headroom above them)")
    if measured.empty:
        title = "Each family's best member against the oracle's headroom"
        fig.add_annotation(text="Nothing to draw: no family has a share of Full's answers here<br>(Full answered none, "
                                "no answers to check, or no cell measured; the table above says which)",
                           x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font={"size": 13})
    fig.update_layout(title=title, height=500, margin={"l": 60, "r": 20, "t": 70, "b": 50},  # legend below: long names
                      legend={"font": {"size": 11}, "orientation": "h", "y": -0.16, "yanchor": "top"}, **SIDE_BY_SIDE)
    return fig
