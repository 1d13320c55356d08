"""What kvlab cannot compute exactly is refused at load, in one sentence naming the feature.

Configs are built in memory from transformers' config classes; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers as T
from transformers import LlamaConfig, PretrainedConfig

from kvlab.engine.architecture import causal_lm_class, refusal
from kvlab.engine.conversion import ModelLoadError
from kvlab.engine.model import load_model

REFUSED = [
    (T.BloomConfig(), "ALiBi"),
    (T.MptConfig(), "ALiBi"),  # alibi in its attn_config
    (T.FalconConfig(alibi=True), "ALiBi"),
    (T.DeepseekV3Config(), "multi-head latent attention (MLA)"),
    (T.DeepseekV2Config(q_lora_rank=None), "multi-head latent attention (MLA)"),  # V2-Lite: kv_lora_rank only
    (T.MambaConfig(), "state-space or recurrent layers"),
    (T.RwkvConfig(), "state-space or recurrent layers"),  # no layer_types: known by its model type
    (T.Qwen3NextConfig(), "linear-attention, state-space or recurrent layers (linear_attention)"),
    (T.JambaConfig(), "linear-attention"),
    (T.FalconH1Config(), "recurrent layers (hybrid)"),
    (T.T5Config(), "encoder–decoder"),
    (T.BartConfig(), "encoder–decoder"),
    (T.Llama4TextConfig(), "chunked_attention layers, which are neither full nor sliding-window attention"),
    (T.GptOssConfig(), "attention-sink logits"),
    (T.Gemma3TextConfig(use_bidirectional_attention=True), "bidirectional attention"),
    (T.Gemma3nTextConfig(), "shares keys and values across layers"),
    (T.FalconConfig(), "FalconForCausalLM's attention does not go through transformers' attention interface"),
    (T.GPTNeoConfig(), "attention interface"),
]

ACCEPTED = [
    T.LlamaConfig(), T.Qwen2Config(), T.Qwen3Config(), T.MistralConfig(), T.Phi3Config(partial_rotary_factor=0.5),
    T.Gemma2Config(), T.Gemma3TextConfig(), T.Gemma3Config(), T.Cohere2Config(),
    T.GPT2Config(),  # absolute positions: Full and original-position eviction stay exact
]


@pytest.mark.parametrize(("config", "feature"), REFUSED, ids=lambda v: getattr(v, "model_type", ""))
def test_each_refusal_names_its_feature_in_one_sentence(config: PretrainedConfig, feature: str) -> None:
    reason = refusal(config, causal_lm_class(config))
    assert reason is not None and feature in reason
    assert "." not in reason and "\n" not in reason  # one clause: load_model makes it the sentence


@pytest.mark.parametrize("config", ACCEPTED, ids=lambda c: c.model_type)
def test_exact_architectures_are_accepted(config: PretrainedConfig) -> None:
    assert refusal(config, causal_lm_class(config)) is None


def test_remote_code_outside_the_attention_interface_is_refused() -> None:
    class HandWritten(T.LlamaForCausalLM):
        _supports_attention_backend = False

    assert refusal(LlamaConfig(), HandWritten) == (
        "HandWritten's attention does not go through transformers' attention interface, "
        "so kvlab's exact attention cannot replace it"
    )


def test_load_model_refuses_before_reading_weights(tmp_path: Path) -> None:
    T.BloomConfig(n_layer=2, hidden_size=32, n_head=2).save_pretrained(tmp_path)  # a folder with no weights
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path), device="cpu")
    assert str(err.value) == (
        f"kvlab cannot run {str(tmp_path)!r} exactly: bloom uses ALiBi position biases, "
        "which kvlab's attention does not add."
    )
