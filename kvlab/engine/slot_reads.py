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
    with _LOCK:
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        _kernel(query.numpy(), key.numpy(), value.numpy(), slots.numpy(), mask, np.float32(scaling),
                np.float32(softcap or 0.0), out.numpy())
    return out
