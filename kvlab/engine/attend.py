"""The attention product over given keys: scaled, soft-capped scores, their mask and the softmax-weighted values.

kvlab's attention function (``attention.py``) decides which keys each query sees; this module is the one
place that turns a query, its keys and a mask into attention, whether the keys are a layer's own or
the pages a sparse read gathered (``sparse.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_CHUNK = 256
CHUNK_FLOATS = 1 << 22  # 16 MB of float32 scores: half of a server CPU's last-level cache (measured: issue 23)
CPU_ROWS = 64  # query rows a CPU chunk takes at most: past them the products gain nothing and the chunk leaves cache


def chunk_rows(query: torch.Tensor, keys: int, limit: int = QUERY_CHUNK) -> int:
    """How many queries of ``query`` [b, H, q, d] to score at a time against ``keys`` keys.

    On a CPU a chunk's products run faster the more rows it has, up to about 64, and its scores and softmax
    several times faster while the chunk stays in the last-level cache (9 heads over 4k keys, a layer's summing
    attention: 314 ms at 16 rows, 268 at 32, 247 at 64, 257 at 128; 2–3.5× sdpa's time at 256), so a chunk takes
    64 rows and fewer as the keys grow past the cache, down to 16. An accelerator takes ``limit`` rows: its cost is
    the number of kernels, not the cache.
    """
    if query.device.type != "cpu":
        return limit
    return min(limit, CPU_ROWS, max(16, CHUNK_FLOATS // (query.shape[0] * query.shape[1] * max(keys, 1))))


def scores(query: torch.Tensor, key: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """Scaled (and soft-capped) scores of query [b, H, q, d] against key [b, KV, k, d] → [b, H, q, k] float32."""
    b, n_heads, q, d = query.shape
    n_kv = key.shape[1]
    grouped = (query.float() * scaling).reshape(b, n_kv, (n_heads // n_kv) * q, d)  # query heads by KV head (GQA)
    out = torch.matmul(grouped, key.float().transpose(-1, -2)).view(b, n_heads, q, key.shape[-2])
    if softcap:
        out = torch.tanh(out / softcap) * softcap
    return out


def mask_scores(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``scores`` [b, H, q, k] with keys outside ``allowed`` [b, 1 or KV, q, k] set to -inf (GQA-aware)."""
    b, n_heads, q, k = scores.shape
    n_mask = allowed.shape[1]
    view = scores.view(b, n_mask, n_heads // n_mask, q, k)
    return view.masked_fill(~allowed[:, :, None], float("-inf")).view(b, n_heads, q, k)


def _soft_capped(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scaling: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with soft-capped scores, in query chunks (sdpa cannot cap): [b, H, q, d] in query's dtype.

    Scores and softmax in float32, probabilities cast to the value dtype before the product, as the
    model's eager attention does. ``allowed`` is [b, 1 or KV, q, k].
    """
    b, n_heads, q_len, _ = query.shape
    group = n_heads // key.shape[1]
    out = []
    rows = chunk_rows(query, key.shape[-2])
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        masked = mask_scores(scores(query[:, :, start:end], key, scaling, softcap), allowed[:, :, start:end])
        probs = torch.softmax(masked, dim=-1).to(value.dtype)  # [b, H, q, k]
        grouped = probs.view(b, key.shape[1], group * (end - start), -1)
        out.append(torch.matmul(grouped, value).view(b, n_heads, end - start, -1))
    return torch.cat(out, dim=2)


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, causal: bool,
    scaling: float, softcap: float | None,
) -> torch.Tensor:
    """Attention of query [b, H, q, d] over key and value [b, KV, k, d] → [b, H, q, d].

    ``mask`` [b or 1, 1 or KV or H, q, k] bool: the keys each query sees (None: every key, or the causal
    rule when ``causal``, which a soft-capped model never leaves to this function).
    """
    q_len, k_len = query.shape[-2], key.shape[-2]
    if softcap:
        if mask is None:  # sdpa cannot cap, so the capped path always takes a mask
            mask = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=query.device)
        return _soft_capped(query, key, value, mask.expand(query.shape[0], -1, q_len, k_len), scaling, softcap)
    if mask is not None and mask.shape[1] not in (1, query.shape[1]):  # per-KV-head windows: one per query head
        mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def attend_last(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Queries [b, H, q, d] at the last q of the k positions of key and value [b, KV, k, d], each seeing the keys up
    to its own → [b, H, q, d].

    sdpa's causal kernel skips the key blocks above the diagonal, but only where queries and keys start together;
    with a mask instead it computes every block. Where few keys come before the queries (an edit near the top of a
    file: 7 kept of 1,589 tokens), the queries are padded in front to k rows, run causal, and the padding's rows
    dropped: 25 ms a layer against 40 with the mask at 1.6k tokens on a CPU.
    """
    pad = key.shape[-2] - query.shape[-2]
    padded = torch.cat([query.new_zeros(*query.shape[:2], pad, query.shape[-1]), query], dim=2)
    out = F.scaled_dot_product_attention(padded, key, value, is_causal=True, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out[:, :, pad:]
