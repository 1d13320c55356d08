"""Running several policies' caches through the model together.

A ChatSession feeds every policy the same tokens. Three facts keep that cheap:

- caches that never lost a slot hold the same tokens at the same positions and are identical, so
  one of them runs and the others copy its result (``same_cache``);
- the rest run as rows of one forward, so the model's weights are read once for all of them: on a CPU,
  and in a GPU's decoding steps, that read is most of a forward's cost;
- each row attends over keys of its own (``attention.RowGroup``). An append runs every row on its state's
  own cache, whose room takes the new keys in place. A reply's decoding steps run in groups of similar
  length (``row_groups``): a group's caches are copied once into a slab [rows, kv_heads, longest + room,
  head_dim] whose padded slots are masked out, so each step attends once per group and costs no copy, and
  no row is padded to more than twice its size. Full's long cache never makes the compressed ones cost
  what it costs.

A forward returns no more than ``LOGITS_BUDGET`` logits at once. The states' own caches change only in
``append_together``, which keeps the new tokens; ``generate_batched`` leaves them as they were.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvlab.engine.attention import Probe, RowGroup
from kvlab.engine.cache import new_cache
from kvlab.engine.decode import Reply
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run
from kvlab.engine.kvstate import KVState

LOGITS_BUDGET = 1 << 27  # logits elements one batched forward may return (512 MB in float32)


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


class RowsLayer(DynamicLayer):
    """One layer of a forward's cache whose rows attend in ``RowGroup``s: ``update`` gives each group's own
    layer its rows' new keys, and each group's attention reads them there."""

    def __init__(self, parts: list[DynamicLayer], sizes: list[int]) -> None:
        super().__init__()
        self.parts, self.sizes = parts, sizes  # per group: its layer and its number of rows
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for part, keys, values in zip(self.parts, key_states.split(self.sizes), value_states.split(self.sizes)):
            part.update(keys, values)  # [group rows, kv_heads, n, head_dim]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max(part.get_seq_length() for part in self.parts)


def _run_groups(lm: LoadedModel, ids: torch.Tensor, positions: torch.Tensor, groups: list[RowGroup],
                logits_to_keep: int = 0, hidden_only: bool = False) -> torch.Tensor:
    """``forward.run`` of ids [rows, n] at positions [rows, n], the rows in ``groups`` in order."""
    cache = new_cache(lm)
    sizes = [g.rows for g in groups]
    cache.layers[:] = [RowsLayer([g.layers[layer] for g in groups], sizes) for layer in range(lm.facts.n_layers)]
    return run(lm, ids, positions, cache, logits_to_keep, hidden_only=hidden_only, groups=groups)


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


def _grouped(indices: list[int], same: Callable[[int, int], bool]) -> list[list[int]]:
    """``indices`` in groups of equals under ``same``, in order of first appearance; the first one leads."""
    groups: list[list[int]] = []
    for i in indices:
        home = next((g for g in groups if same(g[0], i)), None)
        if home is None:
            groups.append([i])
        else:
            home.append(i)
    return groups


def groups_of_identical(states: list[KVState]) -> list[list[int]]:
    """Indices of ``states`` grouped so that each group's caches are identical; the first one leads."""
    return _grouped(list(range(len(states))), lambda a, b: states[a].same_cache(states[b]))


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


def _merged(probes: list[Probe | None]) -> Probe | None:
    """One probe that collects everything any of ``probes`` asks for."""
    asked = [p for p in probes if p is not None and p.asks]
    if not asked:
        return None
    # the states of a group hold the same tokens at the same positions: one un-rotation serves them all
    first = next((p for p in asked if p.queries_from), Probe())
    return Probe(windows=tuple(sorted({n for p in asked for n in p.windows})), colsum=any(p.colsum for p in asked),
                 queries_from=tuple(sorted({s for p in asked for s in p.queries_from})), unrotate=first.unrotate,
                 first_position=first.first_position)


def _hand_out(merged: Probe | None, probe: Probe | None) -> None:
    """Give ``probe`` its share of the statistics ``merged`` collected."""
    if merged is None or probe is None:
        return
    probe.window_means = {n: merged.window_means[n] for n in probe.windows}
    if probe.colsum:
        probe.colsums = merged.colsums
    probe.query_means = {s: merged.query_means[s] for s in probe.queries_from if s in merged.query_means}
    probe.query_covs = {s: merged.query_covs[s] for s in probe.queries_from if s in merged.query_covs}


@torch.no_grad()
def append_together(
    states: list[KVState],
    ids: list[int],
    probes: list[Probe | None] | None = None,
    logits_to_keep: int = 0,
    reduce: Callable[[int, torch.Tensor], Any] | None = None,
) -> list[Any]:
    """``KVState.append`` of the same tokens to every state, in as few forwards as their caches allow.

    Returns each state's logits, or ``reduce(index, logits)`` when given: then no more than one
    forward's logits (``LOGITS_BUDGET`` elements) are held at a time, however long ``ids`` is.
    """
    if not ids:
        return [None] * len(states) if reduce else [torch.empty(0, states[0].lm.facts.vocab_size)] * len(states)
    probes = [s.prepare_probe(p) for s, p in zip(states, probes or [None] * len(states))]
    groups = groups_of_identical(states)
    merged = [_merged([probes[i] for i in g]) for g in groups]
    old_lengths = [s.lengths() for s in states]
    rope = [s.next_positions(len(ids)) for s in states]
    rows_per_forward = max(1, LOGITS_BUDGET // ((logits_to_keep or len(ids)) * states[0].lm.facts.vocab_size))
    out: list[Any] = [None] * len(states)
    try:
        for start in range(0, len(groups), rows_per_forward):
            chunk, chunk_probes = groups[start : start + rows_per_forward], merged[start : start + rows_per_forward]
            leaders = [states[g[0]] for g in chunk]
            if len(leaders) == 1:
                lead = leaders[0]
                logits = [lead.forward(torch.tensor(ids, device=lead.lm.device), rope[chunk[0][0]],
                                        chunk_probes[0], logits_to_keep)]
            else:
                logits = _forward_rows(leaders, ids, chunk_probes, logits_to_keep)
            for group, row_logits, probe in zip(chunk, logits, chunk_probes):
                for i in group:
                    if i != group[0]:
                        states[i].copy_cache(states[group[0]])
                    _hand_out(probe, probes[i])
                    out[i] = reduce(i, row_logits) if reduce else row_logits
            del logits, row_logits
    except BaseException:  # no state records tokens its cache does not hold, or the reverse
        for s, old in zip(states, old_lengths):
            s.truncate(old)
        raise
    for s, r, p, old in zip(states, rope, probes, old_lengths):
        s.record_append(ids, r, p, old)
    return out


def _slab_group(states: list[KVState], room: int) -> RowGroup:
    """The states' caches as one group of decoding rows (no statistics) on a slab with ``room`` new slots."""
    cache, valid, longest = _slab_cache(states, room)
    return RowGroup(len(states), cache.layers, (None,) * len(states), valid, _slab_positions(states, longest, room),
                    tuple(s.row_reads() for s in states))


def _forward_rows(
    states: list[KVState], ids: list[int], probes: list[Probe | None], logits_to_keep: int
) -> list[torch.Tensor]:
    """One forward of ``ids`` on every state's cache, each row attending over its own cache, where its new keys
    go in place: a slab would copy every cache in and the new keys out (measured: four streams side by side took
    0.97× the time without it), and a row of its own sums its columns in its attention (H2O)."""
    lm = states[0].lm
    n = len(ids)
    parts = [RowGroup(1, s.cache.layers, (probe,), s.key_valid(n), s.key_positions(n), (s.row_reads(),))
             for s, probe in zip(states, probes)]
    position_ids = torch.stack([s.next_positions(n) for s in states])  # [rows, n]
    input_ids = torch.tensor(ids, device=lm.device).expand(len(states), n)
    logits = _run_groups(lm, input_ids, position_ids, parts, logits_to_keep)  # [rows, n or keep, vocab]
    return list(logits)


def _greedy_tokens(lm: LoadedModel, hidden: torch.Tensor) -> list[int]:
    """Argmax of the output head for each row of hidden [rows, hidden_size].

    Computed as weight @ hiddenᵀ: on CPU BLAS a vocab-sized product with a few rows runs about three
    times faster this way round than as ``linear``. Final logit scaling or soft-capping is monotonic,
    so the argmax is the model's own.
    """
    head = lm.model.get_output_embeddings()
    scores = head.weight @ hidden.to(head.weight.dtype).T  # [vocab, rows]
    if getattr(head, "bias", None) is not None:
        scores = scores + head.bias[:, None]
    return scores.argmax(0).tolist()


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
    def same_logits(a: int, b: int) -> bool:
        return torch.equal(first_logits[a], first_logits[b])

    groups = [sub for g in groups_of_identical(states) for sub in _grouped(g, same_logits)]
    leaders = [states[g[0]] for g in groups]

    def each_member(row: int, ids: list[int]) -> None:
        for i in groups[row]:
            on_token(i, ids)

    stream_rows = each_member if on_token else None
    if len(leaders) == 1:
        stream = (lambda ids: each_member(0, ids)) if on_token else None
        replies = [leaders[0].generate(first_logits[groups[0][0]], max_new_tokens, stop_ids, stream)]
    else:
        replies = _decode_rows(leaders, [first_logits[g[0]] for g in groups], max_new_tokens, stop_ids, stream_rows)
    out: list[list[int]] = [[] for _ in states]
    for group, reply in zip(groups, replies):
        for i in group:
            out[i] = list(reply)
    return out


def _decode_rows(
    states: list[KVState], first_logits: list[torch.Tensor], max_new_tokens: int, stop_ids: set[int],
    on_token: Callable[[int, list[int]], None] | None,
) -> list[list[int]]:
    """Greedy decoding of several different caches as rows of one forward per step, in ``row_groups``.

    Each row's reply follows ``decode.Reply``, the stop rule of every kvlab generation; a group whose
    replies are all done leaves the forward.
    """
    lm = states[0].lm
    replies = [Reply(max_new_tokens, stop_ids, (lambda ids, row=row: on_token(row, ids)) if on_token else None)
               for row in range(len(states))]
    tokens = [int(logits.argmax()) for logits in first_logits]
    base = torch.stack([s.next_positions(1) for s in states])  # [rows, 1]
    groups = row_groups(states, max_new_tokens)
    parts = [_slab_group([states[i] for i in g], max_new_tokens) for g in groups]
    for step in range(max_new_tokens):
        for reply, token in zip(replies, tokens):
            reply.take(token)
        if all(r.done for r in replies):
            break
        live = [k for k, g in enumerate(groups) if not all(replies[i].done for i in g)]
        rows = [i for k in live for i in groups[k]]
        hidden = _run_groups(lm, torch.tensor([tokens[i] for i in rows])[:, None], base[rows] + step,
                             [parts[k] for k in live], hidden_only=True)[:, -1]
        for i, token in zip(rows, _greedy_tokens(lm, hidden)):  # hidden: [rows, hidden_size]
            tokens[i] = token
    return [r.tokens for r in replies]
