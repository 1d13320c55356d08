"""The model's own forward, called directly: the plain transformers runs kvlab's own runs are measured against.

Everything else runs the model through ``forward.run`` on kvlab's caches. These calls skip it on purpose:
no positions, padding, probes or sparse reads are set, and a cache, where there is one, is transformers'
own ``DynamicCache`` — the reference for exactness tests, sharing's support check and the benchmark's
baseline. Each takes the model lock and runs without gradients.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.engine.attention import Probe, forward_context
from kvlab.engine.decode import greedy
from kvlab.engine.facts import LoadedModel
from kvlab.engine.tensor_memory import TensorMemory


def plain_logits(lm: LoadedModel, ids: list[int], logits_to_keep: int = 0, cache: DynamicCache | None = None
                 ) -> torch.Tensor:
    """The model's own forward of ``ids`` [n] → logits [n or logits_to_keep, vocab] (float32).

    With ``cache`` (empty, or holding the tokens before ``ids``) the keys are kept there; without, none are.
    """
    with lm.lock, torch.no_grad():  # as forward.run: the baseline and kvlab's runs on an equal footing
        out = lm.model(input_ids=torch.tensor([ids], device=lm.device), cache=cache, use_cache=cache is not None,
                       logits_to_keep=logits_to_keep)
    return out.logits[0].float()


def plain_greedy(lm: LoadedModel, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """One transformers prefill (last logits only, as ``generate`` does), then ``decode.greedy``'s steps."""
    cache = DynamicCache(config=lm.model.config)
    first = plain_logits(lm, ids, 1, cache)[-1]
    return greedy(first, lambda token, _: plain_logits(lm, [token], 1, cache)[-1], max_new_tokens, stop_ids)[0]


def prefill_peak_bytes(lm: LoadedModel, ids: list[int], probe: Probe | None) -> int:
    """Peak tensor bytes alive during one plain prefill of ``ids`` (last-token logits only), ``probe`` attached."""
    with forward_context(probes=probe), TensorMemory() as mem:
        plain_logits(lm, ids, 1, DynamicCache(config=lm.model.config))
    return mem.peak
