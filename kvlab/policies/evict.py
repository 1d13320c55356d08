"""Applying a policy to a KV state: score every slot, keep each head's top-``budget``."""

from __future__ import annotations

import torch

from kvlab.engine.attention import Probe
from kvlab.engine.kvstate import KVState, to_kv_heads
from kvlab.engine.reconstruction import reconstruct
from kvlab.engine.rope import mean_rotation
from kvlab.policies import LayerView, Policy
from kvlab.policies.base import Collected


def layer_view(state: KVState, layer: int, budget: int, probe: Probe | None, eligible: torch.Tensor) -> LayerView:
    """The per-layer evidence a policy scores from, attention aggregated to KV heads."""
    heads = state.lm.facts.n_kv_heads
    windows = probe.window_means if probe else {}

    def future_rotation(n: int) -> torch.Tensor:  # from the next query's rotary position, in the keys' frame
        return mean_rotation(state.lm, layer, int(state.next_positions(1)[0]), n)

    positions = state.positions[layer]  # [kv_heads, slots]; -1 at a head's padding
    future = None
    if state.future is not None:  # a padding slot reads token 0's attention, then is zeroed: it holds no key
        later = to_kv_heads(state.future.at(state.tokens, layer), heads)  # [kv_heads, seen]
        future = later.gather(-1, positions.clamp(min=0)).masked_fill(positions < 0, 0.0)
    return LayerView(
        layer=layer,
        budget=budget,
        positions=positions,
        keys=state.cache.layers[layer].keys[0],
        window_mean=Collected({n: to_kv_heads(per_layer[layer], heads) for n, per_layer in windows.items()},
                              "window_mean", "probe_windows()"),
        accumulated=state.accumulated[layer] if state.track_accumulated else None,
        values=state.cache.layers[layer].values[0],
        query_mean=Collected({p: per_layer[layer] for p, per_layer in (probe.query_means if probe else {}).items()
                              if layer in per_layer}, "query_mean", "probe_queries()"),
        query_cov=Collected({p: per_layer[layer] for p, per_layer in (probe.query_covs if probe else {}).items()
                             if layer in per_layer}, "query_cov", "probe_queries()"),
        future_rotation=future_rotation if state.lm.facts.has_rope else None,
        future=future,
        eligible=eligible,
        reconstruction=state.layers[layer].reconstruction if state.reconstructed == state.seen else None,
    )


def keep_index(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """[kv_heads, budget] slots to keep, in slot order: the highest scores, ties going to the older slot.

    A stable sort rather than ``topk``, whose choice among equal scores differs between devices. The reference the
    tests hold ``keep_per_head``'s selection to.
    """
    order = scores.sort(dim=-1, descending=True, stable=True).indices  # [kv_heads, slots]
    return order[:, :budget].sort(dim=-1).values


def keep_per_head(scores: torch.Tensor, budget: int | list[int]) -> torch.Tensor:
    """[kv_heads, slots] bool: each head's top ``budget`` (one for all heads, or one per head), as ``keep_index``.

    Every slot above the head's ``budget``-th highest score, then the slots equal to it in slot order: the
    choice of a stable sort, from one selection (a sort of every slot took several times as long).
    """
    heads, slots = scores.shape
    want = [min(max(int(b), 0), slots) for b in (budget if isinstance(budget, (list, tuple)) else [budget] * heads)]
    if max(want) == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    need = torch.tensor(want, device=scores.device).view(-1, 1)  # [kv_heads, 1]
    edge = scores.topk(max(want), dim=-1).values.gather(1, (need - 1).clamp(min=0))  # each head's budget-th score
    above, tied = scores > edge, scores == edge
    return (above | (tied & (tied.cumsum(-1) <= need - above.sum(-1, keepdim=True)))) & (need > 0)


def keep_shared(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """[kv_heads, slots] bool: the top ``budget × kv_heads`` over every head of the layer at once (AdaKV).

    Ties go to the lower head, then the older slot (a stable sort of the flattened scores).
    """
    flat = scores.reshape(-1)
    order = flat.sort(descending=True, stable=True).indices[: budget * scores.shape[0]]
    return torch.zeros_like(flat, dtype=torch.bool).scatter_(0, order, True).view_as(scores)


def keep_model(scores: list[torch.Tensor], budgets: list[int]) -> list[torch.Tensor]:
    """Per layer [kv_heads, slots] bool: the top ``sum(budgets) × kv_heads`` over every head of every layer at
    once (KVzip's one threshold over all its scores). Ties go to the lower layer, the lower head, the older slot."""
    flat = torch.cat([s.reshape(-1) for s in scores])
    total = sum(budgets) * scores[0].shape[0]
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[flat.sort(descending=True, stable=True).indices[:total]] = True
    return [part.view_as(s) for part, s in zip(chosen.split([s.numel() for s in scores]), scores)]


def policy_scores(policy: Policy, view: LayerView, nans: dict[int, torch.Tensor]) -> torch.Tensor:
    """The policy's scores of one layer's slots [kv_heads, slots], -inf where a slot may not be kept; ``nans`` gets
    the layer's count of NaN scores where a key may be kept (``check_nans`` reads every layer's at once).

    A plug-in's ``scores`` is checked here, where every policy's are used: a tensor of floats, one per slot, none
    NaN where a key may be kept. A NaN compares false with everything, so a top-k over it keeps an arbitrary set
    (and fewer keys than the budget); an error instead drops the policy from the run, which shows it as failed.
    """
    scores = policy.scores(view)
    what = f"{policy.name}.scores() at layer {view.layer}"
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"{what} returned {got}, not a tensor of floats")
    if scores.shape != view.positions.shape:
        raise ValueError(f"{what} returned shape {tuple(scores.shape)}, not one score per slot "
                         f"{tuple(view.positions.shape)} (KV heads × slots)")
    nan = scores.isnan() if view.eligible is None else scores.isnan() & view.eligible  # padding's score is unused
    nans[view.layer] = nan.sum()
    return scores if view.eligible is None else scores.masked_fill(~view.eligible, float("-inf"))


def check_nans(policy: Policy, nans: dict[int, torch.Tensor]) -> None:
    """Raise where ``policy_scores`` counted NaN scores: one read for the whole eviction (on a GPU each read waits
    for the queue). The cache may already keep what they chose; the failed policy is dropped with it."""
    counts = torch.stack(list(nans.values())).tolist() if nans else []
    if bad := next(((layer, n) for layer, n in zip(nans, counts) if n), None):
        raise ValueError(f"{policy.name}.scores() at layer {bad[0]} returned NaN for {bad[1]} slots where a key may "
                         "be kept")


def _eligible(state: KVState, layer: int) -> torch.Tensor:
    """[kv_heads, slots]: the slots of ``layer`` a policy may keep: real keys, inside a sliding layer's window
    (slots such a layer keeps only for another head's sake are never chosen)."""
    lay = state.layers[layer]
    window = state.lm.facts.window(layer)
    return lay.real if window is None else lay.real & (lay.positions > state.seen - window)


@torch.no_grad()
def evict(state: KVState, policy: Policy, budgets: list[int], probe: Probe | None) -> int:
    """Shrink every layer above its budget to the budget; returns the number of slots dropped.

    A budget is keys per KV head (each head's own where the policy gives ``head_budgets``); a ``shared_budget``
    policy spends ``budget × kv_heads`` over the layer's heads together, so heads may keep different numbers of
    keys; a ``model_budget`` policy spends the sum of every layer's over the whole model, so layers may too. A
    policy that ``needs_reconstruction`` first has the slots appended since its last pass scored
    (``engine.reconstruction``; a session runs that pass itself before, to time it).
    """
    if not policy.evicts:
        return 0
    if policy.needs_reconstruction:
        reconstruct(state, policy.repeat_spec())
    if policy.model_budget:
        return _evict_model(state, policy, budgets, probe)
    before = state.head_lengths()  # one read of every layer's counts: on a GPU each read waits for the queue
    nans: dict[int, torch.Tensor] = {}
    for layer, (counts, budget) in enumerate(zip(before, budgets)):
        heads = None if policy.shared_budget else policy.head_budgets(layer, budget, len(counts))
        if sum(counts) <= budget * len(counts) if heads is None else all(map(int.__le__, counts, heads)):
            continue
        eligible = _eligible(state, layer)
        scores = policy_scores(policy, layer_view(state, layer, budget, probe, eligible), nans)
        keep = keep_shared(scores, budget) if heads is None else keep_per_head(scores, heads)
        state.keep(layer, keep)
    check_nans(policy, nans)
    state.realign()
    return sum(map(sum, before)) - sum(map(sum, state.head_lengths()))


def _evict_model(state: KVState, policy: Policy, budgets: list[int], probe: Probe | None) -> int:
    """``evict`` for a ``model_budget`` policy: one top-k over every slot of every layer and head."""
    held = sum(map(sum, state.head_lengths()))
    if held <= sum(budgets) * state.lm.facts.n_kv_heads:
        return 0
    scores: list[torch.Tensor] = []
    nans: dict[int, torch.Tensor] = {}
    for layer, budget in enumerate(budgets):
        eligible = _eligible(state, layer)
        scores.append(policy_scores(policy, layer_view(state, layer, budget, probe, eligible), nans))
    check_nans(policy, nans)
    for layer, keep in enumerate(keep_model(scores, budgets)):
        state.keep(layer, keep)
    state.realign()
    return held - sum(map(sum, state.head_lengths()))
