"""TOVA (Oren et al., 2024): keep the tokens the newest query attends to most.

Reference: schwartz-lab-NLP/TOVA ``src/tova_cache.py`` (``TOVACache.reduce``: the last query's
attention averaged over all heads, one top-k per layer shared by every KV head); kvpress
``tova_press.py`` does the same. ``per_head=True`` is kvlab's variant: each KV head keeps its own
set, scored by the mean over its query group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy, param


@dataclass
class TOVA(Policy):
    name = "tova"
    summary = "attention of the newest query, mean over all heads"
    per_head: bool = param(False, "kvlab's variant: each KV head keeps its own tokens (mean over its query group); "
                                  "off, as TOVA's code: one set per layer from the mean over all heads")

    def probe_windows(self) -> tuple[int, ...]:
        return (1,)

    def scores(self, view: LayerView) -> torch.Tensor:
        attn = view.window_mean[1]  # [kv_heads, slots] newest query, mean over each query group
        if self.per_head:
            return attn
        # groups are equal, so the mean of the group means is the mean over all query heads
        return attn.mean(dim=0, keepdim=True).expand_as(attn)
