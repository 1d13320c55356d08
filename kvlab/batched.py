"""Greedy decoding of several policies' caches in one batch.

On a CPU (and on a GPU at small batch) a decode step costs about the same for one row as for
five: the weights are read once. Each policy's cache is copied into one padded batch whose padded
slots are masked out, so every row sees exactly its own cache; the policies' states are untouched.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache

from kvlab.attention import key_padding
from kvlab.kvstate import KVState


def _padded_cache(states: list[KVState]) -> tuple[DynamicCache, list[torch.Tensor]]:
    """One DynamicCache holding every state's layers, right-padded to the longest, and validity masks."""
    lm = states[0].lm
    cache = DynamicCache(config=lm.model.config)
    valid = []
    for layer in range(lm.facts.n_layers):
        lengths = [s.lengths()[layer] for s in states]
        longest = max(lengths)
        keys, values = [], []
        for s, n in zip(states, lengths):
            lay = s.cache.layers[layer]
            pad = (0, 0, 0, longest - n)
            keys.append(torch.nn.functional.pad(lay.keys, pad))  # [1, kv_heads, longest, head_dim]
            values.append(torch.nn.functional.pad(lay.values, pad))
        cache.update(torch.cat(keys), torch.cat(values), layer)
        valid.append(torch.arange(longest, device=lm.device)[None, :] < torch.tensor(lengths, device=lm.device)[:, None])
    return cache, valid


@torch.no_grad()
def generate_batched(
    states: list[KVState],
    first_logits: list[torch.Tensor],
    max_new_tokens: int,
    stop_ids: set[int],
    on_token: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]]:
    """Greedy replies for every state from its first-token logits [vocab]; caches are left as they were."""
    if len(states) == 1:  # one row needs no padding: decode on its own cache and roll back
        stream = (lambda ids: on_token(0, ids)) if on_token else None
        return [states[0].generate(first_logits[0], max_new_tokens, stop_ids, stream)]
    lm = states[0].lm
    out: list[list[int]] = [[] for _ in states]
    done = [False] * len(states)
    tokens = [int(logits.argmax()) for logits in first_logits]
    base = torch.stack([s.next_positions(1) for s in states])  # [rows, 1]
    cache, valid = _padded_cache(states)
    for step in range(max_new_tokens):
        for row, token in enumerate(tokens):
            if done[row]:
                continue
            if token in stop_ids:
                done[row] = True
            else:
                out[row].append(token)
                if on_token:
                    on_token(row, out[row])
        if all(done) or step + 1 == max_new_tokens:
            break
        with lm.lock, key_padding(valid):
            logits = lm.model(input_ids=torch.tensor(tokens, device=lm.device)[:, None], position_ids=base + step,
                              cache=cache, use_cache=True).logits[:, -1]
        tokens = logits.argmax(-1).tolist()
    return out
