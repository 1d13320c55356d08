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


def reference_mask(lm: LoadedModel, n: int, hidden: set[int], after: int) -> dict[str, torch.Tensor] | torch.Tensor:
    """The model's own additive mask for ``n`` tokens where queries from ``after`` on cannot see keys ``hidden``.

    Causal, with each layer type's window; a dict per layer type where the model has layer types.
    """
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    causal = k <= q
    gone = torch.zeros(n, n, dtype=torch.bool)
    if hidden:
        gone[after:, sorted(hidden)] = True

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]

    window = lm.facts.window
    full = additive(causal & ~gone)
    sliding = next((w for w in lm.facts.layer_windows if w is not None), None)
    windowed = additive(causal & ~gone & (q - k < sliding)) if sliding is not None else full
    types = getattr(lm.model.config, "layer_types", None)
    if types and getattr(lm.model.config, "model_type", "") != "mistral":
        return {"full_attention": full, "sliding_attention": windowed}
    return windowed if window(0) is not None else full
