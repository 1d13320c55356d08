"""Re-rotating cached keys with the model's own rotary embedding.

A key stored at position p holds R(p)·k. Multiplying by R(Δ) gives R(p + Δ)·k — what a fresh
prefill at position p + Δ would have stored, up to float rounding.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import rotate_half


def rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model's rotary embedding module; models without one cannot re-rotate."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        raise ValueError("this model has no rotary embedding")
    return rotary


@torch.no_grad()
def rotate_keys(model: torch.nn.Module, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Rotate keys [batch, kv_heads, n, head_dim] by per-slot offsets delta [batch, kv_heads, n]."""
    rotary = rotary_module(model)
    b, h, n, d = keys.shape
    flat = delta.reshape(b, h * n).to(keys.device)
    cos, sin = rotary(keys.view(b, h * n, d), flat)  # [b, h*n, d], scaled by attention_scaling
    scale = getattr(rotary, "attention_scaling", 1.0)
    cos = (cos / scale).view(b, h, n, d).to(torch.float32)
    sin = (sin / scale).view(b, h, n, d).to(torch.float32)
    k = keys.to(torch.float32)
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)
