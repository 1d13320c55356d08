"""Figures of paged-block state: block map (free / fragmented / full, and for Quest what the last query read)
and bytes per policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go

from kvlab.engine.paging import FRAGMENTED, FREE, FULL, STATE_NAMES
from kvlab.errors import KvlabError

if TYPE_CHECKING:
    from kvlab.workloads.chat.records import PolicyTurn

NOT_READ = 3  # a held block the last decoding query did not read (sparse reads, Quest): a state of the figure only
STATE_COLOURS = {FREE: "#e3e3e3", FRAGMENTED: "#f28e2b", FULL: "#1f4e9c", NOT_READ: "#a9c6ea"}
READ_NAMES = ("free", "fragmented, read by the last query", "full, read by the last query",
              "held, not read by the last query")
MAX_HEIGHT = 700
ROW_PX = 14
# above this many rows only the first head of each layer gets a tick label
ALL_LABELS_MAX_ROWS = 40


def _discrete_colourscale(states: tuple[int, ...]) -> list:
    """One flat band per state over z in [-0.5, len(states) - 0.5] so each state gets exactly one colour."""
    scale, n = [], len(states)
    for state in states:
        scale.append([state / n, STATE_COLOURS[state]])
        scale.append([(state + 1) / n, STATE_COLOURS[state]])
    return scale


def block_map_figure(
    grid: np.ndarray,
    title: str,
    *,
    block_size: int | None = None,
    total_tokens: int | None = None,
    windows: tuple[int | None, ...] = (),
    read: np.ndarray | None = None,
) -> go.Figure:
    """Heatmap of block states, one row per (layer, KV head), layer-major, blocks along x.

    grid: [layers, kv_heads, n_blocks] of FREE/FRAGMENTED/FULL (see kvlab.engine.paging).
    With block_size (and total_tokens, for the shorter last block) the hover shows each
    block's token range. ``windows`` (per layer, None for full attention) labels sliding layers.
    ``read`` [layers, kv_heads, n_blocks] bool (``kvlab.engine.paging.read_block_grid``) marks the blocks the
    last decoding query read; held blocks it did not read get a fourth colour.
    """
    grid = np.asarray(grid)
    if grid.ndim != 3:
        raise KvlabError(f"block grid must be [layers, kv_heads, n_blocks], got shape {grid.shape}")
    states, names = (FREE, FRAGMENTED, FULL), STATE_NAMES
    if read is not None:
        if np.shape(read) != grid.shape:
            raise KvlabError(f"read blocks {np.shape(read)} do not match the block grid {grid.shape}")
        grid = np.where((grid != FREE) & ~np.asarray(read, dtype=bool), NOT_READ, grid)
        states, names = (*states, NOT_READ), READ_NAMES
    layers, kv_heads, n_blocks = grid.shape
    n_rows = layers * kv_heads
    z = grid.reshape(n_rows, n_blocks)  # [rows, n_blocks]

    row_layer = np.repeat(np.arange(layers), kv_heads)  # [rows]
    row_head = np.tile(np.arange(kv_heads), layers)  # [rows]
    row_labels = [f"L{layer} h{head}" + (f" · window {windows[layer]}" if windows and windows[layer] else "")
                  for layer, head in zip(row_layer, row_head)]
    block_idx = np.arange(n_blocks)
    if block_size is not None:
        start = block_idx * block_size
        stop = start + block_size
        if total_tokens is not None:
            stop = np.minimum(stop, total_tokens)
        ranges = np.array([f"{a}–{b - 1}, " for a, b in zip(start, stop)], dtype=object)
        cell = "tokens %{customdata}"
    else:
        ranges = np.full(n_blocks, "", dtype=object)
        cell = "%{customdata}"
    names = np.array(names, dtype=object)
    # one short string per cell keeps the figure's JSON small at 90 rows × hundreds of blocks
    hover = ranges[None, :] + names[z.astype(np.int64)]  # [rows, n_blocks]

    if n_rows > ALL_LABELS_MAX_ROWS:
        ticktext = [f"L{layer}" for layer in range(layers)]
        tickvals = row_labels[::kv_heads]
    else:
        ticktext = tickvals = row_labels

    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=block_idx,
            y=row_labels,
            customdata=hover,
            zmin=-0.5,
            zmax=len(states) - 0.5,
            colorscale=_discrete_colourscale(states),
            colorbar=dict(tickvals=list(states), ticktext=list(names), title="block"),
            xgap=1 if n_blocks <= 120 else 0,
            ygap=1 if n_rows <= 60 else 0,
            hovertemplate=f"%{{y}}<br>block %{{x}}<br>{cell}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        height=min(MAX_HEIGHT, max(220, ROW_PX * n_rows + 120)),
        margin=dict(l=70, r=20, t=50, b=40),
        plot_bgcolor="white",
    )
    fig.update_xaxes(title="block")
    fig.update_yaxes(
        title="layer / KV head",
        tickvals=tickvals,
        ticktext=ticktext,
        type="category",
        autorange="reversed",
    )
    return fig


BYTE_SERIES = (
    ("kv_bytes", "held (as stored: kivi packed, quest with its page metadata)", "#1f4e9c"),
    ("bytes_freeable", "freeable without compaction", "#59a14f"),
    ("bytes_compaction_copy", "copied by compaction", "#f28e2b"),
)


def block_bytes_rows(records: list[PolicyTurn]) -> list[dict]:
    """The rows ``block_bytes_figure`` draws from one turn's policy records."""
    return [{"policy": rec.policy, "kv_bytes": rec.kv_bytes, **rec.blocks} for rec in records]


def block_bytes_figure(rows: list[dict], turn: int | None = None) -> go.Figure:
    """Grouped bars per policy: bytes held, freeable without compaction, copied by compaction (KiB), after ``turn``
    (1-based) where given.

    Each row is {"policy": name, "kv_bytes": the bytes it holds} plus BlockFigures.as_dict(); held is the
    record's ``kv_bytes``, the number the turn table shows (retained tokens at full precision would leave
    out Quest's page metadata and count KIVI's packed tokens at full size).
    """
    policies = [row["policy"] for row in rows]
    fig = go.Figure()
    for key, label, colour in BYTE_SERIES:
        fig.add_trace(
            go.Bar(
                name=label,
                x=policies,
                y=[row[key] / 1024 for row in rows],
                marker_color=colour,
                hovertemplate=f"%{{x}}<br>{label}: %{{y:,.1f}} KiB<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="group",
        height=440,
        title=f"K/V each policy holds after {'the turn' if turn is None else f'turn {turn}'}, and what paging would "
              "free or copy",
        yaxis_title="KiB (all layers and KV heads)",
        legend=dict(orientation="h", yanchor="top", y=-0.2, x=0),  # above, at a narrow width it ran into the title
        margin=dict(l=60, r=20, t=70, b=130),
    )
    return fig
