"""CacheBlend-style selective recompute of reused document KV.

The reused KV (chunks prefilled alone, keys re-rotated to their place) is wrong for document
tokens because each chunk never attended to what precedes it in the prompt. CacheBlend fixes
the tokens where that matters most: every document token runs through the first layers with
full attention to its real context (prefix and earlier documents); at ``select_layer`` the
tokens whose fresh K/V deviate most from the reused K/V are kept, and only those are carried
through the remaining layers. Their fresh K/V replace the reused entries layer by layer.

The selected tokens are scattered through the prompt, so the causal mask is not the
bottom-right one of a cache: kvlab's attention is told every key's and query's position
(``ForwardContext.query_pos``) and applies causality, each layer's sliding window and soft-cap by
position. Each layer gets its own rotary embedding (per-layer-type RoPE, Gemma 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.engine.attention import forward_context
from kvlab.engine.facts import LoadedModel
from kvlab.engine.rope import layer_type
from kvlab.workloads.rag.kv import SpanKV


class _ScatterCache:
    """Stands in for a cache inside the decoder layers: new K/V overwrite the reused entries
    at the rows being recomputed, and attention sees the whole span."""

    def __init__(self, kv: SpanKV) -> None:
        self.keys = [k[None].clone() for k in kv.keys]  # [1, kv_heads, tokens, head_dim]
        self.values = [v[None].clone() for v in kv.values]
        self.rows = torch.arange(0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx][:, :, self.rows] = key_states
        self.values[layer_idx][:, :, self.rows] = value_states
        return self.keys[layer_idx], self.values[layer_idx]


@dataclass(frozen=True)
class BlendResult:
    kv: SpanKV  # prefix + documents, selected rows recomputed
    selected: torch.Tensor  # recomputed document token indices (0 = first document token)
    deviation: torch.Tensor  # per document token K/V deviation at select_layer [doc tokens]


def selective_recompute(
    lm: LoadedModel, reused: SpanKV, doc_ids: list[int], doc_start: int, ratio: float, select_layer: int = 1
) -> BlendResult:
    """Recompute ``ratio`` of the document tokens (rows ``doc_start…``) of ``reused`` in place."""
    net = getattr(lm.model, "model", lm.model)
    n_layers, n_docs = len(net.layers), len(doc_ids)
    select_layer = min(max(select_layer, 0), n_layers - 1)
    n_keep = min(n_docs, max(1, math.ceil(ratio * n_docs)))
    scatter = _ScatterCache(reused)
    rows = torch.arange(doc_start, doc_start + n_docs)
    deviation = torch.zeros(n_docs)
    every_key = torch.arange(reused.n_tokens, device=lm.device)
    with lm.lock, torch.inference_mode():
        hidden = net.embed_tokens(torch.tensor([doc_ids], device=lm.device))
        for layer_idx, layer in enumerate(net.layers):
            scatter.rows = rows
            positions = rows.to(lm.device)[None]
            kind = layer_type(lm, layer_idx)
            cos, sin = net.rotary_emb(hidden, positions, *((kind,) if kind is not None else ()))
            # every key slot's position (all layers alike) [1, 1, slots]; the queries sit among them [1, q]
            with forward_context(key_pos=every_key[None, None], query_pos=positions[0][None]):
                hidden = layer(hidden, attention_mask=None, position_ids=positions, cache=scatter,
                               use_cache=True, position_embeddings=(cos, sin))
            if layer_idx == select_layer:
                d_k = (scatter.keys[layer_idx][0, :, rows] - reused.keys[layer_idx][:, rows]).float()
                d_v = (scatter.values[layer_idx][0, :, rows] - reused.values[layer_idx][:, rows]).float()
                deviation = (d_k.square().sum((0, 2)) + d_v.square().sum((0, 2))).sqrt().cpu()
                keep = torch.topk(deviation, n_keep).indices.sort().values
                rows = rows[keep]
                hidden = hidden[:, keep.to(hidden.device)]
    kv = SpanKV(tuple(k[0] for k in scatter.keys), tuple(v[0] for v in scatter.values))
    return BlendResult(kv=kv, selected=rows - doc_start, deviation=deviation)
