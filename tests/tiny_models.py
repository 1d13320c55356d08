"""Tiny random models of every architecture kvlab accepts, each with an eager twin.

The twin has the same weights and runs transformers' own eager attention, so a test holds
kvlab's attention against the model's definition rather than against kvlab itself. Windows are
8 tokens so a 40-token text crosses them several times.
"""

from __future__ import annotations

import threading

import torch
from transformers import (
    Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
    MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM, PretrainedConfig, PreTrainedModel,
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

from kvlab.engine.attention import ATTENTION_NAME, register_attention
from kvlab.engine.facts import LoadedModel, model_facts

WINDOW = 8
VOCAB = 128
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_hidden_layers=3)),
    "qwen2-window": (Qwen2Config, Qwen2ForCausalLM,
                     dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_hidden_layers=3, head_dim=16)),
    "mistral-window": (MistralConfig, MistralForCausalLM, dict(num_hidden_layers=3, sliding_window=WINDOW)),
    "phi3-partial-rotary": (Phi3Config, Phi3ForCausalLM,
                            dict(num_hidden_layers=3, partial_rotary_factor=0.5, sliding_window=WINDOW)),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM,  # a low cap so random weights' scores reach it
               dict(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=0.05,
                    initializer_range=0.2)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM,
               dict(num_hidden_layers=6, head_dim=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
                    + ["full_attention"])),
}


def build(arch: str, seed: int = 0, layers: int | None = None) -> tuple[LoadedModel, PreTrainedModel]:
    """(kvlab's LoadedModel, the eager twin) of a tiny random ``arch`` model in float32 on the CPU."""
    register_attention()
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    if layers is not None:
        extra = {**extra, "num_hidden_layers": layers}
    torch.manual_seed(seed)
    reference = model_cls(config_cls(**_SHAPE, **extra, attn_implementation="eager")).eval()
    ours = model_cls(config_cls(**_SHAPE, **extra, attn_implementation=ATTENTION_NAME)).eval()
    ours.load_state_dict(reference.state_dict())
    lm = LoadedModel(model=ours, tokenizer=None, facts=model_facts(f"tiny-{arch}", ours, "cpu"), lock=threading.RLock())
    return lm, reference


def reference_mask(lm: LoadedModel, n: int, hidden: set[int] | list[set[int]], after: int
                   ) -> dict[str, torch.Tensor] | torch.Tensor:
    """The model's own additive mask for ``n`` tokens where queries from ``after`` on cannot see keys ``hidden``.

    Causal, with each layer type's window; a dict per layer type where the model has layer types.
    ``hidden`` may be one set per KV head: then the mask is [1, heads, n, n], each query head hiding
    its KV head's keys.
    """
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    causal = k <= q
    per_head = [hidden] if isinstance(hidden, set) else hidden
    gone = torch.zeros(len(per_head), n, n, dtype=torch.bool)  # [1 or kv_heads, n, n]
    for head, keys in enumerate(per_head):
        if keys:
            gone[head, after:, sorted(keys)] = True
    gone = gone.repeat_interleave(lm.facts.n_heads // len(per_head), dim=0) if len(per_head) > 1 else gone

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None]

    window = lm.facts.window
    full = additive(causal & ~gone)
    sliding = next((w for w in lm.facts.layer_windows if w is not None), None)
    windowed = additive(causal & ~gone & (q - k < sliding)) if sliding is not None else full
    types = getattr(lm.model.config, "layer_types", None)
    if types and getattr(lm.model.config, "model_type", "") != "mistral":
        return {"full_attention": full, "sliding_attention": windowed}
    return windowed if window(0) is not None else full
