"""Attention of one decoding query over chosen slots of its keys, read where they lie: a CPU kernel.

A sparse read (Quest) chooses, per query head, the slots its query reads. Gathering those keys and values
into a compact tensor before attending copies about as many bytes as a dense read of every key, so a gather
cannot make a sparse read cheaper than Full's. Quest's own kernels read the selected pages where the cache
holds them (mit-han-lab/Quest ``quest/utils/decode_wrapper.py``: a paged decode kernel given the indices of
the chosen pages); this kernel does the same on a CPU: for each query head, the scores of
its slots, their softmax, and the weighted sum of their values, with no copy of a key or a value.

It serves float32 caches on a CPU, where ``sparse.py`` calls it; elsewhere ``sparse.py`` gathers and calls
``attend`` (the two are tested equal). Numba compiles it on first use and caches the compiled code.
"""

from __future__ import annotations

import math
import threading

import numba
import numpy as np
import torch

_LOCK = threading.Lock()  # numba's default thread pool runs one parallel kernel at a time


@numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _kernel(q, k, v, slots, seen, scale, softcap, out):  # pragma: no cover - compiled
    heads, d = q.shape
    group = heads // k.shape[0]
    n = slots.shape[1]
    masked = seen.shape[0] > 0
    for h in numba.prange(heads):
        kv = h // group
        weight = np.empty(n, np.float32)
        best = np.float32(-np.inf)
        for i in range(n):
            if masked and not seen[h, i]:
                weight[i] = -np.inf
                continue
            row = slots[h, i]
            s = np.float32(0.0)
            for j in range(d):
                s += q[h, j] * k[kv, row, j]
            s *= scale
            if softcap > 0:
                s = np.float32(math.tanh(s / softcap) * softcap)
            weight[i] = s
            best = max(best, s)
        total = np.float32(0.0)
        for i in range(n):
            e = np.float32(math.exp(weight[i] - best))
            weight[i] = e
            total += e
        for j in range(d):
            out[h, j] = 0.0
        for i in range(n):
            if weight[i] == 0.0:
                continue
            p = weight[i] / total
            row = slots[h, i]
            for j in range(d):
                out[h, j] += p * v[kv, row, j]


@numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _best_pages(q, low, high, count, sinks, size, n, pages, slots):  # pragma: no cover - compiled
    heads, d = q.shape
    group = heads // low.shape[0]
    own = low.shape[1]
    best = np.empty(count, np.float32)
    for h in range(heads):
        kv = h // group
        filled = 0
        for p in range(own):
            bound = np.float32(np.inf)
            if p >= sinks:
                bound = np.float32(0.0)
                for j in range(d):
                    x = q[h, j]
                    bound += max(x * low[kv, p, j], x * high[kv, p, j])
            if filled == count and not bound > best[count - 1]:
                continue
            at = filled if filled < count else count - 1
            filled = min(filled + 1, count)
            while at > 0 and best[at - 1] < bound:  # after every page as good: ties keep the earlier page first
                best[at], pages[h, at] = best[at - 1], pages[h, at - 1]
                at -= 1
            best[at], pages[h, at] = bound, p
        for i in range(count):
            for j in range(size):
                slots[h, i * size + j] = pages[h, i] * size + j
        for j in range(n - own * size):  # then the query's own page, up to its key
            slots[h, count * size + j] = own * size + j


def best_page_slots(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor, count: int, sinks: int, size: int,
                    n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's choice for one query [H, d] on a CPU, in one call: per head, the ``count`` pages of highest bound
    Σ_d max(q_d·min_d, q_d·max_d) over the pages' key extremes ``low``/``high`` [KV, own, d] (the first ``sinks``
    above all, ties to the earlier page) → pages [H, count], and their slots followed by the own page's up to
    slot n − 1 → [H, count · size + n − own · size]. The same choice as Quest's ``bounds_of`` and ``top_pages``,
    to the rounding of the bounds' sums."""
    heads, own = query.shape[0], low.shape[1]
    pages = torch.empty(heads, count, dtype=torch.long)
    slots = torch.empty(heads, count * size + n - own * size, dtype=torch.long)
    _best_pages(query.numpy(), low.numpy(), high.numpy(), count, sinks, size, n, pages.numpy(), slots.numpy())
    return pages, slots


def reads_in_place(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``attend_slots`` serves this query and these keys (float32, on a CPU)."""
    return query.device.type == "cpu" and query.dtype == key.dtype == torch.float32


def attend_slots(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, seen: torch.Tensor | None,
    scaling: float, softcap: float | None,
) -> torch.Tensor:
    """One query [H, d] over the ``slots`` [H, n] of key and value [KV, k, d] its heads read (each query head from
    its own KV head, GQA), the slots outside ``seen`` [H, n] (None: all seen) not read → [H, d]."""
    out = torch.empty_like(query)
    mask = np.zeros((0, 0), np.bool_) if seen is None else seen.numpy()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    with _LOCK:
        if numba.get_num_threads() != threads:
            numba.set_num_threads(threads)
        _kernel(query.numpy(), key.numpy(), value.numpy(), slots.numpy(), mask, np.float32(scaling),
                np.float32(softcap or 0.0), out.numpy())
    return out
