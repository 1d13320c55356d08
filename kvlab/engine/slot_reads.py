"""Quest's decoding step on a CPU in one compiled call: choose each head's pages, then read only those.

Quest's own kernels choose the pages from their min and max keys and read the selected pages where the
paged cache holds them (mit-han-lab/Quest ``quest/utils/decode_wrapper.py``: a paged decode kernel given
the indices of the chosen pages). Gathering the chosen keys into a compact tensor first copies about as
many bytes as a dense read of every key, so it cannot make a sparse read cheaper than Full's; this kernel
reads them in place instead. The query heads of one KV head (GQA) read that KV head's keys: each key of
the union of their pages is loaded once and scored for the heads that chose its page.

It runs on the calling thread: called between a layer's matrix products, a thread pool of its own would
wait on torch's (measured: no faster than one thread, and it slowed the dense attention beside it).
It serves float32 caches on a CPU; elsewhere Quest gathers the chosen keys and calls ``attend`` (the two
are tested equal, and equal to eager attention with the unread keys masked). Numba compiles it on first
use and caches the compiled code.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

MAX_GROUP = 63  # query heads per KV head the kernel serves: one bit each in a page's reader mask
_NO_SLOTS = np.zeros(0, np.int64)
_NO_MASK = np.zeros((0, 0), np.bool_)


@numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _choose(q, low, high, own, count, sinks, pages):  # pragma: no cover - compiled
    """Per query head h, the ``count`` earlier pages of highest bound Σ_d max(q_d·min_d, q_d·max_d) → pages[h],
    best first; the first ``sinks`` rank above every bound; ties go to the earlier page."""
    heads, d = q.shape
    group = heads // low.shape[0]
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


@numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _exp_shifted(w, best, bits):  # pragma: no cover - compiled
    """w ← exp(w − best) in place, 0 below e^−87 (and for −inf): Cephes' single-precision exp (range reduction by
    ln 2, a polynomial, 2^m from the exponent bits), in loops the compiler vectorizes; within 2 ulp of
    ``math.exp``, whose scalar calls took a third of the kernel's time."""
    n = w.shape[0]
    for i in range(n):
        x = max(w[i] - best, np.float32(-87.0))
        m = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
        r = x - m * np.float32(0.693359375) - m * np.float32(-2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        bits[i] = (np.int32(m) + np.int32(127)) << 23
        w[i] = (p * r * r + r + np.float32(1.0)) if w[i] - best > np.float32(-87.0) else np.float32(0.0)
    scale = bits.view(np.float32)
    for i in range(n):
        w[i] *= scale[i]


@numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _page_attention(q, k, v, low, high, own, count, sinks, size, n, slot_of, visible, scale,
                    softcap):  # pragma: no cover - compiled
    heads, d = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    scale, softcap = np.float32(scale), np.float32(softcap)
    out = np.zeros((heads, d), np.float32)
    pages = np.empty((heads, count), np.int64)
    _choose(q, low, high, own, count, sinks, pages)
    readers = np.zeros((kv_heads, own + 1), np.int64)  # bit g: query head g of the KV head's group reads the page
    for h in range(heads):
        for i in range(count):
            readers[h // group, pages[h, i]] |= np.int64(1) << (h % group)
    mapped = slot_of.shape[0] > 0
    windowed = visible.shape[0] > 0
    slot = np.empty(n, np.int64)
    weight = np.empty((group, n), np.float32)
    bits = np.empty(n, np.int32)
    for kv in range(kv_heads):
        readers[kv, own] = (np.int64(1) << group) - 1  # every head reads its own page
        rows = 0
        for p in range(own + 1):  # the union of the group's pages, in order: each key loaded once
            who = readers[kv, p]
            if not who:
                continue
            for at in range(p * size, min(p * size + size, n)):
                if mapped:
                    at = slot_of[at]
                slot[rows] = at
                seen = not windowed or visible[min(kv, visible.shape[0] - 1), at]
                key = k[kv, at]  # a row as a view: numba vectorizes its products
                for g in range(group):
                    score = np.float32(-np.inf)
                    if seen and who >> g & 1:
                        qh = q[kv * group + g]
                        score = np.float32(0.0)
                        for j in range(d):
                            score += qh[j] * key[j]
                        score *= scale
                        if softcap > 0:
                            score = np.float32(math.tanh(score / softcap) * softcap)
                    weight[g, rows] = score
                rows += 1
        for g in range(group):
            w = weight[g, :rows]
            best = np.float32(-np.inf)
            for r in range(rows):
                best = max(best, w[r])
            _exp_shifted(w, best, bits)
            total = np.float32(0.0)
            acc = out[kv * group + g]
            for r in range(rows):
                e = w[r]
                if e == 0.0:
                    continue
                total += e
                value = v[kv, slot[r]]
                for j in range(d):
                    acc[j] += e * value[j]
            for j in range(d):
                acc[j] /= total
    return out, pages


def _rows(t: torch.Tensor) -> np.ndarray:
    """t [1, KV, k, d] or [KV, k, d] as a C-contiguous array [KV, ≥ k, d], so that the kernel reads it with unit
    strides: where t is not contiguous, the rows of the storage it lies in (a slab's row of ``capacity`` slots is
    [KV, capacity, d]) rather than a copy."""
    a = t.numpy()
    a = a[0] if a.ndim == 4 else a
    if a.flags.c_contiguous:
        return a
    t = t[0] if t.ndim == 4 else t
    (kv, k, d), (s0, s1, s2) = t.shape, t.stride()
    if s2 == 1 and s1 == d and s0 % d == 0 and s0 // d >= k:
        return t.as_strided((kv, s0 // d, d), (s0, d, 1)).numpy()  # torch refuses rows outside the storage
    return np.ascontiguousarray(a)


def reads_in_place(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``page_attention`` serves this query [1, H, 1, d] and these keys [1, KV, k, d] (float32, on a CPU)."""
    return (query.device.type == "cpu" and query.dtype == key.dtype == torch.float32
            and query.shape[1] // key.shape[1] <= MAX_GROUP)


def page_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, low: torch.Tensor, high: torch.Tensor, own: int,
    count: int, sinks: int, size: int, n: int, slot_of: torch.Tensor | None, visible: torch.Tensor | None,
    scaling: float, softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's step for one query [1, H, 1, d] over key and value [1, KV, k, d]: per head, the ``count`` earlier
    pages of highest bound over the page extremes ``low``/``high`` [KV, ≥ own, d] (the first ``sinks`` above all,
    ties to the earlier page), then attention over those pages' keys and the own page's, up to the n-th key
    → (out [1, H, 1, d], pages [H, count] best first).

    ``slot_of`` [n]: the slot of the row's i-th key (None: slot i); ``visible`` [1 or KV, k]: the keys a window or
    padding leaves the query (None: all). Arguments become arrays with as few torch calls as can be: a decoding
    step calls this once per layer, between the layer's matrix products, where each call costs several
    microseconds (measured: a tenth of the step's attention in all).
    """
    q = query.numpy()[0, :, 0]  # [H, d]
    q = q if q.flags.c_contiguous else np.ascontiguousarray(q)
    mapped = _NO_SLOTS if slot_of is None else slot_of.numpy()
    seen = _NO_MASK if visible is None else np.ascontiguousarray(visible.numpy())
    out, pages = _page_attention(q, _rows(key), _rows(value), _rows(low), _rows(high), own, count, sinks,
                                 size, n, mapped, seen, scaling, softcap or 0.0)
    return torch.from_numpy(out.reshape(1, out.shape[0], 1, -1)), torch.from_numpy(pages)
