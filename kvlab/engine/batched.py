"""Feeding several policies' caches the same tokens together.

A ChatSession feeds every policy the same tokens. Three facts keep that cheap:

- caches that never lost a slot hold the same tokens at the same positions and are identical, so
  one of them runs and the others copy its result (``same_cache``);
- the rest run as rows of one forward, so the model's weights are read once for all of them: on a CPU,
  and in a GPU's decoding steps, that read is most of a forward's cost;
- each row attends over keys of its own (``attention.RowGroup``), on its state's own cache, whose room takes
  the new keys in place. Rows fed different numbers of tokens (Full, holding the reply it decoded, is fed only
  its end) lie one after another in one row: none is padded.

A forward returns no more than ``LOGITS_BUDGET`` logits at once. Decoding several replies together is
``batched_decode``'s.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicLayer

from kvlab.engine.attention import Probe, RowGroup
from kvlab.engine.cache import new_cache
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run
from kvlab.engine.kvstate import KVState

LOGITS_BUDGET = 1 << 27  # logits elements one batched forward may return (512 MB in float32)


class RowsLayer(DynamicLayer):
    """One layer of a forward's cache whose rows attend in ``RowGroup``s: ``update`` gives each group's own
    layer its rows' new keys, and each group's attention reads them there."""

    def __init__(self, parts: list[DynamicLayer], sizes: list[int], dim: int = 0) -> None:
        super().__init__()
        # per group: its layer and its number of rows (dim 0) or of row 0's tokens (dim -2: a ragged forward)
        self.parts, self.sizes, self.dim = parts, sizes, dim
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for part, keys, values in zip(self.parts, key_states.split(self.sizes, self.dim),
                                      value_states.split(self.sizes, self.dim)):
            part.update(keys, values)  # [group rows, kv_heads, n, head_dim] or [1, kv_heads, tokens, head_dim]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max(part.get_seq_length() for part in self.parts)


def run_groups(lm: LoadedModel, ids: torch.Tensor, positions: torch.Tensor, groups: list[RowGroup],
               logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
    """``forward.run`` of ids [rows, n] at positions [rows, n], the rows in ``groups`` in order (or, where the
    groups count ``tokens``, of ids [1, Σ tokens], one group's tokens after another's)."""
    cache = new_cache(lm)
    sizes, dim = ([g.tokens for g in groups], -2) if groups[0].tokens else ([g.rows for g in groups], 0)
    cache.layers[:] = [RowsLayer([g.layers[layer] for g in groups], sizes, dim) for layer in range(lm.facts.n_layers)]
    return run(lm, ids, positions, cache, logits_to_keep, groups=groups)


def grouped(indices: list[int], same: Callable[[int, int], bool]) -> list[list[int]]:
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
    """Indices of ``states`` grouped so that each group's caches are identical, in order; the first one leads."""
    return grouped(list(range(len(states))), lambda a, b: states[a].same_cache(states[b]))


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
    held: list[int] | None = None,
) -> list[Any]:
    """``KVState.append`` of the same tokens to every state, in as few forwards as their caches allow.

    Returns each state's logits, or ``reduce(index, logits)`` when given: then no more than one
    forward's logits (``LOGITS_BUDGET`` elements) are held at a time, however long ``ids`` is.
    ``held``: per state, how many of the first ``ids`` its cache already holds (a reply it kept as it decoded
    it), fewer than all; it is fed the rest, and its logits are the rest's.
    """
    if not ids:
        return [None] * len(states) if reduce else [torch.empty(0, states[0].lm.facts.vocab_size)] * len(states)
    held = held or [0] * len(states)
    if len(held) != len(states) or not all(0 <= h < len(ids) for h in held):
        raise ValueError(f"held {held}: one count per state, each below the {len(ids)} tokens fed (a state holding "
                         "them all has nothing to be fed)")
    feeds = [ids[h:] for h in held]
    probes = [s.prepare_probe(p) for s, p in zip(states, probes or [None] * len(states))]
    groups = grouped(list(range(len(states))), lambda a, b: held[a] == held[b] and states[a].same_cache(states[b]))
    merged = [_merged([probes[i] for i in g]) for g in groups]
    old_lengths = [s.lengths() for s in states]
    rope = [s.next_positions(len(feed)) for s, feed in zip(states, feeds)]
    rows_per_forward = max(1, LOGITS_BUDGET // ((logits_to_keep or len(ids)) * states[0].lm.facts.vocab_size))
    out: list[Any] = [None] * len(states)
    try:
        for start in range(0, len(groups), rows_per_forward):
            chunk, chunk_probes = groups[start : start + rows_per_forward], merged[start : start + rows_per_forward]
            leaders = [states[g[0]] for g in chunk]
            if len(leaders) == 1:
                lead = leaders[0]
                logits = [lead.forward(torch.tensor(feeds[chunk[0][0]], device=lead.lm.device), rope[chunk[0][0]],
                                        chunk_probes[0], logits_to_keep)]
            else:
                logits = _forward_rows(leaders, [feeds[g[0]] for g in chunk], chunk_probes, logits_to_keep)
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
    for s, feed, r, p in zip(states, feeds, rope, probes):
        s.record_append(feed, r, p)
    return out


def _forward_rows(
    states: list[KVState], feeds: list[list[int]], probes: list[Probe | None], logits_to_keep: int
) -> list[torch.Tensor]:
    """One forward of each state's ``feeds`` tokens on its cache, each row attending over its own cache, where its
    new keys go in place: a slab would copy every cache in and the new keys out (measured: four streams side by
    side took 0.97× the time without it), and a row of its own sums its columns in its attention (H2O). Feeds of
    different lengths lie one after another in one row (no row is padded to the longest)."""
    lm = states[0].lm
    sizes = [len(feed) for feed in feeds]
    ragged = len(set(sizes)) > 1
    parts = [RowGroup(1, s.cache.layers, (probe,), s.key_valid(n), s.key_positions(n), (s.row_reads(),),
                      tokens=n if ragged else 0) for s, probe, n in zip(states, probes, sizes)]
    positions = [s.next_positions(n) for s, n in zip(states, sizes)]
    if not ragged:
        input_ids = torch.tensor(feeds[0], device=lm.device).expand(len(states), sizes[0])
        return list(run_groups(lm, input_ids, torch.stack(positions), parts, logits_to_keep))  # [rows, n, vocab]
    input_ids = torch.tensor([t for feed in feeds for t in feed], device=lm.device)[None]  # [1, Σ n]
    kept = [min(n, logits_to_keep) if logits_to_keep else n for n in sizes]
    at: int | torch.Tensor = 0  # every position's logits
    if logits_to_keep:  # each row's last positions only
        at = torch.cat([torch.arange(end - k, end) for end, k in zip(accumulate(sizes), kept)]).to(lm.device)
    logits = run_groups(lm, input_ids, torch.cat(positions)[None], parts, at)[0]  # [Σ kept, vocab]
    return list(logits.split(kept))
