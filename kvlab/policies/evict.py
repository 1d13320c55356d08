"""Applying a policy to a KV state: score every slot, keep each head's top-``budget``."""

from __future__ import annotations

import torch

from kvlab.engine.attention import Probe
from kvlab.engine.kvstate import KVState, to_kv_heads
from kvlab.policies import LayerView, Policy


def layer_view(state: KVState, layer: int, budget: int, probe: Probe | None) -> LayerView:
    """The per-layer evidence a policy scores from, aggregated to KV heads."""
    heads = state.lm.facts.n_kv_heads
    windows = probe.window_means if probe else {}
    return LayerView(
        layer=layer,
        budget=budget,
        positions=state.positions[layer],
        keys=state.cache.layers[layer].keys[0],
        window_mean={n: to_kv_heads(per_layer[layer], heads) for n, per_layer in windows.items()},
        accumulated=state.accumulated[layer] if state.track_accumulated else None,
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
