"""What a scripted conversation's later queries attend to: each key's attention from a Full run of the whole stream.

The oracle's evidence, which no deployable policy has: it needs every token the conversation will
ever hold, so only a conversation scripted in advance gives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvlab.engine.attention import Probe
from kvlab.engine.cache import cropped, new_cache
from kvlab.engine.decode import greedy
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run
from kvlab.errors import KvlabError


@dataclass
class Resume:
    """An ``AttentionPass`` stopped at a boundary, where another stream that begins the same way goes on."""

    tokens: list[int]  # the stream up to the boundary
    ends: list[int]  # the segments' ends up to it
    cache: DynamicCache  # Full's keys and values of ``tokens``
    sums: list[list[torch.Tensor]]  # [segment][layer] -> [heads, segment end]


@dataclass
class FutureAttention:
    """Per eviction point, per layer: the attention every query from that point on gives each earlier key."""

    tokens: list[int]  # the conversation's whole token stream
    boundaries: list[int]  # tokens held at each eviction point (after each message, after each reply)
    later: list[list[torch.Tensor]]  # [boundary][layer] -> [heads, boundary] attention summed over later queries
    resume: Resume | None = None  # the pass at one of its boundaries, where a stream that shares it can go on
    resumed: int = 0  # the first tokens it did not run: another pass's ``resume`` gave them
    seconds: float = 0.0  # what running it took: what a session handed this pass (not running it) still counts
    # the futures of single-shot questions asked off this stream, by (tokens before, question, reply kept): a copy of
    # this pass (``dataclasses.replace``) shares them, so the arena's cells of one workload each ask them once
    asked: dict[tuple, FutureAttention] = field(default_factory=dict)

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


class AttentionPass:
    """Full over a stream fed segment by segment (each segment's end an eviction point), keeping every key, with
    each segment's column sums: the attention its queries give every earlier key, with the model's own masks and
    windows. Its greedy replies are what Full alone would say there; the stream goes on with whatever is fed."""

    def __init__(self, lm: LoadedModel, start: Resume | None = None) -> None:
        """A pass from the first token, or going on from ``start`` (its keys and sums, not run again)."""
        self.lm, self.resume = lm, None
        if start is None:
            self.tokens, self.ends, self.sums, self.cache = [], [], [], new_cache(lm)
        else:  # a copy of the cache: ``start`` may serve another stream
            self.tokens, self.ends, self.sums = list(start.tokens), list(start.ends), list(start.sums)
            self.cache = cropped(lm, start.cache, len(start.tokens))
        self.resumed = len(self.tokens)

    @torch.no_grad()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """Run the segment ``ids`` and record its queries' column sums → the logits after it [vocab]."""
        begin, end = len(self.tokens), len(self.tokens) + len(ids)
        probe = Probe(colsum=True)
        logits = run(self.lm, torch.tensor(ids, device=self.lm.device)[None],
                     torch.arange(begin, end, device=self.lm.device)[None], self.cache, logits_to_keep=1, probes=probe)
        self.sums.append([probe.colsums[layer] for layer in range(self.lm.facts.n_layers)])
        self.tokens += ids
        self.ends.append(end)
        return logits[0, -1]

    @torch.no_grad()
    def greedy(self, first_logits: torch.Tensor, max_new_tokens: int, stop_ids: set[int] | frozenset[int]
               ) -> list[int]:
        """Full's greedy reply from ``first_logits`` [vocab] (``decode.greedy``'s rule); the keys of the tokens it fed
        are dropped after, so that the reply the conversation keeps is then fed as one segment."""
        n = len(self.tokens)

        def step(token: int, i: int) -> torch.Tensor:
            return run(self.lm, torch.tensor([[token]], device=self.lm.device),
                       torch.tensor([[n + i]], device=self.lm.device), self.cache, logits_to_keep=1)[0, -1]

        reply, logits = greedy(first_logits, step, max_new_tokens, stop_ids)
        if len(logits) > 1:  # tokens were fed (crop's count is negative: tokens to drop)
            self.cache.crop(1 - len(logits))
        return reply

    def keep(self) -> None:
        """Keep the pass as it stands (the result's ``resume``): another stream that begins so can go on from it."""
        self.resume = Resume(list(self.tokens), list(self.ends), cropped(self.lm, self.cache, len(self.tokens)),
                             list(self.sums))

    def result(self) -> FutureAttention:
        """For every boundary, the attention of every later query of the stream to each earlier key."""
        n_layers, heads, n = self.lm.facts.n_layers, self.lm.facts.n_heads, len(self.tokens)
        later: list[list[torch.Tensor]] = [[] for _ in self.ends]
        total = [torch.zeros(heads, n, device=self.lm.device) for _ in range(n_layers)]
        for i in reversed(range(len(self.ends))):  # every segment after boundary i, summed from the end
            later[i] = [t[:, : self.ends[i]].clone() for t in total]
            for layer, sums in enumerate(self.sums[i]):
                total[layer][:, : sums.shape[-1]] += sums
        return FutureAttention(tokens=list(self.tokens), boundaries=list(self.ends), later=later,
                               resume=self.resume, resumed=self.resumed)


def future_attention(lm: LoadedModel, tokens: list[int], boundaries: list[int]) -> FutureAttention:
    """``AttentionPass`` over a stream known in full, ``tokens``, cut at ``boundaries`` (and its end): the pass the
    chat builds turn by turn, for a stream given at once (the oracle's tests check the chat's against it)."""
    ends = sorted({b for b in boundaries if 0 < b <= len(tokens)} | {len(tokens)})
    stream = AttentionPass(lm)
    for begin, end in zip([0, *ends], ends):
        stream.feed(tokens[begin:end])
    return stream.result()
