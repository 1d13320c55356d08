"""One policy's KV state: a transformers DynamicCache plus which original token each slot holds.

Keys are stored after RoPE. In ``original`` mode new tokens get the positions they would have in
the uncompressed text (gaps allowed). In ``rerotated`` mode (StreamingLLM's scheme) queries sit at
the cache length ``Q`` (the longest layer's) and every layer's keys are rotated to the ``Q − L``
… ``Q − 1`` slots just before it, so each layer's newest key is next to the query even where
layers hold different numbers of keys (PyramidKV, sliding layers).

On a model's sliding-window layers the state keeps only the keys the next query can see (the
last ``window − 1`` original positions): keys that left the window are dropped after every
append, so no policy spends budget on them and byte counts are what such a layer really holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvlab.attention import Probe
from kvlab.cache import new_cache
from kvlab.decode import OnReply, greedy
from kvlab.forward import run
from kvlab.model import LoadedModel
from kvlab.rope import rotate

POSITION_MODES = ("original", "rerotated")


@dataclass
class KVState:
    """A cache and its bookkeeping. All per-layer tensors are ``[kv_heads, slots]``."""

    lm: LoadedModel
    position_mode: str = "original"
    track_accumulated: bool = False
    cache: DynamicCache = field(init=False)
    positions: list[torch.Tensor] = field(init=False)  # original position of each slot
    rope_positions: list[torch.Tensor] = field(init=False)  # position each slot's key is rotated to
    accumulated: list[torch.Tensor] = field(init=False)  # attention summed over all queries so far
    tokens: list[int] = field(init=False, default_factory=list)  # every token appended, in order
    diverged: bool = field(init=False, default=False)  # a slot was dropped: no longer a full cache of ``tokens``
    seen: int = 0

    def __post_init__(self) -> None:
        f = self.lm.facts
        dev = self.lm.device
        self.cache = new_cache(self.lm)
        empty = torch.zeros(f.n_kv_heads, 0, dtype=torch.long, device=dev)
        self.positions = [empty.clone() for _ in range(f.n_layers)]
        self.rope_positions = [empty.clone() for _ in range(f.n_layers)]
        self.accumulated = [empty.float() for _ in range(f.n_layers)]

    def lengths(self) -> list[int]:
        """Slots held per layer."""
        return [p.shape[-1] for p in self.positions]

    def kv_bytes(self) -> int:
        """Bytes of K and V held now, over all layers and heads."""
        f = self.lm.facts
        return sum(self.lengths()) * f.n_kv_heads * 2 * f.head_dim * f.bytes_per_element

    def next_positions(self, n: int) -> torch.Tensor:
        """[n] rotary positions for the next n tokens."""
        start = self.seen if self.position_mode == "original" else max(self.lengths())
        return torch.arange(start, start + n, device=self.lm.device)

    def key_positions(self, n_new: int, widths: list[int] | None = None) -> list[torch.Tensor] | None:
        """Original positions of each layer's slots followed by the next ``n_new`` tokens' → [1, kv_heads, slots + n_new].

        What the attention function measures sliding windows in; None for a model without windows.
        ``widths`` pads each layer to that many slots (a slab cache's rows), the new tokens last.
        """
        if not any(self.lm.facts.layer_windows):
            return None
        new = torch.arange(self.seen, self.seen + n_new, device=self.lm.device)
        out = []
        for layer, pos in enumerate(self.positions):
            heads, held = pos.shape
            gap = pos.new_zeros(heads, widths[layer] - n_new - held if widths else 0)
            out.append(torch.cat([pos, gap, new.expand(heads, n_new)], dim=-1)[None])
        return out

    @torch.no_grad()
    def _forward(
        self, ids: torch.Tensor, rope_pos: torch.Tensor, probe: Probe | None, logits_to_keep: int = 0,
        already: int = 0,
    ) -> torch.Tensor:
        """Run ids [n] at rotary positions [n] on the cache; returns logits [n or logits_to_keep, vocab] (float32).

        ``already``: tokens of a generation fed after ``seen`` and not yet recorded.
        """
        where = self.key_positions(already + len(ids))
        return run(self.lm, ids[None], rope_pos[None], self.cache, logits_to_keep, probe, where=where)[0]

    def prepare_probe(self, probe: Probe | None) -> Probe | None:
        """The probe an append must run with: H2O's bookkeeping needs column sums."""
        if self.track_accumulated:
            probe = probe or Probe()
            probe.colsum = True
        return probe

    def append(self, ids: list[int], probe: Probe | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Add tokens to the cache for good; returns their logits [n, vocab] (the last ``logits_to_keep`` if set)."""
        rope_pos = self.next_positions(len(ids))
        probe = self.prepare_probe(probe)
        old_lengths = self.lengths()
        logits = self._forward(torch.tensor(ids, device=self.lm.device), rope_pos, probe, logits_to_keep)
        self.record_append(ids, rope_pos, probe, old_lengths)
        return logits

    def record_append(
        self, ids: list[int], rope_pos: torch.Tensor, probe: Probe | None, old_lengths: list[int]
    ) -> None:
        """Bookkeeping once the cache holds keys for ``ids`` at rotary positions ``rope_pos`` [n]."""
        n = len(ids)
        orig = torch.arange(self.seen, self.seen + n, device=self.lm.device)
        heads = self.lm.facts.n_kv_heads
        for layer in range(len(self.positions)):
            self.positions[layer] = torch.cat([self.positions[layer], orig.expand(heads, n)], dim=-1)
            self.rope_positions[layer] = torch.cat([self.rope_positions[layer], rope_pos.expand(heads, n)], dim=-1)
            if self.track_accumulated:
                assert probe is not None
                sums = to_kv_heads(probe.colsums[layer], heads)  # [kv_heads, old + n]
                old = old_lengths[layer]
                self.accumulated[layer] = torch.cat([self.accumulated[layer] + sums[:, :old], sums[:, old:]], dim=-1)
        self.tokens += ids
        self.seen += n
        self._leave_windows(probe)

    def _leave_windows(self, probe: Probe | None) -> None:
        """Drop the slots of sliding layers that the next query can no longer see.

        Slots are in position order, so each head's visible slots are a suffix; the layer keeps the
        longest such suffix over its heads (equal for all heads unless a policy evicted per head
        inside the window: then a head may keep a few invisible slots, which attention masks).
        ``probe``'s statistics of the layer are cut the same way, so policies score the kept slots.
        """
        dropped = False
        for layer, pos in enumerate(self.positions):
            window = self.lm.facts.window(layer)
            if window is None:
                continue
            visible = int((pos > self.seen - window).sum(-1).max())
            if visible == pos.shape[-1]:
                continue
            start = pos.shape[-1] - visible
            lay = self.cache.layers[layer]
            lay.keys, lay.values = lay.keys[..., start:, :], lay.values[..., start:, :]
            self.positions[layer] = pos[:, start:]
            self.rope_positions[layer] = self.rope_positions[layer][:, start:]
            if self.track_accumulated:
                self.accumulated[layer] = self.accumulated[layer][:, start:]
            if probe is not None:
                for n, per_layer in probe.window_means.items():
                    probe.window_means[n] = {**per_layer, layer: per_layer[layer][:, start:]}
            dropped = True
        if dropped:
            self.realign()

    def realign(self) -> None:
        """In rerotated mode, rotate every layer's keys to the slots right before the next query."""
        if self.position_mode != "rerotated":
            return
        query = max(self.lengths())
        for layer, rope in enumerate(self.rope_positions):
            held = rope.shape[-1]
            target = torch.arange(query - held, query, device=rope.device).expand_as(rope)
            if torch.equal(target, rope):
                continue
            lay = self.cache.layers[layer]
            lay.keys = rotate(self.lm, lay.keys, (target - rope)[None], layer)
            self.rope_positions[layer] = target.clone()

    def snapshot(self) -> dict:
        """What ``restore`` needs to bring this state back. Cheap: cache tensors are replaced, never
        changed in place, so holding references is enough."""
        return {
            "keys": [(lay.keys, lay.values, lay.is_initialized) for lay in self.cache.layers],
            "positions": list(self.positions), "rope_positions": list(self.rope_positions),
            "accumulated": list(self.accumulated), "tokens": list(self.tokens), "seen": self.seen,
            "diverged": self.diverged,
        }

    def restore(self, snap: dict) -> None:
        """Return to a ``snapshot``."""
        for lay, (keys, values, initialized) in zip(self.cache.layers, snap["keys"]):
            lay.keys, lay.values, lay.is_initialized = keys, values, initialized
        self.positions, self.rope_positions = list(snap["positions"]), list(snap["rope_positions"])
        self.accumulated, self.tokens = list(snap["accumulated"]), list(snap["tokens"])
        self.seen, self.diverged = snap["seen"], snap["diverged"]

    def same_cache(self, other: "KVState") -> bool:
        """True when both caches are full caches of the same tokens at the same positions: identical."""
        return (not self.diverged and not other.diverged and self.tokens == other.tokens
                and self.position_mode == other.position_mode and self.lm is other.lm)

    def copy_cache(self, other: "KVState") -> None:
        """Take a copy of ``other``'s cache (which ``same_cache`` says equals this one after new tokens)."""
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys, mine.values = theirs.keys.clone(), theirs.values.clone()
            mine.is_initialized, mine.device = True, theirs.device

    def _greedy(
        self, first_logits: torch.Tensor, max_new_tokens: int, stop_ids: set[int], on_token: OnReply | None,
    ) -> tuple[list[int], list[torch.Tensor]]:
        """``decode.greedy`` feeding each chosen token into the cache (no bookkeeping)."""
        start = self.next_positions(max_new_tokens)  # the cache grows as tokens are fed: fix positions first

        def step(token: int, i: int) -> torch.Tensor:
            return self._forward(torch.tensor([token], device=self.lm.device), start[i : i + 1], None, already=i)[-1]

        return greedy(first_logits, step, max_new_tokens, stop_ids, on_token)

    def generate(
        self,
        first_logits: torch.Tensor,
        max_new_tokens: int,
        stop_ids: set[int],
        on_token: OnReply | None = None,
    ) -> list[int]:
        """Greedy reply from ``first_logits`` [vocab]; the cache is left exactly as before."""
        lengths = self.lengths()
        try:
            return self._greedy(first_logits, max_new_tokens, stop_ids, on_token)[0]
        finally:
            self.truncate(lengths)

    def generate_kept(
        self,
        first_logits: torch.Tensor,
        max_new_tokens: int,
        stop_ids: set[int],
        on_token: OnReply | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy reply that stays appended: returns (reply, logits [fed + 1, vocab]).

        The first ``fed = len(logits) - 1`` reply tokens are now in the cache as if appended, so a
        caller that feeds the reply afterwards need only feed the rest. Not for H2O's bookkeeping,
        which needs every query's attention.
        """
        if self.track_accumulated:
            raise ValueError("generate_kept cannot keep accumulated attention; use generate and append")
        old_lengths, start = self.lengths(), self.next_positions(max_new_tokens)
        try:
            reply, steps = self._greedy(first_logits, max_new_tokens, stop_ids, on_token)
        except BaseException:  # nothing was recorded yet: drop what the loop cached
            self.truncate(old_lengths)
            raise
        fed = reply[: len(steps) - 1]
        self.record_append(fed, start[: len(fed)], None, old_lengths)
        return reply, torch.stack(steps)

    def drop_last(self, n: int) -> None:
        """Undo the last ``n`` appended tokens (only valid when nothing was evicted since)."""
        if n <= 0:
            return
        self.truncate([length - n for length in self.lengths()])
        self.positions = [p[:, :-n] for p in self.positions]
        self.rope_positions = [p[:, :-n] for p in self.rope_positions]
        self.tokens = self.tokens[:-n]
        self.seen -= n

    def truncate(self, lengths: list[int]) -> None:
        """Drop cached slots past ``lengths`` (temporary tokens of a generation)."""
        for layer, n in zip(self.cache.layers, lengths):
            if layer.keys is None:  # never written
                continue
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]

    def keep(self, layer: int, index: torch.Tensor) -> None:
        """Keep slots ``index`` [kv_heads, kept] (ascending per head) of one layer, drop the rest.

        In rerotated mode call ``realign`` once every layer has been cut.
        """
        lay = self.cache.layers[layer]
        gather = index[None, :, :, None].expand(1, -1, -1, lay.keys.shape[-1])
        lay.keys = lay.keys.gather(2, gather)  # [1, kv_heads, kept, head_dim]
        lay.values = lay.values.gather(2, gather)
        self.positions[layer] = self.positions[layer].gather(1, index)
        self.rope_positions[layer] = self.rope_positions[layer].gather(1, index)
        self.diverged = True
        if self.track_accumulated:
            self.accumulated[layer] = self.accumulated[layer].gather(1, index)


def to_kv_heads(per_query_head: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[heads, slots] → [kv_heads, slots]: mean over the query heads that share a KV head (GQA)."""
    heads, slots = per_query_head.shape
    return per_query_head.view(n_kv_heads, heads // n_kv_heads, slots).mean(dim=1)


def to_query_heads(per_kv_head: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[kv_heads, slots] → [heads, slots], repeating each KV head for its query group."""
    return per_kv_head.repeat_interleave(n_heads // per_kv_head.shape[0], dim=0)
