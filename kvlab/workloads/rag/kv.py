"""KV tensors of a token span, building caches from them, and forwards with explicit positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.engine.cache import new_cache
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run


@dataclass(frozen=True)
class SpanKV:
    """Per-layer keys and values of a span of tokens, each [kv_heads, tokens, head_dim]."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def n_tokens(self) -> int:
        return self.keys[0].shape[-2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def slice(self, start: int, end: int) -> "SpanKV":
        """Tokens ``start``…``end`` of the span (views). Not ``engine.cache.cropped``: a span is cut anywhere,
        not only to a prefix, and holds per-layer tensors without a batch dimension, not a ``DynamicCache``."""
        return SpanKV(tuple(k[:, start:end] for k in self.keys), tuple(v[:, start:end] for v in self.values))

    @staticmethod
    def cat(spans: list["SpanKV"]) -> "SpanKV":
        layers = range(len(spans[0].keys))
        return SpanKV(tuple(torch.cat([s.keys[i] for s in spans], dim=1) for i in layers),
                      tuple(torch.cat([s.values[i] for s in spans], dim=1) for i in layers))

    @staticmethod
    def of_cache(cache: DynamicCache, start: int = 0, end: int | None = None) -> "SpanKV":
        return SpanKV(tuple(layer.keys[0, :, start:end] for layer in cache.layers),
                      tuple(layer.values[0, :, start:end] for layer in cache.layers))


def cache_of(lm: LoadedModel, kv: SpanKV) -> DynamicCache:
    """A fresh DynamicCache holding ``kv`` (later updates concatenate; ``kv`` is never modified)."""
    cache = new_cache(lm)
    for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
        cache.update(k[None], v[None], i)
    return cache


def forward(
    lm: LoadedModel, ids: list[int] | tuple[int, ...], positions: torch.Tensor, cache: DynamicCache | None = None,
    last_only: bool = False,
) -> tuple[torch.Tensor, DynamicCache]:
    """Run ``ids`` at ``positions`` on top of ``cache`` → (logits [tokens or 1, vocab] float32, cache).

    ``last_only`` computes the vocabulary projection for the last token only (what TTFT needs).
    """
    cache = cache if cache is not None else new_cache(lm)
    logits = run(lm, torch.tensor([list(ids)]), positions[None], cache, logits_to_keep=1 if last_only else 0)
    return logits[0], cache


def prefill(lm: LoadedModel, ids: list[int] | tuple[int, ...], offset: int = 0) -> SpanKV:
    """KV of ``ids`` prefilled alone, positions starting at ``offset``."""
    _, cache = forward(lm, ids, torch.arange(offset, offset + len(ids)), last_only=True)
    return SpanKV.of_cache(cache)


def relative_deviation(a: SpanKV, ref: SpanKV) -> tuple[list[float], list[float]]:
    """Per layer ||a − ref|| / ||ref|| for keys and for values."""
    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12))
    return ([rel(x, y) for x, y in zip(a.keys, ref.keys)], [rel(x, y) for x, y in zip(a.values, ref.values)])
