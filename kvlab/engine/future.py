"""What a scripted conversation's later queries attend to: each key's attention from a Full run of the whole stream.

The oracle's evidence, which no deployable policy has: it needs every token the conversation will
ever hold, so only a conversation scripted in advance gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.engine.attention import Probe
from kvlab.engine.cache import new_cache
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run
from kvlab.errors import KvlabError


@dataclass
class FutureAttention:
    """Per eviction point, per layer: the attention every query from that point on gives each earlier key."""

    tokens: list[int]  # the conversation's whole token stream
    boundaries: list[int]  # tokens held at each eviction point (after each message, after each reply)
    later: list[list[torch.Tensor]]  # [boundary][layer] -> [heads, boundary] attention summed over later queries

    def covers(self, tokens: list[int], new: list[int]) -> bool:
        """Whether this stream goes on from ``tokens`` with ``new`` and has an eviction point right after them."""
        n = len(tokens) + len(new)
        return n in self.boundaries and self.tokens[:n] == [*tokens, *new]

    def at(self, tokens: list[int], layer: int) -> torch.Tensor:
        """[heads, len(tokens)] the later queries' attention to each original position, for a cache of ``tokens``.

        KvlabError when the cache is not at one of the stream's eviction points (another stream: a turn off the
        script kept in the conversation, whose later turns no one knows).
        """
        n = len(tokens)
        if n not in self.boundaries or tokens != self.tokens[:n]:
            raise KvlabError("the oracle knows only the future of its script, asked turn after turn (or of a "
                             "single-shot question); this cache holds another conversation (a turn off the script)")
        return self.later[self.boundaries.index(n)][layer]


@torch.no_grad()
def future_attention(lm: LoadedModel, tokens: list[int], boundaries: list[int]) -> FutureAttention:
    """Run Full over ``tokens`` segment by segment (cut at ``boundaries``) and sum, for each boundary, the
    attention of every later query to each earlier key, with the model's own masks and windows."""
    ends = sorted({b for b in boundaries if 0 < b <= len(tokens)} | {len(tokens)})
    cache = new_cache(lm)  # keeps every key: the column sums index original positions
    segment_sums: list[list[torch.Tensor]] = []  # [segment][layer] -> [heads, segment end]
    start = 0
    for end in ends:
        probe = Probe(colsum=True)
        ids = torch.tensor(tokens[start:end], device=lm.device)[None]
        run(lm, ids, torch.arange(start, end, device=lm.device)[None], cache, logits_to_keep=1, probes=probe)
        segment_sums.append([probe.colsums[layer] for layer in range(lm.facts.n_layers)])
        start = end
    later: list[list[torch.Tensor]] = [[] for _ in ends]
    total = [torch.zeros(lm.facts.n_heads, len(tokens), device=lm.device) for _ in range(lm.facts.n_layers)]
    for i in reversed(range(len(ends))):  # every segment after boundary i, summed from the end
        later[i] = [t[:, : ends[i]].clone() for t in total]
        for layer, sums in enumerate(segment_sums[i]):
            total[layer][:, : sums.shape[-1]] += sums
    return FutureAttention(tokens=list(tokens), boundaries=ends, later=later)
