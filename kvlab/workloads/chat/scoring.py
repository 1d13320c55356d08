"""A turn's measurements of each policy: attention on the first tokens, fidelity to Full, what its cache holds."""

from __future__ import annotations

import torch

from kvlab.engine.attention import Probe
from kvlab.engine.fidelity import fidelity
from kvlab.engine.kvstate import KVState, host_lists, to_query_heads
from kvlab.engine.paging import block_figures
from kvlab.workloads.chat.records import PolicyTurn


def sink_mass(probe: Probe, n: int, positions: list[torch.Tensor], n_heads: int, k: int) -> list[list[float]]:
    """[layer][head] share of the last n queries' attention that lands on original tokens < k."""
    per_layer = []
    for layer, pos in enumerate(positions):
        attn = probe.window_means[n][layer]  # [heads, slots]
        is_sink = to_query_heads((pos < k).float(), n_heads)
        per_layer.append((attn * is_sink).sum(-1))
    return host_lists(per_layer)


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


def record_cache(rec: PolicyTurn, state: KVState, block_size: int) -> None:
    """What a policy's cache holds after its turn, into its record: slots, bytes held and read, paged blocks."""
    f = state.lm.facts
    kept = state.kept_positions()  # per layer and KV head: heads may hold different numbers (AdaKV)
    rec.retained = [[p.tolist() for p in heads] for heads in kept]
    per_layer = [(sum(h), len(h)) for h in state.head_lengths()]  # keys held, KV heads
    rec.cache_tokens = [k // n if k % n == 0 else k / n for k, n in per_layer]  # mean per head (AdaKV's differ)
    rec.kv_bytes = rec.bytes_read = state.kv_bytes()
    if state.reads is not None:  # this turn's reads only
        rec.read_share = state.reads.read_share
        state.reads.keys_read = state.reads.keys_held = 0
        rec.pages_read = state.reads.pages_read_last()
        # every page's min and max are read to rank the pages, then the read share of the keys and values
        meta = sum(state.reads.metadata_bytes(n, f) for n in state.lengths())
        if rec.read_share is not None:
            rec.bytes_read = meta + rec.read_share * (rec.kv_bytes - meta)
    rec.blocks = block_figures(kept, state.seen, block_size, f.kv_bytes(1, layers=1, heads=1)).as_dict()
