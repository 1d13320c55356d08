"""Figures for the multi-turn chat page, built from the engine's turn records (pure functions)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Callable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.engine.cache import common_prefix
from kvlab.engine.head_patterns import METHOD_WORDS, HeadPattern
from kvlab.viz import SIDE_BY_SIDE
from kvlab.viz.colours import policy_colour, policy_marker
from kvlab.viz.titles import titled

# a colour per turn, 20 before they repeat: Tableau's ten, then ten darker ones, each pair ΔE ≥ 25 apart in CIELAB
TURN_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
                "#bab0ac", "#0000ee", "#ee00cc", "#4466ee", "#ee0000", "#224422", "#aa0066", "#660088", "#666600",
                "#884400", "#cc66cc"]
MARK = "background:#ffd54f;border-radius:2px"  # the first token where a reply leaves Full's
def token_turns(segments: list[dict], total: int) -> np.ndarray:
    """[total] the turn each original token belongs to."""
    turn = np.zeros(total, dtype=int)
    for seg in segments:
        turn[seg["start"]: seg["end"]] = seg["turn"]
    return turn


def sink_heatmap(sink_mass: list[list[float]], sink_tokens: int, title: str, notes: Sequence[str] = ()) -> go.Figure:
    """Layer × head heatmap of the attention share the last queries put on the first tokens; ``notes`` beneath
    the title."""
    z = np.asarray(sink_mass)  # [layers, heads]
    fig = go.Figure(go.Heatmap(
        z=z, x=[f"h{h}" for h in range(z.shape[1])], y=[f"L{layer}" for layer in range(z.shape[0])],
        zmin=0, zmax=1, colorscale="Viridis", colorbar={"title": "share"},
        hovertemplate=f"layer %{{y}}, head %{{x}}<br>attention on first {sink_tokens} tokens: "
                      "%{z:.1%}<extra></extra>",
    ))
    return _layer_rows(fig, title, notes, z.shape[0])


def _layer_rows(fig: go.Figure, title: str, notes: Sequence[str], n_layers: int) -> go.Figure:
    """A layer × head heatmap's layout under ``title`` and its ``notes``: a row per layer, layer 0 on top."""
    fig.update_layout(**titled(title, notes), height=max(320, 14 * n_layers + 120), margin={"l": 50, "r": 20, "b": 40})
    fig.update_yaxes(autorange="reversed")
    return fig


def duo_heads_figure(pattern: HeadPattern, head_compression_ratio: float = 0.5) -> go.Figure:
    """Layer × KV-head heatmap of DuoAttention's gates, each retrieval head marked "R" (at that share of
    streaming heads); the title says how the pattern was found and what finding it cost."""
    z = pattern.gates.numpy()  # [layers, kv_heads]
    retrieval = pattern.retrieval(head_compression_ratio).numpy()
    fig = go.Figure(go.Heatmap(
        z=z, x=[f"kv{h}" for h in range(z.shape[1])], y=[f"L{layer}" for layer in range(z.shape[0])],
        text=np.where(retrieval, "R", ""), texttemplate="%{text}", zmin=0, zmax=1, colorscale="Viridis",
        colorbar={"title": "gate α"},
        customdata=np.where(retrieval, "retrieval head: keeps every key", "streaming head: sinks + recent"),
        hovertemplate="layer %{y}, KV head %{x}<br>gate %{z:.3f}<br>%{customdata}<extra></extra>",
    ))
    return _layer_rows(fig, f"DuoAttention heads: R = {int(retrieval.sum())} retrieval of {retrieval.size}",
                       [pattern.model, f"{METHOD_WORDS[pattern.method]}, {pattern.seconds:.0f} s"], z.shape[0])


def attention_profile(profile: list[list[float]], layer: int, segments: list[dict]) -> go.Figure:
    """Mean attention of the last queries over key positions for one layer, shaded by turn."""
    y = np.asarray(profile[layer])
    x = np.arange(len(y))
    fig = go.Figure()
    for seg in segments:
        if seg["end"] > seg["start"]:
            colour = TURN_COLOURS[seg["turn"] % len(TURN_COLOURS)] if seg["role"] == "user" else "#888888"
            fig.add_vrect(x0=seg["start"] - 0.5, x1=min(seg["end"], len(y)) - 0.5, line_width=0, opacity=0.25,
                          layer="below", fillcolor=colour)
    fig.add_trace(go.Scatter(x=x, y=np.maximum(y, 1e-6), mode="lines", line={"color": "#222", "width": 1},
                             hovertemplate="position %{x}<br>attention %{y:.4f}<extra></extra>", name="attention"))
    # the title's detail on a line of its own: on one line, a narrow window cut it
    fig.update_layout(**titled(f"Attention profile, layer {layer}",
                               ["the user message's last queries, mean over heads"]),
                      xaxis_title="key position (shaded: user turns coloured, replies grey)",
                      yaxis_title="attention", height=340, showlegend=False, plot_bgcolor="white",
                      margin={"l": 50, "r": 20, "b": 40})
    # one labelled tick per decade, as powers of ten: plotly's own log ticks label 2 and 5 within each decade,
    # which read as "5, 2, 0.1, 5, 2"
    fig.update_yaxes(type="log", dtick=1, exponentformat="power", showexponent="all")
    return fig


def layer_labels(n_layers: int, windows: tuple[int | None, ...] = ()) -> list[str]:
    """Row labels per layer; a sliding layer says its trained window (``windows[layer]``, None: full attention)."""
    return [f"L{layer} · window {windows[layer]}" if windows and windows[layer] else f"L{layer}"
            for layer in range(n_layers)]


def retained_map(
    retained: list[list[list[int]]], total: int, segments: list[dict], title: str,
    windows: tuple[int | None, ...] = (), texts: list[str] | None = None,
) -> go.Figure:
    """Original position × layer: which tokens a policy still holds, coloured by the turn they came from.

    A cell's shade is the share of KV heads that keep the token (heads select independently; the legend
    says so). ``windows`` marks the model's sliding layers, whose own window drops keys whatever the policy.
    ``texts`` (one string per original token) puts each token's text in the hover.
    """
    layers = len(retained)
    kept = np.zeros((layers, total))
    for layer, heads in enumerate(retained):
        for positions in heads:
            kept[layer, positions] += 1.0 / len(heads)
    turn = token_turns(segments, total)
    n_turns = int(turn.max()) + 1 if total else 1
    # integer part: turn, fraction: head share; float32 and whole percents keep an animation's frames small
    z = np.where(kept > 0, turn[None, :] + kept * 0.999, np.nan).astype(np.float32)
    share = np.rint(kept * 100).astype(np.uint8)  # [layers, total] % of KV heads
    colours = [TURN_COLOURS[t % len(TURN_COLOURS)] for t in range(n_turns)]
    scale = []
    for t, c in enumerate(colours):
        lo, hi = t / n_turns, (t + 1) / n_turns
        scale += [[lo, _fade(c)], [hi - 1e-9 if t + 1 < n_turns else hi, c]]
    hover = "layer %{y}, position %{x}<br>kept by %{customdata}% of KV heads<extra></extra>"
    words = None
    if texts is not None:
        row = np.array([repr(t)[1:-1] for t in texts[:total]] + [""] * max(0, total - len(texts)), dtype=object)
        words = np.tile(row, (layers, 1))  # [layers, total]
        hover = "layer %{y}, position %{x}: “%{text}”<br>kept by %{customdata}% of KV heads<extra></extra>"
    fig = go.Figure(go.Heatmap(
        z=z, x=np.arange(total), y=layer_labels(layers, windows), zmin=0, zmax=n_turns,
        colorscale=scale, showscale=False, customdata=share, text=words, hovertemplate=hover,
    ))
    for t, c in enumerate(colours):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers",
                                 marker={"color": c, "size": 10, "symbol": "square"},
                                 name=f"turn {t + 1}"))
    fig.update_layout(title=title, xaxis_title="original token position (blank: evicted)", height=420,
                      plot_bgcolor="white", legend={"orientation": "h", "y": -0.2},
                      # the title above the entries: beside them it takes the width the entries wrap in
                      legend_title={"text": "the turn it came from (pale: kept by some KV heads only)" + (
                          f"; colours repeat every {len(TURN_COLOURS)} turns" if n_turns > len(TURN_COLOURS) else ""),
                          "side": "top"},
                      margin={"l": 50, "r": 20, "t": 50, "b": 40})
    fig.update_yaxes(autorange="reversed")
    return fig


def retained_animation(
    turns: list[dict], title: str, windows: tuple[int | None, ...] = (), texts: list[str] | None = None,
    active: int | None = None,
) -> go.Figure:
    """The retained map after each finished turn as plotly frames, with a turn slider and Play / Pause.

    ``turns``: per finished turn ``{"retained", "total", "segments"}``; frame k (named ``str(k)``) holds
    ``retained_map``'s data for turn k, less the token texts: those sit once in the figure's heatmap, for
    the last turn's tokens, and a frame that does not set them keeps them (a token's text never changes).
    The figure opens on turn ``active`` (1-based, default the last); the x axis spans the last turn's
    tokens, so eviction reads as cells going blank over time.
    """
    if not turns:
        raise ValueError("an animation needs at least one finished turn")
    last = len(turns)
    # the texts are built once, for the last turn: they are the only part of a map that every frame shares
    maps = [retained_map(t["retained"], t["total"], t["segments"], f"{title} after turn {k}", windows,
                         texts if k == last else None)
            for k, t in enumerate(turns, start=1)]
    shown = maps[(active or len(maps)) - 1]
    # the last map's legend: a frame replaces only the traces it holds, so every turn's entry must exist from the start
    heat = go.Heatmap(shown.data[0])
    heat.update(text=maps[-1].data[0].text, hovertemplate=maps[-1].data[0].hovertemplate)
    fig = go.Figure(data=[heat, *maps[-1].data[1:]], layout=shown.layout)
    for m in maps:
        m.data[0].update(text=None, hovertemplate=heat.hovertemplate)
    fig.frames = [go.Frame(data=m.data, name=str(k), layout={"title": {"text": m.layout.title.text}})
                  for k, m in enumerate(maps, start=1)]
    still = {"frame": {"duration": 0, "redraw": True}, "mode": "immediate", "transition": {"duration": 0}}
    # room above for the title and the legend, its title and its rows of turns at eight a row (an 800 px chart);
    # below, the buttons on a row of their own above a full-width slider (beside it, at a narrow window, they
    # would cover its start and its label)
    top = 50 + 20 * (1 + -(-len(maps[-1].data[1:]) // 8))
    fig.update_layout(
        height=510 + top, margin={"l": 50, "r": 20, "t": top, "b": 190},
        title={"y": 1, "yref": "container", "yanchor": "top", "pad": {"t": 12}},  # above the legend's rows
        legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
        xaxis={"range": [-0.5, turns[-1]["total"] - 0.5],
               "title": {"text": "original token position (blank: evicted)"}},
        updatemenus=[{
            "type": "buttons", "direction": "left", "x": 0, "y": -0.2, "xanchor": "left", "yanchor": "top",
            "pad": {"t": 10, "r": 10}, "showactive": False,
            "buttons": [
                {"label": "▶ Play", "method": "animate",
                 "args": [None, {"frame": {"duration": 900, "redraw": True}, "fromcurrent": True,
                                 "transition": {"duration": 0}}]},
                {"label": "❚❚ Pause", "method": "animate", "args": [[None], still]},
            ],
        }],
        sliders=[{
            "active": (active or len(maps)) - 1, "x": 0, "len": 1, "y": -0.36, "yanchor": "top",
            "pad": {"t": 10}, "currentvalue": {"prefix": "after turn "},
            "steps": [{"label": str(k), "method": "animate", "args": [[str(k)], still]}
                      for k in range(1, len(maps) + 1)],
        }],
    )
    fig.update_layout(title_text=shown.layout.title.text)
    return fig


def _fade(hex_colour: str) -> str:
    """A pale version of a colour: a token kept by few heads."""
    r, g, b = (int(hex_colour[i: i + 2], 16) for i in (1, 3, 5))
    return f"rgb({(r + 3 * 255) // 4},{(g + 3 * 255) // 4},{(b + 3 * 255) // 4})"


def fidelity_lines(table: pd.DataFrame) -> go.Figure:
    """KL to Full and top-1 agreement per turn, one line per policy.

    A failed policy has no score from the turn it failed on: those turns are not drawn, and its
    legend entry names the turn. Turns where Full (the reference) sat past the model's trained context are
    shaded, and a policy's own turns past it are crossed: those scores come from positions never trained on.
    """
    fig = make_subplots(rows=1, cols=2,
                        subplot_titles=("KL(Full ‖ policy), mean over the reply", "top-1 agreement with Full"))
    for i, (policy, rows) in enumerate(table[table.policy != "full"].groupby("policy", sort=False)):
        failed = rows[rows.error.notna()]
        name = f"{policy} (failed on turn {failed.turn.iloc[0]})" if len(failed) else policy
        look = {"line": {"color": policy_colour(policy, i)}, "marker": policy_marker(policy, i),
                "offsetgroup": policy, "legendgroup": policy, "mode": "lines+markers"}
        fig.add_trace(go.Scatter(x=rows.turn, y=rows.kl, name=name, **look), row=1, col=1)
        fig.add_trace(go.Scatter(x=rows.turn, y=rows.top1, name=policy, showlegend=False, **look), row=1, col=2)
    _mark_past_context(fig, table)
    fig.update_xaxes(title_text="turn", dtick=1)
    fig.update_yaxes(title_text="nats", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=2)
    fig.update_layout(height=360, margin={"l": 50, "r": 20, "t": 50, "b": 40}, **SIDE_BY_SIDE)
    return fig


def _mark_past_context(fig: go.Figure, table: pd.DataFrame) -> None:
    """Shade the turns where Full sat past its trained context; cross each other policy's turns past it."""
    if "past_context" not in table:  # a table from before the marks
        return
    past = table[table.past_context.fillna(False).astype(bool)]
    full = past[past.policy == "full"]
    if len(full):
        first = int(full.turn.min())
        fig.add_vrect(x0=first - 0.5, x1=int(table.turn.max()) + 0.5, fillcolor="#d62728", opacity=0.08,
                      line_width=0, row=1, col="all")
        fig.add_annotation(x=first - 0.5, y=1.0, xref="x", yref="paper", xanchor="left", yanchor="bottom",
                           showarrow=False, font={"color": "#d62728", "size": 11},
                           text=f"Full past its trained context from turn {first}")
    others = past[past.policy != "full"]
    for k, (policy, rows) in enumerate(others.groupby("policy", sort=False)):
        for col, column in ((1, "kl"), (2, "top1")):  # each over its policy's marker (``offsetgroup``)
            fig.add_trace(go.Scatter(x=rows.turn, y=rows[column], mode="markers", name="past the trained context",
                                     legendgroup="past_context", showlegend=col == 1 and k == 0, offsetgroup=policy,
                                     marker={"symbol": "x-thin-open", "size": 14, "color": "#d62728",
                                             "line": {"width": 2}}), row=1, col=col)


def first_divergence(ids: list[int], reference: list[int]) -> int | None:
    """Index of the first token where ``ids`` differs from ``reference`` (None: the same tokens).

    A reply that stops early or goes on diverges at the shorter one's length.
    """
    shared = common_prefix(ids, reference)
    return None if shared == len(ids) == len(reference) else shared


def divergence_html(ids: list[int], reference: list[int], decode: Callable[[list[int]], str]) -> str:
    """A reply as HTML: the part it shares with the reference, its first diverging token highlighted, then the rest.

    ``decode`` turns token ids into text (the model's tokenizer). Escaped: replies are model output.
    """
    i = first_divergence(ids, reference)
    if i is None:
        body = html.escape(decode(ids)) + ' <span style="color:#59a14f">(same as Full)</span>'
    elif i == len(ids):
        body = html.escape(decode(ids)) + f' <mark style="{MARK}">[ends here; Full goes on]</mark>'
    else:
        body = (html.escape(decode(ids[:i])) + f'<mark style="{MARK}">{html.escape(decode(ids[i:i + 1]))}</mark>'
                + f'<span style="color:#777">{html.escape(decode(ids[i + 1:]))}</span>')
    # a paragraph's bottom margin: Streamlit's markdown block pulls its last paragraph's up, which a div lacks
    style = "white-space:pre-wrap;overflow-wrap:anywhere;margin-bottom:1rem"
    return f'<div style="{style}">{body or "(empty reply)"}</div>'
