"""Training-free cross-layer K/V sharing on the loaded model, and adjacent-layer K/V similarity.

``shared_forward`` runs the decoder layer by layer. Every layer computes its own queries; a layer
that is not a K/V producer in the scheme attends to its producer's post-RoPE K and V instead of
its own (CLA-k: the first layer of each group of k; YOCO: the middle layer's projection of the
lower half's output, for the whole upper half, which then runs for the last positions only).

A pretrained model was never trained to share K/V, so the fidelity loss measured here is an upper
bound on what a model trained with CLA or YOCO would lose; the compute saved is real.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

from kvlab.engine.attention import kvlab_attention
from kvlab.engine.facts import LoadedModel
from kvlab.engine.reference import plain_logits
from kvlab.errors import KvlabError
from kvlab.sharing.schemes import Scheme, make_scheme

# producer layer -> (keys, values), each [batch, kv_heads, tokens, head_dim], keys after RoPE
SharedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, tokens, head_dim]; cos/sin [batch, tokens, head_dim]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _heads(proj: torch.nn.Module, x: torch.Tensor, head_dim: int, norm: torch.nn.Module | None) -> torch.Tensor:
    """Project and split into heads: [batch, tokens, hidden] -> [batch, heads, tokens, head_dim]."""
    out = proj(x).view(*x.shape[:-1], -1, head_dim)
    if norm is not None:  # per-head norms before RoPE (Qwen3-style)
        out = norm(out)
    return out.transpose(1, 2)


def shared_forward(
    lm: LoadedModel, ids: list[int], scheme: Scheme, kv: SharedKV | None = None, start: int = 0, last_n: int = 1
) -> tuple[torch.Tensor, SharedKV]:
    """Run ``ids[start:]`` after ``start`` cached tokens in ``kv``; logits of the last ``last_n`` positions.

    Returns (logits [last_n, vocab], the producers' K/V extended by the new tokens).
    """
    base = lm.model.model
    layers = base.layers
    if len(layers) != scheme.n_layers:
        raise KvlabError(f"scheme {scheme.label} is for {scheme.n_layers} layers; the model has {len(layers)}")
    kv = dict(kv or {})
    new = len(ids) - start
    last_n = min(last_n, new)
    with lm.lock, torch.inference_mode():
        input_ids = torch.tensor([ids[start:]], device=lm.device)
        hidden = base.embed_tokens(input_ids)  # [1, new, hidden]
        positions = torch.arange(start, len(ids), device=lm.device)[None]
        cos, sin = base.rotary_emb(hidden, positions)  # [1, new, head_dim]
        for idx, layer in enumerate(layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            if scheme.produces(idx):
                k = _rope(_heads(attn.k_proj, x, attn.head_dim, getattr(attn, "k_norm", None)), cos, sin)
                v = _heads(attn.v_proj, x, attn.head_dim, None)
                if idx in kv:
                    k = torch.cat([kv[idx][0], k], dim=-2)
                    v = torch.cat([kv[idx][1], v], dim=-2)
                kv[idx] = (k, v)
            if idx == scheme.upper_start:  # nothing above writes K/V: only the last positions are needed
                hidden, x = hidden[:, -last_n:], x[:, -last_n:]
                cos, sin = cos[:, -last_n:], sin[:, -last_n:]
            q = _rope(_heads(attn.q_proj, x, attn.head_dim, getattr(attn, "q_norm", None)), cos, sin)
            keys, values = kv[scheme.producers[idx]]
            out, _ = kvlab_attention(attn, q, keys, values, None, scaling=attn.scaling)  # [1, q, heads, head_dim]
            hidden = hidden + attn.o_proj(out.reshape(*hidden.shape[:-1], -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = lm.model.lm_head(base.norm(hidden[:, -last_n:]))[0].float()
    return logits, kv


def crop_kv(kv: SharedKV, tokens: int) -> SharedKV:
    """The first ``tokens`` positions of every producer's K/V (views; new tokens are concatenated later).

    Not ``engine.cache.cropped``: a ``SharedKV`` holds only the layers a scheme produces, keyed by layer,
    as plain tensors, where a ``DynamicCache`` holds one layer per model layer.
    """
    return {layer: (k[:, :, :tokens], v[:, :, :tokens]) for layer, (k, v) in kv.items()}


_REFUSALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its refusal, or None
_CHECKING = threading.Lock()  # the app's sessions run on threads: one probe per model


def sharing_refusal(lm: LoadedModel) -> str | None:
    """Why K/V sharing cannot run on ``lm``, in words (None: it can): ``check_supported``, its probe forwards run once
    per loaded model rather than on every page drawn or measurement started."""
    with _CHECKING:
        if lm.model not in _REFUSALS:
            try:
                check_supported(lm)
                _REFUSALS[lm.model] = None
            except KvlabError as exc:
                _REFUSALS[lm.model] = str(exc)
        return _REFUSALS[lm.model]


def check_supported(lm: LoadedModel) -> None:
    """Raise KvlabError unless the layer-by-layer loop reproduces the model's own forward."""
    base = getattr(lm.model, "model", None)
    attn = getattr(getattr(base, "layers", [None])[0], "self_attn", None)
    if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
        raise KvlabError("K/V sharing needs a Llama-style decoder (q/k/v/o projections per layer)")
    ids = list(range(10, 26))
    try:  # the loop calls the layers' parts as a Llama layer's: other layers may fail in any way, here said in words
        ours, _ = shared_forward(lm, ids, make_scheme("full", len(base.layers)), last_n=4)
    except Exception as exc:
        raise KvlabError(f"K/V sharing's layer-by-layer loop cannot run {lm.facts.name}'s layers "
                         f"({type(exc).__name__}: {exc}); it is not available for this architecture") from exc
    ref = plain_logits(lm, ids, 4)
    if not torch.allclose(ours, ref, atol=1e-2 * max(1.0, ref.abs().max().item()), rtol=0):
        raise KvlabError("this architecture's layers differ from the Llama layout; K/V sharing is not available for it")


def adjacent_similarity(cache: DynamicCache) -> dict[str, torch.Tensor]:
    """Mean cosine similarity of K and of V between layer l and l+1 over all tokens, per KV head.

    Returns {"k": [layers-1, kv_heads], "v": [layers-1, kv_heads]}. Keys are compared after RoPE:
    both layers rotate a token by the same angle, and a rotation does not change cosines.
    """
    out = {}
    for name in ("k", "v"):
        tensors = [(layer.keys if name == "k" else layer.values)[0].float() for layer in cache.layers]  # [kv, t, d]
        sims = [F.cosine_similarity(a, b, dim=-1).mean(dim=-1) for a, b in zip(tensors[:-1], tensors[1:])]
        out[name] = torch.stack(sims)  # [layers-1, kv_heads]
    return out
