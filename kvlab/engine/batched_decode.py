"""Decoding several policies' replies together, one forward per step.

Every row's reply follows ``decode.Reply``. A step's rows attend in groups of similar length (``row_groups``): a
group's caches are copied once into a slab [rows, kv_heads, longest + room, head_dim] whose padded slots are
masked out, so each step attends once per group and costs no copy, and no row is padded to more than twice its
size: Full's long cache never makes the compressed ones cost what it costs. ``generate_batched`` leaves every cache
as it was; ``generate_keeping`` lets one state (Full, whose reply every cache is fed next) decode on its own cache
and keep its reply there, so that it is then fed only the reply's end.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvlab.engine.attention import RowGroup
from kvlab.engine.batched import grouped, groups_of_identical, run_groups
from kvlab.engine.cache import new_cache
from kvlab.engine.decode import Reply
from kvlab.engine.kvstate import KVState


class SlabLayer(DynamicLayer):
    """A cache layer whose keys live in a preallocated slab; ``update`` writes in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.slab_keys, self.slab_values = keys, values  # [rows, kv_heads, capacity, head_dim]
        self.length = length
        self.device = keys.device
        self.is_initialized = True
        self._expose()

    def _expose(self) -> None:
        self.keys = self.slab_keys[..., : self.length, :]
        self.values = self.slab_values[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.slab_keys[..., self.length : end, :] = key_states
        self.slab_values[..., self.length : end, :] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values


def _slab_cache(states: list[KVState], room: int) -> tuple[DynamicCache, list[torch.Tensor | None], list[int]]:
    """Every state's cache as rows of one slab cache with ``room`` free slots after the longest row.

    Returns the cache, per-layer validity masks [rows, longest + room] (or [rows, kv_heads, longest + room]
    when some head holds padding of its own; None where no slot is padding) and each layer's padded length.
    """
    lm = states[0].lm
    f = lm.facts
    cache = new_cache(lm)
    valid, longest_per_layer = [], []
    all_lengths = [s.lengths() for s in states]
    per_head = any(lay.uneven for s in states for lay in s.layers)
    for layer in range(f.n_layers):
        lengths = [lens[layer] for lens in all_lengths]
        longest = max(lengths)
        template = next((s.cache.layers[layer].keys for s in states if s.cache.layers[layer].is_initialized), None)
        dtype = template.dtype if template is not None else lm.model.dtype
        shape = (len(states), f.n_kv_heads, longest + room, f.head_dim)
        # not zeroed whole: a row's free slots are written before they are read, only its padding needs zeros
        keys = torch.empty(shape, dtype=dtype, device=lm.device)
        values = torch.empty(shape, dtype=dtype, device=lm.device)
        for row, (s, n) in enumerate(zip(states, lengths)):
            if n:
                keys[row, :, :n] = s.cache.layers[layer].keys[0]
                values[row, :, :n] = s.cache.layers[layer].values[0]
            keys[row, :, n:longest] = 0
            values[row, :, n:longest] = 0
        cache.layers[layer] = SlabLayer(keys, values, longest)
        slot = torch.arange(longest + room, device=lm.device)[None, :]
        filled = torch.tensor(lengths, device=lm.device)[:, None]
        rows = (slot < filled) | (slot >= longest)  # [rows, capacity]: real and to-be-written slots
        if per_head:
            rows = rows[:, None].repeat(1, f.n_kv_heads, 1)  # [rows, kv_heads, capacity]
            for row, (s, n) in enumerate(zip(states, lengths)):
                rows[row, :, :n] = s.cache.layers[layer].real
        valid.append(None if bool(rows.all()) else rows)  # nothing padded: no mask to apply
        longest_per_layer.append(longest)
    return cache, valid, longest_per_layer


def _slab_positions(states: list[KVState], longest: list[int], n_new: int) -> list[torch.Tensor] | None:
    """Original positions of every slab slot, per layer [rows, kv_heads, longest + n_new] (None without windows)."""
    widths = [n + n_new for n in longest]
    rows = [s.key_positions(n_new, widths) for s in states]
    if rows[0] is None:
        return None
    return [torch.cat([r[layer] for r in rows]) for layer in range(len(longest))]


def row_groups(states: list[KVState], room: int) -> list[list[int]]:
    """Indices of ``states`` in groups that attend over one slab each, longest caches first.

    A cache joins the group of the next longer ones when it is at least half as long as that group's
    longest (slots over every layer, ``room`` new ones included), so no row is padded to more than twice
    its size: a long untouched cache next to short evicted ones attends on its own.
    """
    f = states[0].lm.facts
    slots = [sum(s.lengths()) + room * f.n_layers for s in states]
    groups: list[list[int]] = []
    for i in sorted(range(len(states)), key=lambda i: -slots[i]):
        if groups and 2 * slots[i] >= slots[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _slab_group(states: list[KVState], room: int) -> RowGroup:
    """The states' caches as one group of decoding rows (no statistics) on a slab with ``room`` new slots."""
    cache, valid, longest = _slab_cache(states, room)
    return RowGroup(len(states), cache.layers, (None,) * len(states), valid, _slab_positions(states, longest, room),
                    tuple(s.row_reads() for s in states))


@torch.no_grad()
def generate_batched(
    states: list[KVState],
    first_logits: list[torch.Tensor],
    max_new_tokens: int,
    stop_ids: set[int],
    on_token: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]]:
    """Greedy replies for every state from its first-token logits [vocab]; caches are left as they were.

    States with identical caches and first logits give identical replies: one row decodes for all.
    """
    return _generate(states, first_logits, max_new_tokens, stop_ids, on_token)[0]


@torch.no_grad()
def generate_keeping(
    states: list[KVState],
    first_logits: list[torch.Tensor],
    max_new_tokens: int,
    stop_ids: set[int],
    on_token: Callable[[int, list[int]], None] | None = None,
) -> tuple[list[list[int]], torch.Tensor]:
    """``generate_batched``, but ``states[0]`` keeps its reply as ``KVState.generate_kept`` does: its first
    ``fed = len(logits) - 1`` tokens stay in its cache, recorded as appended, and the logits that chose its tokens
    [fed + 1, vocab] are returned with the replies. The other caches are left as they were. Not for H2O's
    bookkeeping, which needs every query's attention."""
    if states[0].track_accumulated:
        raise ValueError("generate_keeping cannot keep accumulated attention; use generate_batched and append")
    return _generate(states, first_logits, max_new_tokens, stop_ids, on_token, keep=True)


def _generate(
    states: list[KVState], first_logits: list[torch.Tensor], max_new_tokens: int, stop_ids: set[int],
    on_token: Callable[[int, list[int]], None] | None, keep: bool = False,
) -> tuple[list[list[int]], torch.Tensor | None]:
    """The replies of ``generate_batched`` and, with ``keep``, the first state's kept logits (``generate_keeping``)."""
    def same_logits(a: int, b: int) -> bool:
        return torch.equal(first_logits[a], first_logits[b])

    # in order: the kept state, the first, leads the first group
    groups = [sub for g in groups_of_identical(states) for sub in grouped(g, same_logits)]
    leaders = [states[g[0]] for g in groups]

    def each_member(row: int, ids: list[int]) -> None:
        for i in groups[row]:
            on_token(i, ids)

    stream_rows = each_member if on_token else None
    if len(leaders) == 1:
        stream, first = (lambda ids: each_member(0, ids)) if on_token else None, first_logits[groups[0][0]]
        reply, kept = leaders[0].generate_kept(first, max_new_tokens, stop_ids, stream) if keep else \
            (leaders[0].generate(first, max_new_tokens, stop_ids, stream), None)
        replies = [reply]
    else:
        replies, kept = _decode_rows(leaders, [first_logits[g[0]] for g in groups], max_new_tokens, stop_ids,
                                     stream_rows, keep_first=keep)
    out: list[list[int]] = [[] for _ in states]
    for group, reply in zip(groups, replies):
        for i in group:
            out[i] = list(reply)
    return out, kept


def _decode_rows(
    states: list[KVState], first_logits: list[torch.Tensor], max_new_tokens: int, stop_ids: set[int],
    on_token: Callable[[int, list[int]], None] | None, keep_first: bool = False,
) -> tuple[list[list[int]], torch.Tensor | None]:
    """Greedy decoding of several different caches as rows of one forward per step, in ``row_groups``.

    Each row's reply follows ``decode.Reply``, the stop rule of every kvlab generation; a group whose
    replies are all done leaves the forward. With ``keep_first`` the first state decodes on its own cache, which
    keeps the tokens it was fed (see ``generate_keeping``), and its logits [fed + 1, vocab] are returned too.
    """
    lm = states[0].lm
    replies = [Reply(max_new_tokens, stop_ids, (lambda ids, row=row: on_token(row, ids)) if on_token else None)
               for row in range(len(states))]
    tokens = [int(logits.argmax()) for logits in first_logits]
    base = torch.stack([s.next_positions(1) for s in states])  # [rows, 1]
    rest = list(range(int(keep_first), len(states)))
    groups = [[rest[j] for j in g] for g in row_groups([states[i] for i in rest], max_new_tokens)]
    parts: list[RowGroup | None] = [_slab_group([states[i] for i in g], max_new_tokens) for g in groups]
    if keep_first:
        groups.insert(0, [0])
        parts.insert(0, None)  # the kept state's own cache, described anew at each step as it grows
    holder = states[0] if keep_first else None
    old_lengths = holder.lengths() if holder else None
    kept = [first_logits[0]]  # the kept state's, one per step it took part in
    try:
        for step in range(max_new_tokens):
            for reply, token in zip(replies, tokens):
                reply.take(token)
            if all(r.done for r in replies):
                break
            live = [k for k, g in enumerate(groups) if not all(replies[i].done for i in g)]
            rows = [i for k in live for i in groups[k]]
            own = [parts[k] or RowGroup(1, holder.cache.layers, (None,), holder.key_valid(step + 1),
                                        holder.key_positions(step + 1), (holder.row_reads(),)) for k in live]
            logits = run_groups(lm, torch.tensor([tokens[i] for i in rows])[:, None], base[rows] + step, own,
                                logits_to_keep=1)[:, -1]  # [rows, vocab], the model's own (scaled, capped)
            if holder and rows[0] == 0:  # the kept reply's logits, which its caller scores the others by
                kept.append(logits[0])
            for i, token in zip(rows, logits.argmax(-1).tolist()):
                tokens[i] = token
        if holder:
            fed = replies[0].tokens[: len(kept) - 1]
            holder.record_append(fed, base[0] + torch.arange(len(fed), device=lm.device), None)
    except BaseException:  # nothing was recorded: drop what the kept cache took
        if holder:
            holder.truncate(old_lengths)
        raise
    return [r.tokens for r in replies], torch.stack(kept) if holder else None
