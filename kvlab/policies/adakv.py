"""AdaKV (Feng et al., 2024): one top-k over every head of a layer, with a per-head floor.

Reference: NVIDIA/kvpress ``kvpress/presses/adakv_press.py`` (``AdaKVPress.compress``): the wrapped
scorer scores every slot of every KV head; each head's top ``int(budget · alpha_safeguard)`` slots
are forced in (the safeguard); then the layer keeps the top ``budget × kv_heads`` slots over all its
heads together, so a head that attention concentrates on keeps more keys and a diffuse one fewer.
The authors' own code (FFY0/AdaKV ``adaptive_snapkv/monkeypatch/snapkv_utils.py``,
``AdaptiveSnapKVCluster``) wraps SnapKV, the default scorer here. Unlike kvpress, which masks the
pruned keys inside attention, kvlab really drops them: each head holds its own number of keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy, param
from kvlab.policies.h2o import H2O
from kvlab.policies.knorm import Knorm
from kvlab.policies.pyramidkv import PyramidKV
from kvlab.policies.snapkv import SnapKV
from kvlab.policies.streamingllm import StreamingLLM
from kvlab.policies.tova import TOVA
from kvlab.policies.window import Window

# the scoring policies it wraps, imported here rather than looked up in the registry, which imports this
SCORERS: dict[str, type[Policy]] = {
    cls.name: cls for cls in (SnapKV, PyramidKV, TOVA, H2O, Knorm, StreamingLLM, Window)
}


@dataclass
class AdaKV(Policy):
    name, label = "adakv", "AdaKV"
    summary = "head-adaptive budgets: one top-k over all heads of a layer, a floor per head"
    shared_budget = True
    scorer: str = param("snapkv", "the scoring policy whose scores it ranks, at that policy's defaults",
                        choices=tuple(SCORERS))
    alpha_safeguard: float = param(0.2, "share of the per-head budget each head keeps whatever the others score",
                                   min=0.0, max=1.0, step=0.05)

    def inner(self) -> Policy:
        """The wrapped scoring policy, at its defaults."""
        return SCORERS[self.scorer]()

    @property
    def needs_accumulated(self) -> bool:  # type: ignore[override]
        return self.inner().needs_accumulated

    def probe_windows(self) -> tuple[int, ...]:
        return self.inner().probe_windows()

    def min_budget(self) -> int:
        return self.inner().min_budget()

    def validate(self, budget: int, context_length: int | None = None) -> None:
        self.inner().validate(budget, context_length)

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        return self.inner().layer_budgets(budget, n_layers)

    def scores(self, view: LayerView) -> torch.Tensor:
        scores = self.inner().scores(view)  # [kv_heads, slots]
        eligible = view.eligible if view.eligible is not None else torch.ones_like(scores, dtype=torch.bool)
        scores = scores.masked_fill(~eligible, float("-inf"))
        n_safe = int(view.budget * self.alpha_safeguard)
        if n_safe == 0:
            return scores
        top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :n_safe]  # [kv_heads, n_safe]
        floor = torch.zeros_like(eligible).scatter_(1, top, True) & eligible
        return scores.masked_fill(floor, float("inf"))
