"""A kvlab plug-in policy: the first tokens (attention sinks), then what the newest queries attend to most.

Run it with ``python -m kvlab chat --policy-file examples/plugin_policy.py --policies sinkvote ...``,
check it with ``python -m kvlab check-policy sinkvote --policy-file examples/plugin_policy.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import LayerView, Policy, force, param


@dataclass
class SinkVote(Policy):
    name = "sinkvote"  # the registry name: lower-case letters, digits and _
    label = "Sink + vote"  # its name in prose (default: the class name)
    summary = "the first n_sink tokens, then the tokens the newest queries attend to most"
    n_sink: int = param(4, "first tokens always kept (attention sinks)", min=0)
    window: int = param(8, "newest queries whose attention votes", min=1)

    def probe_windows(self) -> tuple[int, ...]:
        return (self.window,)  # kvlab records these queries' mean attention for scores()

    def scores(self, view: LayerView) -> torch.Tensor:
        votes = view.window_mean[self.window]  # [kv_heads, slots] mean attention of the newest queries
        return force(votes, view.positions < self.n_sink)  # inf: the sinks always stay
