"""One policy's KV state: a transformers DynamicCache plus which original token each slot holds.

Keys are stored after RoPE. Heads of one layer may hold different numbers of keys (AdaKV): a head
with fewer is padded on its left (``SlotLayer``), the padding is masked in every forward
(``key_valid``) and never counted in bytes, positions or blocks.

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

from kvlab.engine.attention import Probe
from kvlab.engine.cache import SlotLayer, slot_cache
from kvlab.engine.decode import OnReply, greedy
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run
from kvlab.engine.future import FutureAttention
from kvlab.engine.quantization import Kivi
from kvlab.engine.rope import rotate
from kvlab.engine.sparse import SparseReads

POSITION_MODES = ("original", "rerotated")


@dataclass
class KVState:
    """A policy's cache: one ``SlotLayer`` per layer (keys, values and per-slot metadata together)."""

    lm: LoadedModel
    position_mode: str = "original"
    track_accumulated: bool = False
    reads: SparseReads | None = None  # which keys decoding queries read (Quest); None: every key
    quant: Kivi | None = None  # KIVI quantization of the stored keys and values; None: full precision
    future: FutureAttention | None = None  # what the script's later queries attend to (the oracle's evidence)
    cache: DynamicCache = field(init=False)
    _decoding: bool = field(init=False, default=False, repr=False)  # decoding now: ``reads`` applies
    tokens: list[int] = field(init=False, default_factory=list)  # every token appended, in order
    diverged: bool = field(init=False, default=False)  # a slot was dropped: no longer a full cache of ``tokens``
    # the first ``reconstructed`` tokens have their slots' reconstruction scores (KVzip, ``engine.reconstruction``)
    reconstructed: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.cache = slot_cache(self.lm)

    @property
    def seen(self) -> int:
        """Tokens appended so far: the original position the next token takes."""
        return len(self.tokens)

    @property
    def layers(self) -> list[SlotLayer]:
        return self.cache.layers

    @property
    def positions(self) -> list[torch.Tensor]:
        """Per layer [kv_heads, slots]: the original position of each slot's token."""
        return [lay.positions for lay in self.layers]

    @property
    def rope_positions(self) -> list[torch.Tensor]:
        """Per layer [kv_heads, slots]: the position each slot's key is rotated to."""
        return [lay.rope_positions for lay in self.layers]

    @property
    def accumulated(self) -> list[torch.Tensor]:
        """Per layer [kv_heads, slots]: attention summed over every query so far (H2O)."""
        return [lay.accumulated for lay in self.layers]

    def lengths(self) -> list[int]:
        """Slots per layer: the keys of its fullest head."""
        return [lay.held for lay in self.layers]

    def head_lengths(self) -> list[list[int]]:
        """Per layer and KV head, the keys that head really holds (read from the device at once)."""
        return host_lists([lay.head_lengths() for lay in self.layers])

    def kept_positions(self) -> list[list[torch.Tensor]]:
        """Per layer and KV head, the original positions of the keys it holds [keys of that head] (no padding: its
        position is −1), on the CPU: every layer's positions come from the device in one copy (on a GPU a copy waits
        for the queue)."""
        host = torch.cat([lay.positions.flatten() for lay in self.layers]).cpu()
        per_layer = host.split([lay.positions.numel() for lay in self.layers])
        return [[pos[pos >= 0] for pos in flat.view_as(lay.positions)] for flat, lay in zip(per_layer, self.layers)]

    def kv_bytes(self) -> int:
        """Bytes of K and V held now, over all layers and heads, with any page metadata of sparse reads.

        KIVI's packed layers: the bytes of the tensors they hold (codes, mins and maxes, full-precision rows).
        """
        f = self.lm.facts
        if self.quant is not None and self.quant.active:
            held = sum(lay.packed_bytes() if lay.packed is not None
                       else self.quant.layer_bytes(lay, f.head_dim, f.bytes_per_element) for lay in self.layers)
        else:  # each head's own keys, as a varlen kernel stores them: padding is not held
            held = f.kv_bytes(sum(map(sum, self.head_lengths())), layers=1, heads=1)
        if self.reads is not None:
            held += sum(self.reads.metadata_bytes(n, f) for n in self.lengths())
        return held

    @property
    def sparse_now(self) -> bool:
        """Whether this state's queries read only some keys right now."""
        return self.reads is not None and self._decoding

    def row_reads(self) -> SparseReads | None:
        """What this state's row of a forward reads (None: every key); the reads keep their page metadata on
        this state's layers."""
        if self.reads is None or not self._decoding:
            return None
        self.reads.bind(self.layers)
        return self.reads

    def set_decoding(self, on: bool) -> None:
        """Mark the state as decoding (its sparse reads apply) or prefilling (every key is read)."""
        self._decoding = on

    def next_positions(self, n: int) -> torch.Tensor:
        """[n] rotary positions for the next n tokens."""
        start = self.seen if self.position_mode == "original" else max(self.lengths())
        return torch.arange(start, start + n, device=self.lm.device)

    def key_positions(self, n_new: int, widths: list[int] | None = None) -> list[torch.Tensor] | None:
        """Original positions of each layer's slots followed by the next ``n_new`` tokens'
        → [1, kv_heads, slots + n_new].

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

    def key_valid(self, n_new: int) -> list[torch.Tensor] | None:
        """Which slots hold a real key, then the next ``n_new`` tokens' → per layer [1, kv_heads, slots + n_new].

        None while every head of every layer holds the same keys (nothing to mask).
        """
        if not any(lay.uneven for lay in self.layers):
            return None
        return [torch.cat([lay.real, lay.real.new_ones(lay.real.shape[0], n_new)], dim=-1)[None] for lay in self.layers]

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, rope_pos: torch.Tensor, probe: Probe | None, logits_to_keep: int = 0,
        already: int = 0,
    ) -> torch.Tensor:
        """Run ids [n] at rotary positions [n] on the cache; returns logits [n or logits_to_keep, vocab] (float32).

        ``already``: tokens of a generation fed after ``seen`` and not yet recorded.
        """
        n = already + len(ids)
        return run(self.lm, ids[None], rope_pos[None], self.cache, logits_to_keep, probe, valid=self.key_valid(n),
                   where=self.key_positions(n), reads=[self.row_reads()])[0]

    def prepare_probe(self, probe: Probe | None) -> Probe | None:
        """The probe an append must run with: H2O's bookkeeping needs column sums, query statistics the
        queries' positions (the next append's, which start at ``next_positions``)."""
        if self.track_accumulated:
            probe = probe or Probe()
            probe.colsum = True
        if probe is not None and probe.queries_from:
            start = int(self.next_positions(1)[0])

            def unrotate(layer: int, query: torch.Tensor) -> torch.Tensor:  # [heads, q, head_dim]
                if not self.lm.facts.has_rope:
                    return query
                at = torch.arange(start, start + query.shape[-2], device=query.device)
                return rotate(self.lm, query, -at, layer)

            probe.unrotate, probe.first_position = unrotate, self.seen
        return probe

    def append(self, ids: list[int], probe: Probe | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Add tokens to the cache for good; returns their logits [n, vocab] (the last ``logits_to_keep`` if set)."""
        rope_pos = self.next_positions(len(ids))
        probe = self.prepare_probe(probe)
        logits = self.forward(torch.tensor(ids, device=self.lm.device), rope_pos, probe, logits_to_keep)
        self.record_append(ids, rope_pos, probe)
        return logits

    def record_append(self, ids: list[int], rope_pos: torch.Tensor, probe: Probe | None) -> None:
        """Bookkeeping once the cache holds keys for ``ids`` at rotary positions ``rope_pos`` [n]."""
        n = len(ids)
        orig = torch.arange(self.seen, self.seen + n, device=self.lm.device)
        heads = self.lm.facts.n_kv_heads
        for layer, lay in enumerate(self.layers):
            sums = None
            if self.track_accumulated:
                assert probe is not None
                sums = to_kv_heads(probe.colsums[layer], heads)  # [kv_heads, old + n]
            lay.record(orig, rope_pos, sums)
        self.tokens += ids
        self.diverged |= self.sparse_now  # keys computed from sparse reads are not Full's
        self._leave_windows(probe)
        if self.quant is not None and self.quant.active:
            for lay in self.layers:
                self.diverged |= self.quant.quantize(lay)

    def _leave_windows(self, probe: Probe | None) -> None:
        """Drop the slots of sliding layers that the next query can no longer see.

        Slots are in position order, so each head's visible slots are a suffix; the layer keeps the
        longest such suffix over its heads (equal for all heads unless a policy evicted per head
        inside the window: then a head may keep a few invisible slots, which attention masks).
        ``probe``'s statistics of the layer are cut the same way, so policies score the kept slots.
        """
        dropped = False
        for layer, lay in enumerate(self.layers):
            window = self.lm.facts.window(layer)
            if window is None:
                continue
            visible = int((lay.positions > self.seen - window).sum(-1).max())
            start = lay.held - visible
            if start == 0:
                continue
            lay.drop_before(start)
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
        for layer, lay in enumerate(self.layers):
            rope = lay.rope_positions
            slots = torch.arange(query - lay.held, query, device=rope.device).expand_as(rope)
            target = torch.where(lay.real, slots, rope)  # each head's keys end at the query; padding stays
            if torch.equal(target, rope):
                continue
            lay.keys = rotate(self.lm, lay.keys, (target - rope)[None], layer)
            lay.rope_positions = target.clone()

    def snapshot(self) -> dict:
        """What ``restore`` needs to bring this state back. Cheap: cache tensors are replaced, never
        changed in place, so holding references is enough."""
        return {"layers": [lay.state() for lay in self.layers], "tokens": list(self.tokens), "diverged": self.diverged,
                "reconstructed": self.reconstructed}

    def restore(self, snap: dict) -> None:
        """Return to a ``snapshot``."""
        for lay, saved in zip(self.layers, snap["layers"]):
            lay.load(saved)
        self.tokens, self.diverged = list(snap["tokens"]), snap["diverged"]
        self.reconstructed = snap["reconstructed"]

    def same_cache(self, other: "KVState") -> bool:
        """True when both caches are full caches of the same tokens at the same positions: identical."""
        return (not self.diverged and not other.diverged and not self.sparse_now and not other.sparse_now
                and self.tokens == other.tokens
                and self.position_mode == other.position_mode and self.lm is other.lm)

    def copy_cache(self, other: "KVState") -> None:
        """Take ``other``'s cache (which ``same_cache`` says equals this one after new tokens).

        The tensors are shared, not cloned: cache tensors are replaced, never changed in place (``snapshot``),
        so the first cut or append of either state gives it tensors of its own. A 4k-token cache costs no copy
        for each policy that evicts it right after.
        """
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys, mine.values = theirs.keys, theirs.values
            mine.is_initialized, mine.device = True, theirs.device

    def _greedy(
        self, first_logits: torch.Tensor, max_new_tokens: int, stop_ids: set[int], on_token: OnReply | None,
    ) -> tuple[list[int], list[torch.Tensor]]:
        """``decode.greedy`` feeding each chosen token into the cache (no bookkeeping)."""
        start = self.next_positions(max_new_tokens)  # the cache grows as tokens are fed: fix positions first

        def step(token: int, i: int) -> torch.Tensor:
            return self.forward(torch.tensor([token], device=self.lm.device), start[i : i + 1], None, already=i)[-1]

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
        self.record_append(fed, start[: len(fed)], None)
        return reply, torch.stack(steps)

    def drop_last(self, n: int) -> None:
        """Undo the last ``n`` appended tokens (only valid when nothing was evicted since)."""
        if n <= 0:
            return
        self.truncate([length - n for length in self.lengths()])
        self.tokens = self.tokens[:-n]
        self.reconstructed = min(self.reconstructed, self.seen)

    def truncate(self, lengths: list[int]) -> None:
        """Keep the first ``lengths`` slots per layer (drops a generation's temporary tokens)."""
        for lay, n in zip(self.layers, lengths):
            lay.truncate(n)

    def keep(self, layer: int, keep: torch.Tensor) -> None:
        """Keep the slots ``keep`` [kv_heads, slots] (bool; heads may keep different numbers) of one layer.

        In rerotated mode call ``realign`` once every layer has been cut.
        """
        self.layers[layer].keep(keep)
        self.diverged = True


def host_lists(rows: list[torch.Tensor]) -> list[list]:
    """Each 1-d tensor of ``rows`` as a list, read from the device in one copy (on a GPU each read waits for every
    queued kernel)."""
    flat = iter(torch.cat(rows).tolist())
    return [[next(flat) for _ in range(len(row))] for row in rows]


def to_kv_heads(per_query_head: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[heads, slots] → [kv_heads, slots]: mean over the query heads that share a KV head (GQA)."""
    heads, slots = per_query_head.shape
    return per_query_head.view(n_kv_heads, heads // n_kv_heads, slots).mean(dim=1)


def to_kv_heads_max(per_query_head: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[heads, slots] → [kv_heads, slots]: the max over the query heads that share a KV head (KVzip's GQA rule)."""
    heads, slots = per_query_head.shape
    return per_query_head.view(n_kv_heads, heads // n_kv_heads, slots).amax(dim=1)


def to_query_heads(per_kv_head: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[kv_heads, slots] → [heads, slots], repeating each KV head for its query group."""
    return per_kv_head.repeat_interleave(n_heads // per_kv_head.shape[0], dim=0)
