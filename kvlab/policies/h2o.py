"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus a recent window.

Attention is summed over every query the cache has seen, across turns, so what was heavy in
turn 1 stays heavy unless later queries outweigh it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy, force, recent_mask, require


@dataclass
class H2O(Policy):
    name = "h2o"
    summary = "accumulated-attention heavy hitters + recent window"
    needs_accumulated = True
    recent_ratio: float = 0.5

    def check(self) -> None:
        require(isinstance(self.recent_ratio, (int, float)) and 0 <= self.recent_ratio <= 1,
                f"h2o: recent_ratio must be between 0 and 1, not {self.recent_ratio!r}")

    def min_budget(self) -> int:
        return 2

    def scores(self, view: LayerView) -> torch.Tensor:
        n_recent = int(round(view.budget * self.recent_ratio))
        assert view.accumulated is not None
        return force(view.accumulated, recent_mask(view.positions, n_recent))
