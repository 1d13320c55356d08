"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus a recent window.

Reference: FMInference/H2O ``h2o_hf/utils_real_drop/modify_llama.py`` (``H2OKVCache_LayerWise``:
the newest ``recent_size`` slots, then the ``hh_size`` older slots with the largest attention summed
over every query). Its scripts set ``heavy_ratio = recent_ratio``, so half the budget is recent.
Attention is summed over every query the cache has seen, across turns, so what was heavy in
turn 1 stays heavy unless later queries outweigh it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy, force, param, recent_mask


@dataclass
class H2O(Policy):
    name = "h2o"
    summary = "accumulated-attention heavy hitters + recent window"
    needs_accumulated = True
    recent_ratio: float = param(0.5, "share of the budget kept as the newest tokens; the rest are heavy hitters",
                                min=0.0, max=1.0, step=0.05)

    def min_budget(self) -> int:
        return 2

    def scores(self, view: LayerView) -> torch.Tensor:
        n_recent = int(round(view.budget * self.recent_ratio))
        assert view.accumulated is not None
        return force(view.accumulated, recent_mask(view.positions, n_recent))
