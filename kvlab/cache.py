"""The one way kvlab builds a transformers cache.

Every layer is a plain ``DynamicLayer`` that keeps every key it is given, including on a model's
sliding-window layers: the attention function applies each layer's window itself, and a
``KVState`` drops keys that have left a window in its own bookkeeping. A cache built from the
config instead would drop them inside transformers, behind the bookkeeping's back.
"""

from __future__ import annotations

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvlab.model import LoadedModel


def new_cache(lm: LoadedModel) -> DynamicCache:
    """An empty cache with one full ``DynamicLayer`` per layer of ``lm``."""
    cache = DynamicCache()
    cache.layers.extend(DynamicLayer() for _ in range(lm.facts.n_layers))
    return cache
