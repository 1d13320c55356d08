"""KeyDiff (Park et al., 2025): keep the keys least similar (cosine) to the mean key; no attention needed.

Reference: NVIDIA/kvpress ``kvpress/presses/keydiff_press.py`` (``KeyDiffPress``: score = −cos(k, a)
with the anchor ``a`` the mean of the L2-normalised keys, per layer and KV head) and
``kvpress/presses/block_press.py`` (``BlockPress``, which kvpress names as the way to reproduce the
paper's block-wise prompt processing, block 128 in the paper and in kvpress's PR #86): the cache's
first ``budget`` slots are kept, then each block of ``block_size`` later slots joins them, the
anchor is taken over that candidate set and its ``budget`` most distinctive keys stay. So the
anchor follows what the cache holds, not the whole text. ``block_size=0`` scores every slot
against one anchor at once (``KeyDiffPress`` alone). Query-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.policies.base import LayerView, Policy, param


def dissimilarity(keys: torch.Tensor) -> torch.Tensor:
    """[kv_heads, slots, head_dim] → [kv_heads, slots]: −cosine similarity to the mean of the normalised keys."""
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=1, keepdim=True)  # [kv_heads, 1, head_dim]
    return -F.cosine_similarity(keys, anchor, dim=-1)


@dataclass
class KeyDiff(Policy):
    name = "keydiff"
    summary = "keys least similar (cosine) to the mean key, block by block; query-agnostic"
    block_size: int = param(128, "slots that join the kept ones per step of the paper's block-wise eviction "
                                 "(0: every slot scored against one anchor at once)", min=0)

    def scores(self, view: LayerView) -> torch.Tensor:
        keys = view.keys.float()  # [kv_heads, slots, head_dim]
        kv_heads, slots, d = keys.shape
        budget = min(view.budget, slots)
        if not self.block_size or slots - budget <= self.block_size:  # one step: every slot is a candidate
            return dissimilarity(keys)
        kept = torch.arange(budget, device=keys.device).expand(kv_heads, budget)  # [kv_heads, budget] slots
        for start in range(budget, slots, self.block_size):
            block = torch.arange(start, min(start + self.block_size, slots), device=keys.device)
            candidates = torch.cat([kept, block.expand(kv_heads, -1)], dim=-1)  # [kv_heads, budget + block]
            scores = dissimilarity(keys.gather(1, candidates[..., None].expand(-1, -1, d)))
            best = scores.sort(dim=-1, descending=True, stable=True).indices[:, :budget]
            kept = candidates.gather(-1, best).sort(dim=-1).values
        # the last step's scores over its candidates; slots dropped by an earlier step never come back
        return torch.full((kv_heads, slots), float("-inf"), device=keys.device).scatter(-1, candidates, scores)
