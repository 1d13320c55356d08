"""DuoAttention (Xiao et al., 2024): retrieval heads keep every key, streaming heads sinks and recent keys.

Reference: mit-han-lab/duo-attention ``duo_attn/patch/llama.py`` (``llama_duo_attention_forward_one_way_reordered``:
the prefill attends fully, then a streaming head's cache is cut to its first ``sink_size`` and last
``recent_size`` keys while a retrieval head's keeps growing) and ``duo_attn/utils.py`` (``sparsify_attention_heads``);
NVIDIA/kvpress ``kvpress/presses/duo_attention_press.py`` (``DuoAttentionPress``: the ``round(heads ×
head_compression_ratio)`` heads of lowest score are streaming). Which KV heads are which comes from the head
pattern found on the loaded model (``kvlab.engine.head_patterns``): by default the authors' gate
optimisation, or kvpress's on-the-fly estimate.

Defaults: sink 128 and recent 256 (the authors' training script and published patterns, and kvpress's
on-the-fly values); ``head_compression_ratio`` 0.5, the paper's share of streaming heads for GQA models
(kvpress defaults to 0.0, every head a retrieval head). The session's budget bounds nothing here, as in
kvpress (its compression ratio follows from the split and cannot be set): retrieval heads hold the whole
conversation, so what the cache holds is measured per head, never estimated. Unlike kvpress, which masks a
streaming head's keys inside attention, kvlab really drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.engine.facts import LoadedModel
from kvlab.engine.head_patterns import METHODS, HeadPattern, head_pattern
from kvlab.engine.progress import Progress
from kvlab.errors import KvlabError
from kvlab.policies.base import UNBOUNDED, LayerView, Policy, param
from kvlab.policies.streamingllm import StreamingLLM


@dataclass
class DuoAttention(Policy):
    name, label = "duoattention", "DuoAttention"
    summary = "retrieval heads keep every key, streaming heads sinks + recent; head split found on the model"
    sink: int = param(128, "first tokens a streaming head keeps (attention sinks)", min=0)
    recent: int = param(256, "newest tokens a streaming head keeps", min=1)
    head_compression_ratio: float = param(0.5, "share of KV heads that are streaming heads (lowest gates)",
                                          min=0.0, max=1.0, step=0.05)
    pattern: str = param("trained", "how head patterns are found: the authors' gate optimisation (trained) or "
                                    "kvpress's estimate from mean queries and keys (on_the_fly)", choices=METHODS)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.found: HeadPattern | None = None

    def prepare(self, lm: LoadedModel, progress: Progress | None = None) -> None:
        if self.found is None or self.found.gates.shape != (lm.facts.n_layers, lm.facts.n_kv_heads):
            self.found = head_pattern(lm, self.pattern, progress=progress)

    def learned_heads(self) -> tuple[HeadPattern, float] | None:
        return None if self.found is None else (self.found, self.head_compression_ratio)

    def retrieval(self) -> torch.Tensor:
        """[layers, kv_heads] bool: the retrieval heads of the model ``prepare`` was given."""
        if self.found is None:
            raise KvlabError("duoattention: no head pattern yet; it is found on the model when the session starts")
        return self.found.retrieval(self.head_compression_ratio)

    def validate(self, budget: int, context_length: int | None = None) -> None:
        """The budget bounds nothing (retrieval heads keep every key); the streaming window must fit the context."""
        if context_length is not None and self.sink + self.recent > context_length:
            raise KvlabError(f"duoattention: sink {self.sink} + recent {self.recent} exceed the model's context "
                             f"of {context_length} tokens")

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        return [UNBOUNDED] * n_layers

    def budget_free(self) -> bool:
        return True  # streaming heads keep sink + recent, retrieval heads every key, whatever the budget

    def head_budgets(self, layer: int, budget: int, kv_heads: int) -> list[int]:
        return [UNBOUNDED if retrieval else self.sink + self.recent for retrieval in self.retrieval()[layer].tolist()]

    def scores(self, view: LayerView) -> torch.Tensor:
        # StreamingLLM's scores: a streaming head's budget of sink + recent keeps the forced sinks and its newest
        # keys; a retrieval head's keeps everything, whatever it scores
        return StreamingLLM(n_sink=self.sink).scores(view)
