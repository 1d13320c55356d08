"""AdaKV (Feng et al., 2024): one top-k over every head of a layer, with a per-head floor.

Reference: NVIDIA/kvpress ``kvpress/presses/adakv_press.py`` (``AdaKVPress.compress``): the wrapped
scorer scores every slot of every KV head; each head's top ``int(budget · alpha_safeguard)`` slots
are forced in (the safeguard); then the layer keeps the top ``budget × kv_heads`` slots over all its
heads together, so a head that attention concentrates on keeps more keys and a diffuse one fewer.
The authors' own code (FFY0/AdaKV ``adaptive_snapkv/monkeypatch/snapkv_utils.py``,
``AdaptiveSnapKVCluster``) wraps SnapKV, the default scorer here. Unlike kvpress, which masks the
pruned keys inside attention, kvlab really drops them: each head holds its own number of keys.

Every scoring policy can be wrapped, the query-agnostic ones too. ``scorer=kvzip`` ranks KVzip's
reconstruction scores (its pass runs first, as for KVzip alone; KVzip's own ``level`` plays no part, the
budget is AdaKV's: one top-k per layer with the floor). kvpress cannot wrap KVzip (``KVzipPress`` is not a
``ScorerPress``); the authors' own allocation (``level="pair"``) already lets heads and layers differ, without
a floor. ``scorer=keydiff`` ranks KeyDiff's one-anchor score, as kvpress's ``KeyDiffPress`` gives it to
``AdaKVPress``: the paper's block-wise eviction already cuts every head to its own budget, which would leave
the shared top-k nothing to share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy, Wrapper, param


def scoring(policy: type[Policy]) -> bool:
    """Whether AdaKV can rank ``policy``'s scores: it evicts by its own scores alone, every head to its budget (not
    Full or Quest, which keep every key, not DuoAttention's whole heads, not the oracle's future queries, not
    another wrapper)."""
    return (policy.evicts is True and not issubclass(policy, Wrapper) and not policy.needs_future
            and not policy().keeps_growing())


SCORER_PARAMS: dict[str, dict] = {"keydiff": {"block_size": 0}}  # kvpress's one-anchor score (see above)


@dataclass
class AdaKV(Wrapper):
    name, label = "adakv", "AdaKV"
    summary = "head-adaptive budgets: one top-k over all heads of a layer, a floor per head"
    shared_budget = True
    scorer: str = param("snapkv", "the scoring policy whose scores it ranks, at that policy's defaults")
    alpha_safeguard: float = param(0.2, "share of the per-head budget each head keeps whatever the others score",
                                   min=0.0, max=1.0, step=0.05)

    @classmethod
    def choices(cls, param_name: str) -> tuple[str, ...]:
        """The scorers: every registered policy ``scoring`` accepts, plug-ins included."""
        if param_name == "scorer":
            return tuple(name for name, policy in cls.registry.items() if scoring(policy))
        return super().choices(param_name)

    def wrapped(self) -> Policy:
        """The wrapped scoring policy, at its defaults (KeyDiff's one-anchor score)."""
        return self.registry[self.scorer](**SCORER_PARAMS.get(self.scorer, {}))

    def scores(self, view: LayerView) -> torch.Tensor:
        scores = self.wrapped().scores(view)  # [kv_heads, slots]
        eligible = view.eligible if view.eligible is not None else torch.ones_like(scores, dtype=torch.bool)
        scores = scores.masked_fill(~eligible, float("-inf"))
        n_safe = int(view.budget * self.alpha_safeguard)
        if n_safe == 0:
            return scores
        top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :n_safe]  # [kv_heads, n_safe]
        floor = torch.zeros_like(eligible).scatter_(1, top, True) & eligible
        return scores.masked_fill(floor, float("inf"))
