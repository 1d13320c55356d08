"""TOVA (Oren et al., 2024): keep the tokens the newest query attends to most."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy


@dataclass
class TOVA(Policy):
    name = "tova"
    summary = "attention of the last query only"

    def probe_windows(self) -> tuple[int, ...]:
        return (1,)

    def scores(self, view: LayerView) -> torch.Tensor:
        return view.window_mean[1]
