"""Rotary position embeddings: re-rotating cached keys, and measuring what position drift costs.

Keys are cached after RoPE, so a chunk prefilled at offset 0 carries rotation ``R(j)`` for its
token ``j``. Placed at offset ``p`` it should carry ``R(p + j) = R(p) R(j)``: multiplying by the
cos/sin of ``Δp`` alone moves it there exactly (up to float noise). Everything here uses the
model's own rotary module, so its frequencies (and any scaling) are the ones the model uses.
"""

from __future__ import annotations

import math

import torch
from transformers.models.llama.modeling_llama import rotate_half

from kvlab.engine.facts import LoadedModel
from kvlab.engine.reference import plain_logits
from kvlab.errors import KvlabError


def rotary_module(lm: LoadedModel) -> torch.nn.Module:
    """The model's rotary embedding module; KvlabError when the model has none."""
    rotary = getattr(getattr(lm.model, "model", lm.model), "rotary_emb", None)
    if rotary is None or not lm.facts.has_rope:
        raise KvlabError(f"{lm.facts.name} has no rotary position embedding, so there is no RoPE drift to study")
    return rotary


def layer_type(lm: LoadedModel, layer: int) -> str | None:
    """The RoPE kind of ``layer`` where the model keeps one per layer type (Gemma 3), else None."""
    rotary = rotary_module(lm)
    if not hasattr(rotary, "layer_types"):
        return None
    return lm.model.config.get_text_config().layer_types[layer]


def cos_sin(
    lm: LoadedModel, positions: torch.Tensor, like: torch.Tensor, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled cos/sin of ``layer``'s rotary embedding at ``positions`` [tokens] → each [tokens, rotary_dim].

    ``rotary_dim`` is below ``head_dim`` for partial rotary (Phi-3). The module multiplies by
    ``attention_scaling`` (YaRN-style models); a re-rotation must not apply that factor a second
    time, so it is divided out.
    """
    rotary = rotary_module(lm)
    kind = layer_type(lm, layer)
    args = (kind,) if kind is not None else ()
    cos, sin = rotary(like, positions.to(like.device)[None], *args)
    name = f"{kind}_attention_scaling" if kind is not None else "attention_scaling"
    scale = float(getattr(rotary, name, 1.0) or 1.0)
    return cos[0] / scale, sin[0] / scale


def rotate(lm: LoadedModel, x: torch.Tensor, delta: int | torch.Tensor, layer: int) -> torch.Tensor:
    """Rotate keys or queries ``x`` [..., tokens, head_dim] of ``layer`` by ``delta`` positions.

    ``delta`` is an int, a [tokens] tensor, or one offset per vector (shaped like ``x[..., 0]``,
    e.g. per KV head after a per-head eviction). Only the rotary part of each vector turns (the
    first ``rotary_dim`` features, as the model's ``apply_rotary_pos_emb`` does); the rest passes.
    """
    if isinstance(delta, int):
        delta = torch.full((x.shape[-2],), delta, dtype=torch.long)
    delta = delta.to(x.device).expand(x.shape[:-1])
    x32 = x.float()  # rotate in float32 even for half-precision caches
    offsets, which = torch.unique(delta.reshape(-1), return_inverse=True)  # a cut moves many keys by a few offsets
    cos, sin = (t.index_select(0, which) for t in cos_sin(lm, offsets, x32, layer))  # [vectors, rotary_dim]
    dim = cos.shape[-1]
    cos, sin = cos.view(*x.shape[:-1], dim), sin.view(*x.shape[:-1], dim)
    turned, passed = x32[..., :dim], x32[..., dim:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, passed], dim=-1).to(x.dtype)


def mean_rotation(lm: LoadedModel, layer: int, start: int, n: int) -> torch.Tensor:
    """``layer``'s RoPE rotation matrices at positions ``start`` … ``start + n − 1``, averaged → [head_dim, head_dim].

    ``R(p) x = cos(p) ⊙ x + sin(p) ⊙ rotate_half(x)`` on the rotary part, identity on the rest, so the
    mean is ``diag(mean cos) + diag(mean sin) · P`` with ``P`` the matrix of ``rotate_half``
    (Expected Attention's averaged rotation; kvpress ``expected_attention_press.py``, ``apply_avg_rope``).
    """
    d = lm.facts.head_dim
    cos, sin = cos_sin(lm, torch.arange(start, start + n), torch.zeros(1, device=lm.device), layer)
    dim, half = cos.shape[-1], cos.shape[-1] // 2
    turn = torch.zeros(dim, dim, device=cos.device)  # rotate_half(x) = turn @ x
    turn[:half, half:], turn[half:, :half] = -torch.eye(half), torch.eye(half)
    out = torch.eye(d, device=cos.device)
    out[:dim, :dim] = torch.diag(cos.float().mean(0)) + sin.float().mean(0)[:, None] * turn
    return out


def inverse_frequencies(lm: LoadedModel, layer: int) -> torch.Tensor:
    """Angular frequency of each rotary pair of ``layer``, radians per position [rotary_dim / 2]."""
    rotary = rotary_module(lm)
    kind = layer_type(lm, layer)
    inv_freq = getattr(rotary, f"{kind}_inv_freq") if kind is not None else rotary.inv_freq
    return inv_freq.detach().float().cpu()


def rotation_angles(inv_freq: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Rotation of each frequency pair after a shift of ``Δp``, wrapped to [-π, π] → [pairs, deltas]."""
    angles = inv_freq.double()[:, None] * deltas.double()[None, :]
    return torch.remainder(angles + math.pi, 2 * math.pi) - math.pi


def capture_qk(lm: LoadedModel, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE queries [heads, tokens, head_dim] and keys [kv_heads, tokens, head_dim] of one layer.

    Taken from the projections (after q_norm/k_norm where the model has them), while the text is
    prefilled alone at offset 0.
    """
    if not 0 <= layer < lm.facts.n_layers:
        raise KvlabError(f"layer must be in 0…{lm.facts.n_layers - 1}")
    return capture_qk_layers(lm, ids, [layer])[0]


def capture_qk_layers(lm: LoadedModel, ids: list[int], layers: list[int]
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``capture_qk`` of several layers from one forward: per layer (queries, keys), as ``capture_qk``'s."""
    net = getattr(lm.model, "model", lm.model)
    got: dict[tuple[int, str], torch.Tensor] = {}

    def keep(layer: int, name: str):
        def hook(_module, _inputs, output):
            got[layer, name] = output.detach()
        return hook

    handles = []
    for layer in layers:
        attn = net.layers[layer].self_attn
        q_mod = getattr(attn, "q_norm", None) or attn.q_proj
        k_mod = getattr(attn, "k_norm", None) or attn.k_proj
        handles += [q_mod.register_forward_hook(keep(layer, "q")), k_mod.register_forward_hook(keep(layer, "k"))]
    try:
        plain_logits(lm, ids, logits_to_keep=1)  # only the hooks' outputs are read
    finally:
        for handle in handles:
            handle.remove()
    d = lm.facts.head_dim
    return [tuple(got[layer, name].reshape(len(ids), -1, d).transpose(0, 1).float().cpu() for name in "qk")
            for layer in layers]


def qk_drift(
    lm: LoadedModel, q: torch.Tensor, k: torch.Tensor, head: int, deltas: list[int], n_queries: int = 64,
    layer: int = 0,
) -> dict[str, list[float]]:
    """Score error of naive reuse vs ``Δp`` for one query head and its KV head.

    Naive reuse leaves key ``j`` rotated for position ``j`` while the query sits ``Δp`` further on,
    so every relative distance grows by ``Δp``. For the last ``n_queries`` queries against all
    earlier keys: mean |score error| (scaled scores, as softmax sees them) and the mean total
    variation distance between the true and the drifted attention rows.
    """
    heads, tokens, d = q.shape
    if not 0 <= head < heads:
        raise KvlabError(f"head must be in 0…{heads - 1}")
    kv_head = head // (heads // k.shape[0])
    qs, ks = q[head, -n_queries:].double(), k[kv_head].double()  # [nq, d], [tokens, d]
    q_pos = torch.arange(tokens - qs.shape[0], tokens)
    k_rot = rotate(lm, ks[None].float(), torch.arange(tokens), layer)[0].double()
    allowed = torch.arange(tokens)[None, :] <= q_pos[:, None]  # [nq, tokens]
    attn = getattr(lm.model, "model", lm.model).layers[layer].self_attn
    scale = float(getattr(attn, "scaling", d ** -0.5))  # the model's own (Gemma: query_pre_attn_scalar)

    def scores(shift: int) -> torch.Tensor:
        q_rot = rotate(lm, qs[None].float(), q_pos + shift, layer)[0].double()
        return (q_rot @ k_rot.T) * scale

    true = scores(0)
    true_p = torch.softmax(true.masked_fill(~allowed, float("-inf")), dim=-1)
    abs_err, tv = [], []
    for delta in deltas:
        drift = scores(delta)
        drift_p = torch.softmax(drift.masked_fill(~allowed, float("-inf")), dim=-1)
        abs_err.append(float((drift - true).abs()[allowed].mean()))
        tv.append(float(0.5 * (drift_p - true_p).abs().sum(-1).mean()))
    return {"delta": list(deltas), "score_abs_error": abs_err, "attention_tv": tv,
            "score_std": float(true[allowed].std())}
