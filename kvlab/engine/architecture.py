"""Which architectures kvlab refuses at load, because it could not compute them exactly.

kvlab runs every layer's attention through its own function and keeps one cache of per-token
keys and values per layer, whose slots it evicts, re-rotates and batches. That is exact for
decoder-only softmax attention — full or sliding-window layers, rotary embeddings in any layout
transformers uses, soft-capping, q/k norms. Anything else would give a silently different
result, so ``refusal`` names it in one sentence instead. Absolute position embeddings added to
the input (GPT-2, OPT) are not refused: Full and eviction with original positions stay exact,
and without rotary embeddings the re-rotated mode and the RoPE pages say why they are off.
"""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
_NO_CACHE_LAYERS = {"mlp", "moe"}  # feed-forward-only blocks (Nemotron-H): nothing to cache
_ALIBI_TYPES = {"bloom"}  # ALiBi by design; MPT, Falcon and Jais say so in their configs
# state-space / recurrent / linear-attention models whose configs need not list layer_types
_RECURRENT_TYPES = {
    "bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear", "lfm2",
    "lfm2_moe", "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid", "qwen3_5", "qwen3_5_text",
    "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "recurrent_gemma", "rwkv", "xlstm", "zamba", "zamba2",
}
_SINK_LOGIT_TYPES = {"gpt_oss"}  # a learned per-head logit joins the softmax: kvlab's attention has none


def causal_lm_class(config: PretrainedConfig) -> type | None:
    """The class AutoModelForCausalLM builds for ``config``; None when it is remote code or unknown."""
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def _alibi(cfg: PretrainedConfig) -> bool:
    attn = getattr(cfg, "attn_config", None)  # MPT keeps its flag in a sub-config (a dict when from JSON)
    nested = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    return bool(
        cfg.model_type in _ALIBI_TYPES or getattr(cfg, "alibi", False) or getattr(cfg, "use_alibi", False)
        or nested or getattr(cfg, "position_embedding_type", None) == "alibi"
    )


def refusal(config: PretrainedConfig, model_class: type | None = None) -> str | None:
    """Why kvlab cannot run this model exactly, as one clause naming the feature; None if it can.

    ``model_class`` (the class that will be built, when known) is checked for going through
    transformers' attention interface, the only way kvlab's attention can replace the model's.
    """
    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        return f"{kind} is an encoder–decoder model, and kvlab caches only a decoder-only model's keys and values"
    cfg = config.get_text_config()
    if _alibi(cfg):
        return f"{kind} uses ALiBi position biases, which kvlab's attention does not add"
    if getattr(cfg, "kv_lora_rank", None) or getattr(cfg, "q_lora_rank", None):
        return (f"{kind} uses multi-head latent attention (MLA), whose compressed cache has no per-head keys "
                "and values for kvlab to keep or evict")
    others = sorted(set(getattr(cfg, "layer_types", None) or ()) - _ATTENTION_LAYERS - _NO_CACHE_LAYERS)
    if kind in _RECURRENT_TYPES or any("attention" not in t or t == "linear_attention" for t in others):
        listed = f" ({', '.join(others)})" if others else ""
        return (f"{kind} has linear-attention, state-space or recurrent layers{listed}, which keep a running "
                "state instead of the per-token keys and values kvlab keeps and evicts")
    if others:
        return f"{kind} has {', '.join(others)} layers, which are neither full nor sliding-window attention"
    if kind in _SINK_LOGIT_TYPES:
        return f"{kind} adds learned attention-sink logits to the softmax, which kvlab's attention does not"
    if getattr(cfg, "use_bidirectional_attention", False):
        return f"{kind} is configured for bidirectional attention, and kvlab's attention is causal"
    if getattr(cfg, "num_kv_shared_layers", 0):
        return f"{kind} shares keys and values across layers, and kvlab keeps a cache of its own for every layer"
    if model_class is not None and not model_class.is_backend_compatible():
        return (f"{model_class.__name__}'s attention does not go through transformers' attention interface, "
                "so kvlab's exact attention cannot replace it")
    return None
