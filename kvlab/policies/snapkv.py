"""SnapKV (Li et al., 2024): the last ``window`` queries vote, pooled over neighbouring keys.

Scores come from the queries of the most recent forward (the user message after its prefill,
the reply after it): what this turn asked about, not what the next turn will.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.policies.base import LayerView, Policy, force, recent_mask, require


def pooled(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Smooth [kv_heads, slots] scores along slots so neighbours of important tokens survive."""
    if kernel <= 1:
        return scores
    x = scores[None]  # [1, kv_heads, slots]
    pad = kernel // 2
    if pooling == "max":
        out = F.max_pool1d(x, kernel, stride=1, padding=pad)
    else:
        out = F.avg_pool1d(x, kernel, stride=1, padding=pad, count_include_pad=False)
    return out[0, :, : scores.shape[-1]]


@dataclass
class SnapKV(Policy):
    name = "snapkv"
    summary = "observation-window attention, pooled; top-k + window"
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"

    def check(self) -> None:
        require(isinstance(self.window, int) and self.window >= 1, f"{self.name}: window must be ≥ 1, not {self.window!r}")
        require(isinstance(self.kernel, int) and self.kernel >= 1, f"{self.name}: kernel must be ≥ 1, not {self.kernel!r}")
        require(self.pooling in ("avg", "max"), f"{self.name}: pooling must be 'avg' or 'max', not {self.pooling!r}")

    def probe_windows(self) -> tuple[int, ...]:
        return (self.window,)

    def scores(self, view: LayerView) -> torch.Tensor:
        votes = pooled(view.window_mean[self.window], self.kernel, self.pooling)
        return force(votes, recent_mask(view.positions, min(self.window, view.budget)))
