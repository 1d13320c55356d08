"""StreamingLLM (Xiao et al., 2023): the first ``n_sink`` tokens plus the most recent window.

Reference: mit-han-lab/streaming-llm ``streaming_llm/kv_cache.py`` (``StartRecentKVCache``: the
first ``start_size`` = 4 slots and the newest ``recent_size``); kvpress ``streaming_llm_press.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy, force, param


@dataclass
class StreamingLLM(Policy):
    name = "streamingllm"
    summary = "attention sinks (first tokens) + recent window"
    n_sink: int = param(4, "first tokens always kept (attention sinks); the rest of the budget is the newest tokens",
                        min=0)

    def min_budget(self) -> int:
        return self.n_sink + 1

    def scores(self, view: LayerView) -> torch.Tensor:
        return force(view.positions.float(), view.positions < self.n_sink)
