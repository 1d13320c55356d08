"""Expected Attention (Devoto et al., 2025): the attention future queries are expected to give each key, × ‖V‖.

Reference: NVIDIA/kvpress ``kvpress/presses/expected_attention_press.py`` (``ExpectedAttentionPress``).
The queries of the forward before the eviction (their pre-RoPE projections, the sinks' own queries
left out) give a mean ``μ`` and covariance ``Σ`` per query head; both are rotated by the layer's RoPE
matrix averaged over the next ``n_future_positions`` positions, ``R̄``. A key ``k`` then expects the
score ``kᵀR̄μ / √d + ½ kᵀR̄ΣR̄ᵀk / d`` (the log of a Gaussian query's expected ``exp(q·k / √d)``),
softmaxed over the non-sink keys, averaged over each KV head's query group and rescaled to
``(score + epsilon) · ‖v‖``; the first ``n_sink`` tokens always stay. It needs no attention weights,
and the question asked next plays no part: query-agnostic.

In a conversation, "the forward before the eviction" is the user message's prefill, then the
reply's feed (kvpress scores one prefill); the sinks' queries are those at original positions below
``n_sink``, which only turn 1 holds. Future positions start at the next query's rotary position
in the frame the keys are rotated in now (in re-rotated mode, before the eviction moves them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.errors import KvlabError
from kvlab.policies.base import LayerView, Policy, force, param


@dataclass
class ExpectedAttention(Policy):
    name, label = "expected_attention", "Expected Attention"
    summary = "attention that future queries are expected to give (query mean/covariance rotated ahead) × ‖V‖"
    n_future_positions: int = param(512, "future query positions the queries' RoPE rotation is averaged over",
                                    min=1)
    n_sink: int = param(4, "first tokens always kept; their own queries are left out of the statistics", min=0)
    use_covariance: bool = param(True, "add the queries' covariance term ½ kᵀΣk / d (off: the mean alone)")
    use_vnorm: bool = param(True, "rescale each key's score by its value's norm: (score + epsilon) · ‖v‖")
    epsilon: float = param(0.0, "added to the scores before the value-norm rescaling", min=0.0)

    def min_budget(self) -> int:
        return self.n_sink + 1

    def probe_queries(self) -> tuple[int, ...]:
        return (self.n_sink,)

    def scores(self, view: LayerView) -> torch.Tensor:
        mean, cov = view.query_mean.get(self.n_sink), view.query_cov.get(self.n_sink)
        if mean is None or cov is None:
            raise KvlabError(f"{self.name}: the forward before this eviction gave no query statistics")
        keys = view.keys.float()  # [kv_heads, slots, head_dim]
        kv_heads, slots, d = keys.shape
        group = mean.shape[0] // kv_heads
        rot = view.future_rotation(self.n_future_positions) if view.future_rotation else torch.eye(d)
        rot = rot.to(keys.device)
        mu = mean.float() @ rot.T  # [heads, head_dim]
        k = keys.repeat_interleave(group, dim=0)  # [heads, slots, head_dim]: each query head's KV head
        logits = (k @ mu[:, :, None])[..., 0] / math.sqrt(d)  # [heads, slots]
        if self.use_covariance:
            sigma = rot @ cov.float() @ rot.T  # [heads, head_dim, head_dim]
            logits = logits + ((k @ sigma) * k).sum(-1) / d / 2
        sinks = view.positions < self.n_sink  # [kv_heads, slots]
        logits = logits.masked_fill(sinks.repeat_interleave(group, dim=0), float("-inf"))
        expected = torch.softmax(logits, dim=-1).view(kv_heads, group, slots).mean(dim=1)  # [kv_heads, slots]
        if self.use_vnorm:
            if view.values is None:
                raise KvlabError(f"{self.name}: the value norms are missing from this layer's evidence")
            expected = (expected + self.epsilon) * view.values.float().norm(dim=-1)
        return force(expected, sinks)
