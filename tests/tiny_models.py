"""Tiny random models of every architecture kvlab accepts, each with an eager twin (built by ``kvlab.engine.tiny``).

The twin has the same weights and runs transformers' own eager attention, so a test holds
kvlab's attention against the model's definition rather than against kvlab itself.
"""

from __future__ import annotations

import torch

from kvlab.engine.facts import LoadedModel
from kvlab.engine.tiny import ARCHITECTURES, VOCAB, WINDOW
from kvlab.engine.tiny import tiny_model as build

__all__ = ["ARCHITECTURES", "VOCAB", "WINDOW", "build", "reference_mask"]


def reference_mask(lm: LoadedModel, n: int, hidden: set[int] | list[set[int]], after: int
                   ) -> dict[str, torch.Tensor] | torch.Tensor:
    """The model's own additive mask for ``n`` tokens where queries from ``after`` on cannot see keys ``hidden``.

    Causal, with each layer type's window; a dict per layer type where the model has layer types.
    ``hidden`` may be one set per KV head: then the mask is [1, heads, n, n], each query head hiding
    its KV head's keys.
    """
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    causal = k <= q
    per_head = [hidden] if isinstance(hidden, set) else hidden
    gone = torch.zeros(len(per_head), n, n, dtype=torch.bool)  # [1 or kv_heads, n, n]
    for head, keys in enumerate(per_head):
        if keys:
            gone[head, after:, sorted(keys)] = True
    gone = gone.repeat_interleave(lm.facts.n_heads // len(per_head), dim=0) if len(per_head) > 1 else gone

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None]

    window = lm.facts.window
    full = additive(causal & ~gone)
    sliding = next((w for w in lm.facts.layer_windows if w is not None), None)
    windowed = additive(causal & ~gone & (q - k < sliding)) if sliding is not None else full
    types = getattr(lm.model.config, "layer_types", None)
    if types and getattr(lm.model.config, "model_type", "") != "mistral":
        return {"full_attention": full, "sliding_attention": windowed}
    return windowed if window(0) is not None else full
