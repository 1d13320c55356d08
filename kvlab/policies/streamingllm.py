"""StreamingLLM (Xiao et al., 2023): the first ``n_sink`` tokens plus the most recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy, force, require


@dataclass
class StreamingLLM(Policy):
    name = "streamingllm"
    summary = "attention sinks (first tokens) + recent window"
    n_sink: int = 4

    def check(self) -> None:
        require(isinstance(self.n_sink, int) and self.n_sink >= 0, f"streamingllm: n_sink must be ≥ 0, not {self.n_sink!r}")

    def min_budget(self) -> int:
        return self.n_sink + 1

    def scores(self, view: LayerView) -> torch.Tensor:
        return force(view.positions.float(), view.positions < self.n_sink)
