"""PyramidKV (Cai et al., 2024): SnapKV scoring with per-layer budgets declining bottom → top.

Reference: Zefan-Cai/KVCache-Factory ``pyramidkv/pyramidkv_utils.py`` (``PyramidKVCluster.update_kv``,
the code of Zefan-Cai/PyramidKV). With ``C`` the budget and ``w`` the window, every layer keeps the
window; only the selected part ``C − w`` forms the pyramid, in the code's integer arithmetic:
``min = (C − w) // β``, ``max = 2 (C − w) − min``, ``step = (max − min) // (layers − 1)`` and layer
``i`` selects ``max − i·step`` (the floors leave the total slightly above ``layers × C``). The code's
first short-prompt fallback, no compression below ``C`` tokens, holds for every policy in a chat session
(nothing is evicted while the conversation fits its budget); the others (uniform SnapKV below ``2 (C − w)``,
the bottom layer clamped to the prompt) are not reproduced: the pyramid is fixed by the budget.
``allocation="total"`` is kvlab's variant: the whole budget forms the pyramid, from ``2C − C/β``
down to ``C/β``, summing exactly to ``layers × C`` (top layers may then hold less than the window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.policies.base import param
from kvlab.policies.snapkv import SnapKV


def selected_pyramid(budget: int, n_layers: int, beta: float, window: int) -> list[int]:
    """PyramidKV's per-layer budgets: the window in every layer plus a linear share of ``budget − window``."""
    if n_layers == 1 or budget <= window:  # nothing left to shape: SnapKV's uniform budget
        return [budget] * n_layers
    selected = budget - window
    low = int(selected // beta)
    high = 2 * selected - low
    step = (high - low) // (n_layers - 1)
    return [window + high - i * step for i in range(n_layers)]


def total_pyramid(budget: int, n_layers: int, beta: float) -> list[int]:
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
    summary = "SnapKV scoring; the window in every layer, the rest declining bottom → top"
    beta: float = param(20.0, "pyramid steepness: the top layer selects about (budget − window) / β", min=1.0)
    allocation: str = param("selected", "selected: every layer keeps the window, only budget − window forms the "
                                        "pyramid (PyramidKV's code); total: kvlab's variant, the whole budget does",
                            choices=("selected", "total"))

    def min_budget(self) -> int:
        return 2

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        if self.allocation == "total":
            return total_pyramid(budget, n_layers, self.beta)
        return selected_pyramid(budget, n_layers, self.beta, self.window)
