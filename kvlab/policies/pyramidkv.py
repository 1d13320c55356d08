"""PyramidKV (Cai et al., 2024): SnapKV scoring with budgets declining linearly bottom → top.

The bottom layer gets ``2b − b/β``, the top ``b/β``; the total stays ``n_layers × b``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.policies.base import require
from kvlab.policies.snapkv import SnapKV


def pyramid_budgets(budget: int, n_layers: int, beta: float) -> list[int]:
    """Integer per-layer budgets, linear from bottom to top, summing exactly to n_layers × budget."""
    if n_layers == 1:
        return [budget]
    low = max(1.0, budget / beta)
    high = 2 * budget - low
    raw = [high - (high - low) * i / (n_layers - 1) for i in range(n_layers)]
    out = [math.floor(r) for r in raw]
    # the rounding remainder goes to the layers with the largest fractional parts
    by_fraction = sorted(range(n_layers), key=lambda i: out[i] - raw[i])
    for i in by_fraction[: budget * n_layers - sum(out)]:
        out[i] += 1
    return out


@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    summary = "SnapKV scoring, per-layer budgets declining bottom → top"
    beta: float = 20.0

    def check(self) -> None:
        super().check()
        require(isinstance(self.beta, (int, float)) and self.beta >= 1, f"pyramidkv: beta must be ≥ 1, not {self.beta!r}")

    def min_budget(self) -> int:
        return 2

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        return pyramid_budgets(budget, n_layers, self.beta)
