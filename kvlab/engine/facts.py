"""What kvlab knows about a loaded model: its shapes and constants, the K/V byte formula, its sliding windows."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelFacts:
    """Shapes and constants of a loaded model that the cache accounting needs."""

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float | None  # the global layers' base where layer types differ
    context_length: int
    dtype: str
    bytes_per_element: int
    device: str
    layer_windows: tuple[int | None, ...] = ()  # per layer: the trained sliding window, None for full attention

    @property
    def has_rope(self) -> bool:
        return self.rope_theta is not None

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys further back than this are invisible), or None."""
        return self.layer_windows[layer] if self.layer_windows else None

    def kv_bytes(self, tokens: int, layers: int | None = None, heads: int | None = None) -> int:
        """Bytes of K and V, unquantised, for ``tokens`` tokens in ``layers`` layers and ``heads`` KV heads.

        The one K/V byte formula: every memory figure (caches, costs, blocks, benchmarks) is built on it.
        ``layers`` and ``heads`` default to all of the model's.
        """
        layers = self.n_layers if layers is None else layers
        heads = self.n_kv_heads if heads is None else heads
        return 2 * tokens * layers * heads * self.head_dim * self.bytes_per_element  # 2: a key and a value

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return self.kv_bytes(1)

    def as_dict(self) -> dict:
        return {**self.__dict__, "has_rope": self.has_rope, "kv_bytes_per_token": self.kv_bytes_per_token}


@dataclass
class LoadedModel:
    """A model, its tokenizer and its facts. ``lock`` serialises forward passes across sessions."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    facts: ModelFacts
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def model_facts(name: str, model: PreTrainedModel, device: str) -> ModelFacts:
    """The facts of ``model``, read from its config and weights, as it runs on ``device``."""
    cfg = model.config.get_text_config()
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):  # per-layer-type RoPE (Gemma 3)
        rope = rope["full_attention"]
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(cfg, "rope_theta", None)
    has_rotary = hasattr(getattr(model, "model", model), "rotary_emb")
    dtype = next(model.parameters()).dtype
    return ModelFacts(
        name=name,
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        intermediate_size=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
        vocab_size=cfg.vocab_size,
        rope_theta=float(theta) if (theta and has_rotary) else None,
        context_length=getattr(cfg, "max_position_embeddings", 2048),
        dtype=str(dtype).removeprefix("torch."),
        bytes_per_element=torch.empty((), dtype=dtype).element_size(),
        device=device,
        layer_windows=layer_windows(cfg),
    )


def window_summary(facts: ModelFacts) -> str:
    """The model's sliding layers in words: "none", or how many and their windows."""
    windows = [w for w in facts.layer_windows if w is not None]
    if not windows:
        return "none"
    sizes = ", ".join(str(w) for w in sorted(set(windows)))
    return f"{len(windows)} of {facts.n_layers} (window {sizes})"


def layer_windows(cfg) -> tuple[int | None, ...]:
    """Each layer's sliding window as the model's attention receives it (None: full attention).

    Models with ``layer_types`` window only their ``sliding_attention`` layers; Mistral and Phi-3
    pass ``config.sliding_window`` to every layer.
    """
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    return (window,) * cfg.num_hidden_layers
