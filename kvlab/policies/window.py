"""Window: the most recent tokens only — the failure case attention sinks fix.

Reference: StreamingLLM's "window attention" baseline (mit-han-lab/streaming-llm
``streaming_llm/kv_cache.py`` with ``start_size=0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy


@dataclass
class Window(Policy):
    name = "window"
    summary = "most recent tokens only"

    def scores(self, view: LayerView) -> torch.Tensor:
        return view.positions.float()
