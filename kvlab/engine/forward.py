"""The one way kvlab runs the model on a cache.

Every forward of kvlab's own caches goes through ``run``: it takes the model lock, disables
gradients, passes explicit positions (transformers would otherwise number new tokens from the
cache length, silently shifting them after an eviction) and sets what kvlab's attention function
reads for this forward — statistics probes, padded slots, the original position of every key, or the groups
of rows that attend over keys of their own.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.engine.attention import Probe, RowGroup, SparseReads, forward_context
from kvlab.engine.facts import LoadedModel


@torch.no_grad()
def run(
    lm: LoadedModel,
    ids: torch.Tensor,  # [rows, n]
    positions: torch.Tensor,  # [rows, n] rotary positions
    cache: DynamicCache,
    logits_to_keep: int | torch.Tensor = 0,  # the last n positions of each row, or these positions [k]
    probes: list[Probe | None] | Probe | None = None,
    valid: list[torch.Tensor | None] | None = None,  # per layer [rows, slots]: real slots (None: all)
    where: list[torch.Tensor] | None = None,  # per layer [rows, kv_heads, slots]: original positions
    reads: list[SparseReads | None] | None = None,  # per row: which keys its queries read (Quest)
    groups: list[RowGroup] | None = None,  # the rows in groups, each over keys of its own (then none of the above)
) -> torch.Tensor:
    """Run ``ids`` on ``cache`` (which takes their keys) → logits [rows, n or logits_to_keep, vocab] float32.

    With ``groups``, ``cache`` hands each group's layers its rows'
    new keys (``batched.RowsLayer``) and each group's rows attend over its own keys.
    """
    with lm.lock, forward_context(probes=probes, valid=valid, key_pos=where, reads=reads, groups=groups):
        out = lm.model(input_ids=ids.to(lm.device), position_ids=positions.to(lm.device), cache=cache,
                       use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits.float()
