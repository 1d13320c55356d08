"""Knorm (Devoto et al., 2024): keys with a small L2 norm draw the most attention; keep those.

Reference: alessiodevoto/l2compress ``cache.py`` (``l2_compress``: per layer and KV head, the
slots with the smallest key norm); kvpress ``knorm_press.py`` (score ``-keys.norm(dim=-1)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy


@dataclass
class Knorm(Policy):
    name = "knorm"
    summary = "smallest key norms (query-agnostic)"

    def scores(self, view: LayerView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)
