"""A turn's measurements of each policy: attention on the first tokens, and fidelity to Full on the reply."""

from __future__ import annotations

import torch

from kvlab.engine.attention import Probe
from kvlab.engine.fidelity import fidelity
from kvlab.engine.kvstate import to_query_heads
from kvlab.workloads.chat.records import PolicyTurn


def sink_mass(probe: Probe, n: int, positions: list[torch.Tensor], n_heads: int, k: int) -> list[list[float]]:
    """[layer][head] share of the last n queries' attention that lands on original tokens < k."""
    out = []
    for layer, pos in enumerate(positions):
        attn = probe.window_means[n][layer]  # [heads, slots]
        is_sink = to_query_heads((pos < k).float(), n_heads)
        out.append((attn * is_sink).sum(-1).tolist())
    return out


class ReplyScores:
    """The ``reduce`` of a reply's feed: each policy's fidelity to Full on the reply's tokens.

    Full's predictions are the reference, so a policy's predictions that arrive before Full's (the
    batches decide the order) wait for them; in the usual order nothing waits and no more than one
    forward's logits are held.
    """

    def __init__(self, before: dict[str, torch.Tensor], records: dict[str, PolicyTurn]) -> None:
        self.before, self.records = before, records  # before: the logits that predicted the first fed token
        self.reference: torch.Tensor | None = None  # Full's predictions [reply, vocab]
        self.waiting: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, logits: torch.Tensor) -> None:
        predicted = torch.cat([self.before[name], logits[:-1]])  # [reply, vocab]
        if name == "full":
            self.reference = predicted
            for other, held in [("full", predicted), *self.waiting.items()]:
                self._score(other, held)
            self.waiting.clear()
        elif self.reference is None:
            self.waiting[name] = predicted
        else:
            self._score(name, predicted)

    def _score(self, name: str, predicted: torch.Tensor) -> None:
        scores = fidelity(self.reference, predicted)
        self.records[name].kl, self.records[name].top1 = scores.kl, scores.top1
