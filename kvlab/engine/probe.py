"""Attention statistics a forward collects (``Probe``), taken from the same softmax rows the attention uses.

Statistics are never taken from full attention maps. A ``Probe`` set for one forward asks for softmax rows of the
last ``n`` queries only (SnapKV's observation window, sink mass), and for column sums over all queries computed in
chunks (H2O), so the extra memory stays small; a forward of one row that asks for column sums, or whose windows hold
every query (a short message or a fed reply), takes its attention and its statistics from the same chunks'
probabilities, so its scores are computed once. They use the same mask and soft-capping as the attention itself. A
probe may also ask for the mean and covariance of the forward's queries before RoPE (Expected Attention): the caller
that knows the queries' positions gives the un-rotation, since queries reach this function already rotated. And it
may ask, per key, for the most attention any query of the forward gives it (in chunks too), each query's softmax
taken over a subset of the keys (KVzip's reconstruction pass: the sinks, the chunk being repeated and the forward's
own keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from kvlab.engine.attend import QUERY_CHUNK, chunk_rows, mask_scores, scores


@dataclass
class Probe:
    """Attention statistics to collect during one forward pass, filled per layer.

    ``windows``: for each n, the mean softmax row of the last n queries, [heads, keys].
    ``colsum``: when set, the sum of softmax rows over every query, [heads, keys].
    ``queries_from``: for each original position p, the mean [heads, head_dim] and covariance
    [heads, head_dim, head_dim] of the forward's pre-RoPE queries at positions ≥ p (Expected
    Attention leaves its sinks' queries out). ``KVState.prepare_probe`` fills in ``unrotate`` (a
    layer's rotated queries [heads, q, head_dim] → pre-RoPE) and ``first_position`` (the original
    position of the forward's first query).
    ``colmax_over``: per layer, [kv_heads, cached slots] bool: the cached keys each query's softmax runs
    over, the forward's own keys joining it causally; ``colmaxes`` then holds, per key, the largest of
    those softmax rows over every query, [heads, keys] (0 for a key outside the subset).
    """

    windows: tuple[int, ...] = ()
    colsum: bool = False
    queries_from: tuple[int, ...] = ()
    colmax_over: list[torch.Tensor] | None = None
    unrotate: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    first_position: int = 0
    window_means: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # n -> layer -> [heads, keys]
    colsums: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, keys]
    query_means: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # p -> layer -> [heads, head_dim]
    query_covs: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # p -> layer -> [heads, d, d]
    colmaxes: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, keys]

    @property
    def asks(self) -> bool:
        """Whether this probe collects anything."""
        return bool(self.windows or self.colsum or self.queries_from or self.colmax_over is not None)


@dataclass
class KeyLayout:
    """What the keys of one layer's forward look like to its queries."""

    q_len: int
    k_len: int
    window: int | None
    key_pos: torch.Tensor | None  # [batch, 1 or kv_heads, k] original positions (windows, scattered queries)
    query_pos: torch.Tensor | None = None  # [batch, q] for scattered queries; else each query's own slot
    real: torch.Tensor | None = None  # [batch, kv_heads, k] False at a head's padding (statistics only)

    def positions(self, q_start: int, q_end: int, visible: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of queries [q_start, q_end) → [b, q] and of the first ``visible`` keys → [b, 1 or kv, visible]."""
        if self.key_pos is None:
            first = self.k_len - self.q_len
            return (torch.arange(first + q_start, first + q_end, device=device)[None],
                    torch.arange(visible, device=device)[None, None])
        own = self.query_pos if self.query_pos is not None else self.key_pos[:, 0, self.k_len - self.q_len :]
        return own[:, q_start:q_end].to(device), self.key_pos[:, :, :visible].to(device)

    def scattered(self, device: torch.device) -> torch.Tensor:
        """Causal rule by position, and the window, for scattered queries → [b, 1, q, k]."""
        query_pos, key_pos = self.positions(0, self.q_len, self.k_len, device)
        distance = query_pos[:, None, :, None] - key_pos[:, :, None, :]
        return (distance >= 0) & (distance < self.window if self.window is not None else True)

    def visible(self, q_start: int, q_end: int, visible: int, device: torch.device) -> torch.Tensor | None:
        """Window mask of queries [q_start, q_end) over the first ``visible`` keys → [b, 1 or kv, q, visible].

        None when the layer has no window (the causal rule alone applies).
        """
        if self.window is None:
            return None
        query_pos, key_pos = self.positions(q_start, q_end, visible, device)
        return (query_pos[:, None, :, None] - key_pos[:, :, None, :]) < self.window


def softmax_rows(
    query: torch.Tensor, key: torch.Tensor, scaling: float, q_start: int, q_total: int,
    layout: KeyLayout, softcap: float | None, over: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax rows of new queries [q_start, q_start + q) out of q_total, over the keys they can see.

    query [1, H, q, d], key [1, KV, k, d] → [1, H, q, visible] float32, where ``visible`` keys end at
    the slice's last query: later keys are masked for every row, so they are never computed.
    ``over`` [1, KV, 1, k]: only these keys enter the softmax (the others get 0).
    """
    q = query.shape[-2]
    visible = key.shape[-2] - q_total + q_start + q
    logits = scores(query, key[:, :, :visible], scaling, softcap)
    later = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1)  # the slice's own keys, not yet seen
    logits[..., visible - q :].masked_fill_(later, float("-inf"))
    window = layout.visible(q_start, q_start + q, visible, logits.device)
    if window is not None:
        logits = mask_scores(logits, window)
    if layout.real is not None:
        logits = mask_scores(logits, layout.real[:, :, None, :visible])
    if over is not None:
        logits = mask_scores(logits, over[..., :visible])
    return torch.softmax(logits, dim=-1)


def softmax_chunks(
    query: torch.Tensor, key: torch.Tensor, scaling: float, layout: KeyLayout, softcap: float | None,
    over: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """``softmax_rows`` of every query of one row [1, H, q, d], a chunk of queries at a time → [1, H, c, visible]
    each, so that no more than a chunk's rows are held."""
    q_total = query.shape[-2]
    rows = chunk_rows(query, key.shape[-2], QUERY_CHUNK)
    for start in range(0, q_total, rows):
        yield softmax_rows(query[:, :, start : start + rows], key, scaling, start, q_total, layout, softcap, over)


def record(
    probe: Probe, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, layout: KeyLayout,
    softcap: float | None, softmax: bool = True,
) -> None:
    """Fill ``probe``'s statistics of one row at ``layer``; its window means and column sums only with ``softmax``
    (otherwise the attention itself gives them: ``attend_recording``)."""
    q_total = query.shape[-2]
    if probe.windows and softmax:
        widest = min(max(probe.windows), q_total)
        _window_means(probe, layer, softmax_rows(query[:, :, -widest:], key, scaling, q_total - widest, q_total,
                                                 layout, softcap)[0])
    if probe.colsum and softmax:
        total = torch.zeros(query.shape[1], key.shape[-2], device=query.device)
        for rows in softmax_chunks(query, key, scaling, layout, softcap):  # [1, heads, q, visible]
            total[:, : rows.shape[-1]] += rows[0].sum(dim=1)
        probe.colsums[layer] = total
    if probe.colmax_over is not None:
        cached = probe.colmax_over[layer].to(query.device)  # [kv_heads, k - q_total]
        if cached.shape[-1] != key.shape[-2] - q_total:
            raise ValueError(f"layer {layer}: colmax_over covers {cached.shape[-1]} cached keys, the forward sees "
                             f"{key.shape[-2] - q_total}")
        over = torch.cat([cached, cached.new_ones(cached.shape[0], q_total)], dim=-1)[None, :, None]  # [1, KV, 1, k]
        best = torch.zeros(query.shape[1], key.shape[-2], device=query.device)
        for rows in softmax_chunks(query, key, scaling, layout, softcap, over):  # [1, heads, q, visible]
            best[:, : rows.shape[-1]] = torch.maximum(best[:, : rows.shape[-1]], rows[0].amax(dim=1))
        probe.colmaxes[layer] = best
    if probe.queries_from:
        if probe.unrotate is None:
            raise ValueError("query statistics need the queries' un-rotation (KVState.prepare_probe sets it)")
        pre = probe.unrotate(layer, query[0].float())  # [heads, q, head_dim] before RoPE
        for start in probe.queries_from:
            kept = pre[:, max(0, start - probe.first_position) :]
            if kept.shape[1] == 0:  # every query of this forward lies before ``start``: nothing to say
                continue
            mean = kept.mean(dim=1)  # [heads, head_dim]
            centred = kept - mean[:, None]
            probe.query_means.setdefault(start, {})[layer] = mean
            probe.query_covs.setdefault(start, {})[layer] = centred.transpose(1, 2) @ centred / kept.shape[1]


def attend_recording(
    probe: Probe, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
    layout: KeyLayout, softcap: float | None,
) -> torch.Tensor:
    """Attention of one row's queries [1, H, q, d] over its keys and values [1, KV, k, d] → [1, H, q, d], filling
    ``probe``'s window means and column sums at ``layer`` from the same softmax rows.

    Each chunk's probabilities serve both, as H2O's authors read their sums off the eager attention's weights
    (SnapKV's compute the window's rows apart: the same numbers): one score product and one softmax, where
    attention and statistics apart would take two. Probabilities are cast to the value dtype before the product,
    as the model's eager attention does.
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    q_total, k_total = query.shape[-2], key.shape[-2]
    widest = min(max(probe.windows, default=0), q_total)
    total = torch.zeros(heads, k_total, device=query.device) if probe.colsum else None
    window = []  # the last ``widest`` softmax rows, [H, rows, k] each
    out, start = [], 0
    for probs in softmax_chunks(query, key, scaling, layout, softcap):  # [1, H, c, visible]
        chunk, visible = probs.shape[-2:]
        if total is not None:
            total[:, :visible] += probs[0].sum(dim=1)
        if start + chunk > q_total - widest:
            rows = probs[0, :, max(0, q_total - widest - start) :]  # [H, rows, visible]
            window.append(torch.nn.functional.pad(rows, (0, k_total - visible)))
        grouped = probs.to(value.dtype).view(1, kv_heads, -1, visible)  # [1, KV, group · c, visible] (GQA)
        out.append(torch.matmul(grouped, value[:, :, :visible]).view(1, heads, chunk, -1))
        start += chunk
    if total is not None:
        probe.colsums[layer] = total
    if widest:
        _window_means(probe, layer, torch.cat(window, dim=1))
    return torch.cat(out, dim=2)


def _window_means(probe: Probe, layer: int, rows: torch.Tensor) -> None:
    """Each of ``probe``'s windows' mean softmax row at ``layer``, from the forward's last softmax rows [heads,
    widest, keys] (widest: the largest window, or every query where the forward has fewer)."""
    for n in probe.windows:
        probe.window_means.setdefault(n, {})[layer] = rows[:, -n:].mean(dim=1)  # [heads, keys]
