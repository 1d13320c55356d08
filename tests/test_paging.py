"""Paged-block accounting: hand-computed cases, invariants, a slow reference, and the figures."""

import math

import numpy as np
import plotly.graph_objects as go
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.engine.paging import (
    FRAGMENTED,
    FREE,
    FULL,
    BlockFigures,
    block_figures,
    block_state_grid,
    block_states,
    read_block_grid,
)
from kvlab.errors import KvlabError
from kvlab.viz.blocks import NOT_READ, READ_NAMES, block_bytes_figure, block_map_figure

BPT = 2 * 64 * 4  # K and V × head_dim 64 × float32 = 512 bytes per token per head
BLOCK = 16 * BPT  # 8192 bytes per block of 16


def sinks_and_window() -> torch.Tensor:
    """StreamingLLM-like keep of 40 tokens: sinks 0..3 and window 28..39."""
    return torch.cat([torch.arange(0, 4), torch.arange(28, 40)])


def test_streaming_like_block_states():
    # blocks [0,16) [16,32) [32,40): 4/16, 4/16 (28..31), 8/8
    states = block_states(sinks_and_window(), 40, 16)
    assert states.tolist() == [FRAGMENTED, FRAGMENTED, FULL]


def test_free_middle_block():
    keep = torch.cat([torch.arange(0, 4), torch.arange(32, 40)])
    assert block_states(keep, 40, 16).tolist() == [FRAGMENTED, FREE, FULL]


def test_streaming_like_figures_every_field():
    figs = block_figures([sinks_and_window()[None, :]], 40, 16, BPT)
    assert figs == BlockFigures(
        n_blocks=3,
        free=0,
        fragmented=2,
        full=1,
        retained_tokens=16,
        bytes_retained=16 * BPT,
        bytes_freeable=0,
        bytes_compaction_copy=8 * BPT,  # 4 + 4 tokens in the two fragmented blocks
        bytes_freed_by_compaction=1 * BLOCK,  # 2 fragmented blocks -> 1 dense block
        bytes_reserved_now=3 * BLOCK,  # the 8-token last block counts as a whole block
    )


def test_two_layers_two_heads_figures_every_field():
    # total 40, bs 16 -> 3 blocks per stream, 4 streams -> 12 blocks
    layer0 = torch.tensor([[0, 1, 2, 3, 32, 33, 34, 35, 36, 37, 38, 39],  # frag, free, full
                           [5, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]])  # frag, frag, free
    # 8 tokens per head in layer 1 (counts differ between layers, as with PyramidKV)
    layer1 = torch.tensor([list(range(32, 40)),  # free, free, full
                           [0, 15, 16, 31, 1, 2, 3, 4]])  # frag (6), frag (2), free
    pos = [layer0, layer1]
    grid = block_state_grid(pos, 40, 16)
    assert grid.shape == (2, 2, 3)
    assert grid.tolist() == [
        [[FRAGMENTED, FREE, FULL], [FRAGMENTED, FRAGMENTED, FREE]],
        [[FREE, FREE, FULL], [FRAGMENTED, FRAGMENTED, FREE]],
    ]
    figs = block_figures(pos, 40, 16, BPT)
    # fragmented tokens per stream: 4 | 1 + 11 = 12 | 0 | 6 + 2 = 8 -> dense blocks 1, 1, 0, 1
    assert figs.as_dict() == {
        "n_blocks": 12,
        "free": 5,
        "fragmented": 5,
        "full": 2,
        "retained_tokens": 12 + 12 + 8 + 8,
        "bytes_retained": 40 * BPT,
        "bytes_freeable": 5 * BLOCK,
        "bytes_compaction_copy": (4 + 12 + 8) * BPT,
        "bytes_freed_by_compaction": (5 - 3) * BLOCK,
        "bytes_reserved_now": 7 * BLOCK,
    }


def test_partial_last_block_full_when_all_its_tokens_kept():
    # total 35, bs 16: last block holds 32..34 only (3 slots)
    states = block_states(np.array([33, 32, 34]), 35, 16)
    assert states.tolist() == [FREE, FREE, FULL]
    figs = block_figures([torch.tensor([[32, 33, 34]])], 35, 16, BPT)
    assert figs.full == 1 and figs.free == 2 and figs.fragmented == 0
    assert figs.bytes_reserved_now == BLOCK  # reserved as a whole 16-slot block
    assert figs.bytes_compaction_copy == 0 and figs.bytes_freed_by_compaction == 0


def test_partial_last_block_fragmented():
    # total 35: keeping 2 of the 3 last slots leaves a hole
    assert block_states(torch.tensor([32, 34]), 35, 16).tolist() == [FREE, FREE, FRAGMENTED]


def test_exact_multiple_and_block_size_one():
    assert block_states(torch.arange(32), 32, 16).tolist() == [FULL, FULL]
    assert block_states(torch.tensor([0, 2]), 4, 1).tolist() == [FULL, FREE, FULL, FREE]


def test_empty_retention_frees_everything():
    figs = block_figures([torch.empty(3, 0, dtype=torch.long)], 40, 16, BPT)
    assert figs.free == 9 and figs.n_blocks == 9
    assert figs.bytes_freeable == 9 * BLOCK and figs.bytes_reserved_now == 0
    assert block_states([], 40, 16).tolist() == [FREE, FREE, FREE]


def test_unsorted_input_and_int32_accepted():
    a = block_states(torch.tensor([39, 0, 30, 3], dtype=torch.int32), 40, 16)
    b = block_states(np.array([0, 3, 30, 39]), 40, 16)
    assert a.tolist() == b.tolist() == [FRAGMENTED, FRAGMENTED, FRAGMENTED]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: block_states([0, 1], 10, 0), "block size must be at least 1, got 0"),
        (lambda: block_states([0, 10], 10, 4), "positions: position 10 is outside [0, 10)"),
        (lambda: block_states([-1], 10, 4), "positions: position -1 is outside [0, 10)"),
        (lambda: block_states([3, 1, 3], 10, 4), "positions: position 3 is retained twice"),
        (lambda: block_states([0.0, 1.0], 10, 4), "positions must be integers"),
        (lambda: block_states([[0, 1]], 10, 4), "positions must be 1-D"),
        (lambda: block_states([0], -1, 4), "total tokens must be at least 0"),
        (
            lambda: block_state_grid([torch.tensor([[0, 1], [2, 2]])], 10, 4),
            "layer 0 head 1: position 2 is retained twice",
        ),
        (
            lambda: block_state_grid([torch.tensor([[0], [1]]), torch.tensor([[0], [12]])], 10, 4),
            "layer 1 head 1: position 12 is outside [0, 10)",
        ),
        (
            lambda: block_state_grid([torch.tensor([[0], [1]]), torch.tensor([[0]])], 10, 4),
            "layer 1 has 1 KV heads, layer 0 has 2",
        ),
        (lambda: block_state_grid([torch.tensor([0, 1])], 10, 4), "must be [kv_heads, tokens]"),
        (lambda: block_state_grid([], 10, 4), "no layers given"),
        (
            lambda: block_figures([torch.tensor([[0]])], 10, 4, 0),
            "bytes per token and head must be at least 1",
        ),
    ],
)
def test_errors(call, message):
    with pytest.raises(KvlabError) as info:
        call()
    assert message in str(info.value)


def reference(streams: list[list[int]], total: int, bs: int, bpt: int) -> dict:
    """Slow per-slot reference over a list of streams (each a list of retained positions)."""
    out = dict.fromkeys(BlockFigures.__dataclass_fields__, 0)
    states = []
    for keep in streams:
        kept = set(keep)
        frag_tokens = frag_blocks = 0
        for start in range(0, total, bs):
            slots = range(start, min(start + bs, total))
            n = sum(1 for p in slots if p in kept)
            out["n_blocks"] += 1
            out["retained_tokens"] += n
            if n == 0:
                states.append(FREE)
                out["free"] += 1
            elif n == len(slots):
                states.append(FULL)
                out["full"] += 1
            else:
                states.append(FRAGMENTED)
                out["fragmented"] += 1
                frag_blocks += 1
                frag_tokens += n
        out["bytes_compaction_copy"] += frag_tokens * bpt
        out["bytes_freed_by_compaction"] += (frag_blocks - math.ceil(frag_tokens / bs)) * bs * bpt
    out["bytes_retained"] = out["retained_tokens"] * bpt
    out["bytes_freeable"] = out["free"] * bs * bpt
    out["bytes_reserved_now"] = (out["n_blocks"] - out["free"]) * bs * bpt
    return {"figures": out, "states": states}


@st.composite
def paged_cases(draw):
    """Random geometry and, per layer, one random subset of positions per KV head."""
    bs = draw(st.integers(1, 32))
    total = draw(st.integers(1, 500))
    layers = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    bpt = draw(st.sampled_from([1, 2 * 64 * 2, 2 * 64 * 4]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    pos = []
    for _ in range(layers):
        # same count for every head of a layer; counts differ between layers (PyramidKV)
        n = draw(st.integers(0, total))
        rows = [rng.permutation(total)[:n] for _ in range(heads)]
        pos.append(torch.from_numpy(np.stack(rows)).reshape(heads, n))
    return pos, total, bs, bpt


@settings(max_examples=150, deadline=None)
@given(paged_cases())
def test_matches_reference_and_invariants(case):
    pos, total, bs, bpt = case
    figs = block_figures(pos, total, bs, bpt)
    streams = [row.tolist() for layer in pos for row in layer]
    ref = reference(streams, total, bs, bpt)
    assert figs.as_dict() == ref["figures"]
    grid = block_state_grid(pos, total, bs)
    assert grid.reshape(-1).tolist() == ref["states"]
    assert block_states(pos[0][0], total, bs).tolist() == grid[0, 0].tolist()

    assert figs.free + figs.fragmented + figs.full == figs.n_blocks
    assert figs.n_blocks == len(pos) * pos[0].shape[0] * math.ceil(total / bs)
    assert figs.retained_tokens == sum(layer.numel() for layer in pos)
    assert figs.bytes_retained == figs.retained_tokens * bpt
    assert 0 <= figs.bytes_compaction_copy <= figs.bytes_retained
    assert 0 <= figs.bytes_freed_by_compaction <= figs.fragmented * bs * bpt
    assert figs.bytes_freeable + figs.bytes_reserved_now == figs.n_blocks * bs * bpt
    assert figs.bytes_reserved_now >= figs.bytes_retained


def test_block_map_figure_small_grid():
    grid = block_state_grid(
        [torch.tensor([[0, 1, 2, 3, 32, 33, 34, 35, 36, 37, 38, 39], list(range(12))])] * 2, 40, 16
    )
    fig = block_map_figure(grid, "StreamingLLM", block_size=16, total_tokens=40)
    assert isinstance(fig, go.Figure) and len(fig.data) == 1
    heat = fig.data[0]
    assert heat.type == "heatmap"
    assert np.asarray(heat.z).shape == (4, 3)
    assert np.asarray(heat.z).tolist() == grid.reshape(4, 3).tolist()
    assert list(fig.layout.yaxis.ticktext) == ["L0 h0", "L0 h1", "L1 h0", "L1 h1"]
    assert list(heat.colorbar.ticktext) == ["free", "fragmented", "full"]
    assert list(heat.y) == ["L0 h0", "L0 h1", "L1 h0", "L1 h1"]
    hover = np.asarray(heat.customdata)
    assert hover.shape == (4, 3)
    assert hover[3, 2] == "32–39, free"
    assert hover[0, 0] == "0–15, fragmented"
    assert hover[0, 2] == "32–39, full"
    assert heat.hovertemplate == "%{y}<br>block %{x}<br>tokens %{customdata}<extra></extra>"
    assert fig.layout.title.text == "StreamingLLM"


def test_block_map_figure_many_rows_is_capped():
    grid = np.zeros((30, 3, 313), dtype=np.int8)
    grid[:, :, -1] = FULL
    fig = block_map_figure(grid, "90 rows")
    assert np.asarray(fig.data[0].z).shape == (90, 313)
    assert fig.layout.height == 700
    assert list(fig.layout.yaxis.ticktext) == [f"L{layer}" for layer in range(30)]
    assert list(fig.layout.yaxis.tickvals) == [f"L{layer} h0" for layer in range(30)]
    assert np.asarray(fig.data[0].customdata)[5, 312] == "full"  # no block size: state only


def test_block_map_figure_rejects_bad_shape():
    with pytest.raises(KvlabError, match="layers, kv_heads, n_blocks"):
        block_map_figure(np.zeros((3, 4)), "bad")


def test_block_bytes_figure():
    full = block_figures([torch.arange(40)[None, :]], 40, 16, BPT).as_dict()
    sll = block_figures([sinks_and_window()[None, :]], 40, 16, BPT).as_dict()
    fig = block_bytes_figure([{"policy": "full", "kv_bytes": full["bytes_retained"], **full},
                              {"policy": "streamingllm", "kv_bytes": sll["bytes_retained"], **sll}])
    assert [t.type for t in fig.data] == ["bar", "bar", "bar"]
    assert fig.layout.barmode == "group"
    assert [list(t.x) for t in fig.data] == [["full", "streamingllm"]] * 3
    # held: 40 and 16 tokens × 512 B; freeable: none; compaction copy: 0 and 8 tokens
    assert [list(t.y) for t in fig.data] == [[20.0, 8.0], [0.0, 0.0], [0.0, 4.0]]
    assert fig.layout.title.text.startswith("K/V each policy holds after the turn")
    assert block_bytes_figure([], 3).layout.title.text.startswith("K/V each policy holds after turn 3")


def test_read_block_grid_maps_pages_onto_blocks():
    # 40 tokens: pages of 8 (5 pages), blocks of 16 (3 blocks, the last 8 long)
    read = read_block_grid([[[0, 4], [2]], [[0, 1, 2, 3, 4], []]], 8, 40, 16)
    assert read.shape == (2, 2, 3) and read.dtype == bool
    assert read.tolist() == [[[True, False, True], [False, True, False]], [[True, True, True], [False, False, False]]]
    # pages larger than blocks: page 1 (tokens 16–31) covers blocks 2 and 3 of 8
    assert read_block_grid([[[1]]], 16, 40, 8).tolist() == [[[False, False, True, True, False]]]
    with pytest.raises(KvlabError, match="outside the 5 pages"):
        read_block_grid([[[5]]], 8, 40, 16)
    with pytest.raises(KvlabError, match="layer 1 has 1 KV heads"):
        read_block_grid([[[0], [1]], [[0]]], 8, 40, 16)
    with pytest.raises(KvlabError, match="no layers"):
        read_block_grid([], 8, 40, 16)


def test_block_map_figure_marks_held_blocks_not_read():
    grid = block_state_grid([torch.tensor([list(range(40))])], 40, 16)  # every block held
    read = np.array([[[True, False, True]]])
    heat = block_map_figure(grid, "quest", block_size=16, total_tokens=40, read=read).data[0]
    assert np.asarray(heat.z).tolist() == [[FULL, NOT_READ, FULL]]
    assert list(heat.colorbar.ticktext) == list(READ_NAMES) and heat.zmax == 3.5
    assert np.asarray(heat.customdata)[0, 1] == "16–31, held, not read by the last query"
    with pytest.raises(KvlabError, match="do not match"):
        block_map_figure(grid, "quest", read=read[:, :, :2])


@st.composite
def uneven_cases(draw):
    """Random geometry and, per layer, a random subset of positions per KV head, each head its own count (AdaKV)."""
    bs, total, heads = draw(st.integers(1, 32)), draw(st.integers(1, 300)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pos = [[torch.from_numpy(rng.permutation(total)[: draw(st.integers(0, total))]) for _ in range(heads)]
           for _ in range(draw(st.integers(1, 3)))]
    return pos, total, bs


@settings(max_examples=100, deadline=None)
@given(uneven_cases())
def test_heads_of_different_lengths_each_hold_their_own_blocks(case):
    pos, total, bs = case
    streams = [row.tolist() for layer in pos for row in layer]
    ref = reference(streams, total, bs, 4)
    assert block_figures(pos, total, bs, 4).as_dict() == ref["figures"]
    assert block_state_grid(pos, total, bs).reshape(-1).tolist() == ref["states"]
    assert block_figures([[row.tolist() for row in layer] for layer in pos], total, bs, 4).as_dict() == ref["figures"]


def test_a_head_given_twice_or_out_of_range_is_refused_per_head():
    with pytest.raises(KvlabError, match="layer 0 head 1: position 3 is retained twice"):
        block_figures([[[0, 1, 2], [3, 3]]], 10, 4, 1)
    with pytest.raises(KvlabError, match="layer 1 has 1 KV heads, layer 0 has 2"):
        block_figures([[[0], [1, 2]], [[0]]], 10, 4, 1)
