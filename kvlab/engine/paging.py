"""vLLM-style paged-block accounting of the tokens an eviction policy retained.

A stream of ``total_tokens`` tokens is written in original order into blocks of ``block_size``
slots: block j holds original positions [j*bs, min((j+1)*bs, total)). Every layer and KV head is
its own stream with its own blocks, so heads that keep different numbers of tokens (AdaKV) hold
different numbers of blocks: a layer's positions may be given per head, each head its own length.
After a policy decided which positions to keep, each block is

- FREE: no retained token; the block is released without copying anything;
- FRAGMENTED: some but not all slots retained; its holes are reclaimed only by compaction;
- FULL: every slot retained.

The last block may be shorter (it is still being filled). For the free/full decision its capacity
is its real length, so a short last block whose tokens are all kept is FULL. For bytes it counts as
a whole block, because the paged allocator reserves the whole block up front.
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvlab.errors import KvlabError

FREE, FRAGMENTED, FULL = 0, 1, 2
STATE_NAMES = ("free", "fragmented", "full")


def _check_sizes(total_tokens: int, block_size: int) -> int:
    """Validate the stream geometry and return the number of blocks."""
    if block_size < 1:
        raise KvlabError(f"block size must be at least 1, got {block_size}")
    if total_tokens < 0:
        raise KvlabError(f"total tokens must be at least 0, got {total_tokens}")
    return -(-total_tokens // block_size)


def _capacities(total_tokens: int, block_size: int, n_blocks: int) -> np.ndarray:
    """Slots per block: block_size everywhere except the shorter last block."""
    cap = np.full(n_blocks, block_size, dtype=np.int64)  # [n_blocks]
    if n_blocks:
        cap[-1] = total_tokens - (n_blocks - 1) * block_size
    return cap


def _as_int_array(positions, what: str) -> np.ndarray:
    """Positions as an int64 numpy array (tensor, array or list accepted)."""
    if isinstance(positions, torch.Tensor):
        if positions.is_floating_point() or positions.is_complex():
            raise KvlabError(f"{what}: positions must be integers, got dtype {positions.dtype}")
        return positions.detach().cpu().numpy().astype(np.int64, copy=False)
    arr = np.asarray(positions)
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise KvlabError(f"{what}: positions must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_rows(rows: list[np.ndarray], total_tokens: int, where: Callable[[int], str]) -> None:
    """Reject positions outside [0, total_tokens) and duplicates within a head's row.

    where(head) names the offending stream in the message.
    """
    for head, row in enumerate(rows):  # row: [n_head]
        if row.size == 0:
            continue
        bad = np.flatnonzero((row < 0) | (row >= total_tokens))
        if bad.size:
            raise KvlabError(f"{where(head)}: position {row[bad[0]]} is outside [0, {total_tokens})")
        ordered = np.sort(row)
        dup = np.flatnonzero(np.diff(ordered) == 0)
        if dup.size:
            raise KvlabError(f"{where(head)}: position {ordered[dup[0]]} is retained twice")


def _row_counts(rows: list[np.ndarray], block_size: int, n_blocks: int) -> np.ndarray:
    """Retained tokens per block of each head's validated positions: [kv_heads, n_blocks]."""
    return np.stack([np.bincount(row // block_size, minlength=n_blocks) for row in rows]).reshape(len(rows), n_blocks)


def _heads(pos, layer: int) -> list[np.ndarray]:
    """One layer's positions as one int64 row per KV head: from [kv_heads, tokens], or a list of per-head rows."""
    if isinstance(pos, (list, tuple)) and pos and all(isinstance(p, (list, tuple, np.ndarray, torch.Tensor))
                                                      for p in pos):
        rows = [_as_int_array(p, f"layer {layer} head {head}") for head, p in enumerate(pos)]
        if any(row.ndim != 1 for row in rows):
            raise KvlabError(f"layer {layer}: each head's positions must be 1-D")
        return rows
    rows = _as_int_array(pos, f"layer {layer}")
    if rows.ndim != 2:
        raise KvlabError(f"layer {layer}: positions must be [kv_heads, tokens], got shape {tuple(rows.shape)}")
    return list(rows)


def _block_counts(positions_per_layer: list, total_tokens: int, block_size: int) -> np.ndarray:
    """Retained tokens per block for every layer and KV head: [layers, kv_heads, n_blocks]."""
    n_blocks = _check_sizes(total_tokens, block_size)
    if len(positions_per_layer) == 0:
        raise KvlabError("no layers given: positions_per_layer is empty")
    layers = []
    for layer, pos in enumerate(positions_per_layer):
        rows = _heads(pos, layer)
        if layers and len(rows) != len(layers[0]):
            raise KvlabError(f"layer {layer} has {len(rows)} KV heads, layer 0 has {len(layers[0])}")
        _check_rows(rows, total_tokens, lambda head, layer=layer: f"layer {layer} head {head}")
        layers.append(rows)
    return np.stack([_row_counts(rows, block_size, n_blocks) for rows in layers])


def _states(counts: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """FREE / FRAGMENTED / FULL from retained counts (any leading shape, last axis = blocks)."""
    states = np.full(counts.shape, FRAGMENTED, dtype=np.int8)
    states[counts == 0] = FREE
    states[counts == capacity] = FULL
    return states


def block_states(positions, total_tokens: int, block_size: int) -> np.ndarray:
    """State of every block of one stream (one layer, one KV head): [n_blocks] of FREE/FRAGMENTED/FULL (the tests'
    one-stream reading of ``block_state_grid``'s rule)."""
    n_blocks = _check_sizes(total_tokens, block_size)
    rows = _as_int_array(positions, "positions")
    if rows.ndim != 1:
        raise KvlabError(f"positions must be 1-D for one stream, got shape {tuple(rows.shape)}")
    _check_rows([rows], total_tokens, lambda head: "positions")
    counts = _row_counts([rows], block_size, n_blocks)[0]  # [n_blocks]
    return _states(counts, _capacities(total_tokens, block_size, n_blocks))


def block_state_grid(
    positions_per_layer: list[torch.Tensor | list[torch.Tensor]], total_tokens: int, block_size: int
) -> np.ndarray:
    """Block states of every layer and KV head: [layers, kv_heads, n_blocks] of FREE/FRAGMENTED/FULL.

    positions_per_layer[l] is [kv_heads, n_l] (n_l may differ between layers), or one row per KV head
    (heads of a layer may differ too).
    """
    counts = _block_counts(positions_per_layer, total_tokens, block_size)
    capacity = _capacities(total_tokens, block_size, counts.shape[-1])
    return _states(counts, capacity)


def read_block_grid(pages_read: list[list[list[int]]], page_size: int, total_tokens: int,
                    block_size: int) -> np.ndarray:
    """Which blocks a query read: [layers, kv_heads, n_blocks] bool, from the pages it read per layer and KV head.

    A cache that evicts nothing (Quest) holds token t in slot t, so page p is tokens [p·page_size,
    (p+1)·page_size); a block counts as read when any of its tokens is in a page that was read.
    """
    n_blocks = _check_sizes(total_tokens, block_size)
    if page_size < 1:
        raise KvlabError(f"page size must be at least 1, got {page_size}")
    if not pages_read:
        raise KvlabError("no layers given: pages_read is empty")
    n_pages = -(-total_tokens // page_size)
    read_pages = np.zeros((len(pages_read), len(pages_read[0]), n_pages), dtype=bool)  # [layers, kv_heads, pages]
    for layer, heads in enumerate(pages_read):
        if len(heads) != read_pages.shape[1]:
            raise KvlabError(f"layer {layer} has {len(heads)} KV heads, layer 0 has {read_pages.shape[1]}")
        for head, pages in enumerate(heads):
            if any(p < 0 or p >= n_pages for p in pages):
                raise KvlabError(f"layer {layer} head {head}: a page outside the {n_pages} pages of "
                                 f"{total_tokens} tokens")
            read_pages[layer, head, pages] = True
    token_read = read_pages[..., np.arange(total_tokens) // page_size]  # [layers, kv_heads, tokens]
    padded = np.zeros((*token_read.shape[:2], n_blocks * block_size), dtype=bool)
    padded[..., :total_tokens] = token_read
    return padded.reshape(*token_read.shape[:2], n_blocks, block_size).any(-1)


@dataclass(frozen=True)
class BlockFigures:
    """Block counts and bytes summed over layers and KV heads.

    n_blocks counts every stream's blocks (layers × kv_heads × blocks per stream).
    bytes_freeable: free blocks, released without copying.
    bytes_compaction_copy: retained tokens sitting in fragmented blocks (what compaction copies).
    bytes_freed_by_compaction: fragmented blocks minus the blocks that hold their retained
    tokens densely (per stream), in bytes.
    bytes_reserved_now: every non-free block as a whole block, the shorter last block included.
    """

    n_blocks: int
    free: int
    fragmented: int
    full: int
    retained_tokens: int
    bytes_retained: int
    bytes_freeable: int
    bytes_compaction_copy: int
    bytes_freed_by_compaction: int
    bytes_reserved_now: int

    def as_dict(self) -> dict:
        """Plain dict of the figures (JSON-ready ints)."""
        return asdict(self)


def block_figures(
    positions_per_layer: list[torch.Tensor | list[torch.Tensor]],
    total_tokens: int,
    block_size: int,
    bytes_per_token_head: int,
) -> BlockFigures:
    """Block and byte figures of one policy's retained positions.

    bytes_per_token_head: K and V of one token in one head, ``facts.kv_bytes(1, layers=1, heads=1)``.
    """
    if bytes_per_token_head < 1:
        raise KvlabError(f"bytes per token and head must be at least 1, got {bytes_per_token_head}")
    counts = _block_counts(positions_per_layer, total_tokens, block_size)  # [L, H, n_blocks]
    capacity = _capacities(total_tokens, block_size, counts.shape[-1])
    states = _states(counts, capacity)
    block_bytes = block_size * bytes_per_token_head

    fragmented_mask = states == FRAGMENTED
    n_free = int((states == FREE).sum())
    n_fragmented = int(fragmented_mask.sum())
    in_fragmented = np.where(fragmented_mask, counts, 0).sum(axis=-1)  # [L, H]
    # compaction works inside each stream: its fragmented tokens go densely into ceil(n/bs) blocks
    dense_blocks = int((-(-in_fragmented // block_size)).sum())
    retained = int(counts.sum())
    return BlockFigures(
        n_blocks=int(states.size),
        free=n_free,
        fragmented=n_fragmented,
        full=int((states == FULL).sum()),
        retained_tokens=retained,
        bytes_retained=retained * bytes_per_token_head,
        bytes_freeable=n_free * block_bytes,
        bytes_compaction_copy=int(in_fragmented.sum()) * bytes_per_token_head,
        bytes_freed_by_compaction=(n_fragmented - dense_blocks) * block_bytes,
        bytes_reserved_now=(int(states.size) - n_free) * block_bytes,
    )
