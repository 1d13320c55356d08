"""SnapKV (Li et al., 2024): the last ``window`` queries vote, pooled over neighbouring keys.

Reference: FasterDecoding/SnapKV ``snapkv/monkeypatch/snapkv_utils.py`` (``SnapKVCluster.update_kv``):
the observation window (the newest ``window`` slots) is always kept; only the prefix before it is
scored, by the window queries' attention pooled with ``avg_pool1d(kernel, padding=kernel // 2)``
(zero padding counted, so edge slots are diluted), and its top ``budget − window`` are kept. GQA
follows KVCache-Factory ``pyramidkv/pyramidkv_utils.py`` and kvpress ``snapkv_press.py``: votes are
averaged over each query group before pooling (for average pooling the order does not matter).
``pool_scope="all"`` is kvlab's earlier variant: every slot pooled, the window included, padding
not counted.

Scores come from the queries of the most recent forward (the user message after its prefill,
the reply after it): what this turn asked about, not what the next turn will.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.policies.base import LayerView, Policy, force, param, recent_mask


def pooled(scores: torch.Tensor, kernel: int, pooling: str, count_pad: bool) -> torch.Tensor:
    """Smooth [kv_heads, slots] scores along slots so neighbours of important tokens survive."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    x = scores[None]  # [1, kv_heads, slots]
    pad = kernel // 2
    if pooling == "max":
        out = F.max_pool1d(x, kernel, stride=1, padding=pad)
    else:
        out = F.avg_pool1d(x, kernel, stride=1, padding=pad, count_include_pad=count_pad)
    return out[0, :, : scores.shape[-1]]  # an even kernel yields one extra slot


@dataclass
class SnapKV(Policy):
    name = "snapkv"
    summary = "observation-window attention, pooled; top-k + window"
    window: int = param(32, "observation window: the newest tokens, always kept; their queries vote", min=1)
    kernel: int = param(5, "pooling kernel over neighbouring keys (1 = no pooling)", min=1)
    pooling: str = param("avg", "how votes are pooled over the kernel", choices=("avg", "max"))
    pool_scope: str = param("prefix", "prefix: pool only the slots before the window, zero padding counted "
                                      "(SnapKV's code); all: kvlab's variant, every slot pooled, padding not counted",
                            choices=("prefix", "all"))

    def probe_windows(self) -> tuple[int, ...]:
        return (self.window,)

    def scores(self, view: LayerView) -> torch.Tensor:
        votes = view.window_mean[self.window]  # [kv_heads, slots] mean over the window queries and the group
        keep = recent_mask(view.positions, min(self.window, view.budget))
        if self.pool_scope == "all":
            return force(pooled(votes, self.kernel, self.pooling, count_pad=False), keep)
        prefix = votes.shape[-1] - min(self.window, votes.shape[-1])
        # window slots are never scored: the newest fill the budget first (all of it when budget < window)
        window = votes.new_full((votes.shape[0], votes.shape[-1] - prefix), float("-inf"))
        scores = torch.cat([pooled(votes[:, :prefix], self.kernel, self.pooling, count_pad=True), window], dim=-1)
        return force(scores, keep)
