"""Tiny random models of every architecture kvlab accepts, built in code: no download, seconds on a CPU.

The tests hold kvlab's mechanics against transformers' own eager attention on them (``tiny_model`` returns
an eager twin with the same weights), and ``kvlab check-policy`` runs a policy's properties on them. Windows
are 8 tokens so a 40-token text crosses them several times. ``byte_tokenizer`` gives them a tokenizer
(one token per UTF-8 byte, no chat template) so that a chat can run on them without the embedded model.
"""

from __future__ import annotations

import threading

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvlab.engine.attention import ATTENTION_NAME, register_attention
from kvlab.engine.facts import LoadedModel, model_facts
from kvlab.engine.linear import onednn_linears

WINDOW = 8
VOCAB = 128
CONTEXT = 512
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

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


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer with one token per UTF-8 byte (ids 3…258) after <pad>, <bos> and <eos> (0, 1, 2)."""
    specials = ["<pad>", "<bos>", "<eos>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def tiny_model(arch: str, seed: int = 0, layers: int | None = None, context: int = CONTEXT,
               tokenizer: PreTrainedTokenizerFast | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, **config) -> tuple[LoadedModel, PreTrainedModel]:
    """(kvlab's LoadedModel, the eager twin) of a tiny random ``arch`` model, both on ``device`` in ``dtype``
    (the same weights: drawn in float32, then cast).

    With a ``tokenizer`` the vocabulary is the tokenizer's; without one it is ``VOCAB`` ids and the model
    takes token ids only. ``config`` overrides the shape and the architecture's settings (``hidden_size=128``:
    head_dim 32; ``sliding_window=32``).
    """
    register_attention()
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    if layers is not None:  # the first ``layers`` layers, each of its type where the model names them
        extra = {**extra, "num_hidden_layers": layers}
        if "layer_types" in extra:
            extra["layer_types"] = extra["layer_types"][:layers]
    shape = {**_SHAPE, "vocab_size": len(tokenizer) if tokenizer is not None else VOCAB,
             "max_position_embeddings": context, **extra, **config}
    torch.manual_seed(seed)
    reference = model_cls(config_cls(**shape, attn_implementation="eager")).eval()
    ours = model_cls(config_cls(**shape, attn_implementation=ATTENTION_NAME)).eval()
    ours.load_state_dict(reference.state_dict())
    reference.to(device=device, dtype=dtype)
    ours.to(device=device, dtype=dtype)
    onednn_linears(ours)
    lm = LoadedModel(model=ours, tokenizer=tokenizer, facts=model_facts(f"tiny-{arch}", ours, device),
                     lock=threading.RLock())
    return lm, reference
