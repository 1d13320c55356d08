"""What a scripted conversation's later queries attend to: each key's attention from a Full run of the whole stream.

The oracle's evidence, which no deployable policy has: it needs every token the conversation will
ever hold, so only a conversation scripted in advance gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.engine.attention import Probe
from kvlab.engine.cache import cropped, new_cache
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run
from kvlab.errors import KvlabError


@dataclass
class Resume:
    """A ``future_attention`` pass stopped at a boundary: its cache and its segments' sums so far."""

    tokens: list[int]  # the stream up to the boundary
    ends: list[int]  # the segments' ends up to it
    cache: DynamicCache  # Full's keys and values of ``tokens``
    sums: list[list[torch.Tensor]]  # [segment][layer] -> [heads, segment end]

    def fits(self, tokens: list[int], ends: list[int]) -> bool:
        """Whether a stream of ``tokens`` cut at ``ends`` begins with this one's tokens, cut the same way."""
        n = len(self.tokens)
        return tokens[:n] == self.tokens and [e for e in ends if e <= n] == self.ends


@dataclass
class FutureAttention:
    """Per eviction point, per layer: the attention every query from that point on gives each earlier key."""

    tokens: list[int]  # the conversation's whole token stream
    boundaries: list[int]  # tokens held at each eviction point (after each message, after each reply)
    later: list[list[torch.Tensor]]  # [boundary][layer] -> [heads, boundary] attention summed over later queries
    resume: Resume | None = None  # the pass at one of its boundaries, where a stream that shares it can go on
    resumed: int = 0  # the first tokens it did not run: another pass's ``resume`` gave them

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
def future_attention(lm: LoadedModel, tokens: list[int], boundaries: list[int], keep_at: int | None = None,
                     start: Resume | None = None) -> FutureAttention:
    """Run Full over ``tokens`` segment by segment (cut at ``boundaries``) and sum, for each boundary, the
    attention of every later query to each earlier key, with the model's own masks and windows.

    ``keep_at`` (a boundary): the result's ``resume`` is the pass there. ``start``: go on from another pass's
    ``resume`` where this stream begins as that one did (``Resume.fits``): the same keys and sums, not run again.
    """
    ends = sorted({b for b in boundaries if 0 < b <= len(tokens)} | {len(tokens)})
    cache = new_cache(lm)  # keeps every key: the column sums index original positions
    segment_sums: list[list[torch.Tensor]] = []  # [segment][layer] -> [heads, segment end]
    begin, resume = 0, None
    if start is not None and start.fits(tokens, ends):
        begin, segment_sums = len(start.tokens), list(start.sums)
        cache = cropped(lm, start.cache, begin)  # a copy: ``start`` may serve another stream
    resumed = begin
    for end in (e for e in ends if e > begin):
        probe = Probe(colsum=True)
        ids = torch.tensor(tokens[begin:end], device=lm.device)[None]
        run(lm, ids, torch.arange(begin, end, device=lm.device)[None], cache, logits_to_keep=1, probes=probe)
        segment_sums.append([probe.colsums[layer] for layer in range(lm.facts.n_layers)])
        begin = end
        if end == keep_at:
            resume = Resume(tokens[:end], [e for e in ends if e <= end], cropped(lm, cache, end), list(segment_sums))
    later: list[list[torch.Tensor]] = [[] for _ in ends]
    total = [torch.zeros(lm.facts.n_heads, len(tokens), device=lm.device) for _ in range(lm.facts.n_layers)]
    for i in reversed(range(len(ends))):  # every segment after boundary i, summed from the end
        later[i] = [t[:, : ends[i]].clone() for t in total]
        for layer, sums in enumerate(segment_sums[i]):
            total[layer][:, : sums.shape[-1]] += sums
    return FutureAttention(tokens=list(tokens), boundaries=ends, later=later, resume=resume, resumed=resumed)
