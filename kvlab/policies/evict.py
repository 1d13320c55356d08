"""Applying a policy to a KV state: score every slot, keep each head's top-``budget``."""

from __future__ import annotations

import torch

from kvlab.engine.attention import Probe
from kvlab.engine.kvstate import KVState, to_kv_heads
from kvlab.engine.rope import mean_rotation
from kvlab.policies import LayerView, Policy


def layer_view(state: KVState, layer: int, budget: int, probe: Probe | None) -> LayerView:
    """The per-layer evidence a policy scores from, attention aggregated to KV heads."""
    heads = state.lm.facts.n_kv_heads
    windows = probe.window_means if probe else {}
    start = int(state.next_positions(1)[0])  # the next query's rotary position, in the keys' current frame

    def future_rotation(n: int) -> torch.Tensor:
        return mean_rotation(state.lm, layer, start, n)

    positions = state.positions[layer]
    return LayerView(
        layer=layer,
        budget=budget,
        positions=positions,
        keys=state.cache.layers[layer].keys[0],
        window_mean={n: to_kv_heads(per_layer[layer], heads) for n, per_layer in windows.items()},
        accumulated=state.accumulated[layer] if state.track_accumulated else None,
        values=state.cache.layers[layer].values[0],
        query_mean={p: per_layer[layer] for p, per_layer in (probe.query_means if probe else {}).items()
                    if layer in per_layer},
        query_cov={p: per_layer[layer] for p, per_layer in (probe.query_covs if probe else {}).items()
                   if layer in per_layer},
        future_rotation=future_rotation if state.lm.facts.has_rope else None,
        future=None if state.future is None else to_kv_heads(state.future.at(state.tokens, layer), heads).gather(
            -1, positions),
    )


def keep_index(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """[kv_heads, budget] slots to keep, in slot order: the highest scores, ties going to the older slot.

    A stable sort rather than ``topk``, whose choice among equal scores differs between devices.
    """
    order = scores.sort(dim=-1, descending=True, stable=True).indices  # [kv_heads, slots]
    return order[:, :budget].sort(dim=-1).values


@torch.no_grad()
def evict(state: KVState, policy: Policy, budgets: list[int], probe: Probe | None) -> int:
    """Shrink every layer above its budget to the budget; returns the number of slots dropped."""
    dropped = 0
    if not policy.evicts:
        return dropped
    for layer, (slots, budget) in enumerate(zip(state.lengths(), budgets)):
        if slots <= budget:
            continue
        scores = policy.scores(layer_view(state, layer, budget, probe))  # [kv_heads, slots]
        window = state.lm.facts.window(layer)
        if window is not None:  # slots a sliding layer keeps only for another head's sake are never chosen
            scores = scores.masked_fill(state.positions[layer] <= state.seen - window, float("-inf"))
        index = keep_index(scores, budget)
        state.keep(layer, index)
        dropped += (slots - budget) * index.shape[0]
    state.realign()
    return dropped
