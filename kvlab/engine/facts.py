"""What kvlab knows about a loaded model: its shapes and constants, the K/V byte formula, its sliding windows,
soft-cap and RoPE layout."""

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
    attn_softcap: float | None = None  # Gemma 2's cap: scores become tanh(s / cap) · cap; None where there is none
    rotary_fraction: float = 1.0  # share of head_dim that RoPE turns (Phi-3's partial rotary factor)
    rope_bases: tuple[tuple[str, float], ...] = ()  # (layer type, θ) where layer types differ (Gemma 3), else ()
    rope_scaling: str | None = None  # RoPE's scaling type where it is not plain RoPE (llama3, yarn, linear…)

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
    rope, per_type = rope_parameters(cfg)
    theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", None)
    has_rotary = bool(theta) and hasattr(getattr(model, "model", model), "rotary_emb")
    scaling = sorted({str(p.get("rope_type")) for p in [rope, *per_type.values()]} - {"None", "default"})
    softcap = getattr(cfg, "attn_logit_softcapping", None)
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
        rope_theta=float(theta) if has_rotary else None,
        context_length=getattr(cfg, "max_position_embeddings", 2048),
        dtype=str(dtype).removeprefix("torch."),
        bytes_per_element=torch.empty((), dtype=dtype).element_size(),
        device=device,
        layer_windows=layer_windows(cfg),
        attn_softcap=float(softcap) if softcap else None,
        rotary_fraction=float(rope.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) or 1)
        if has_rotary else 1.0,
        rope_bases=tuple(sorted((kind, float(p["rope_theta"])) for kind, p in per_type.items() if "rope_theta" in p))
        if has_rotary else (),
        rope_scaling=", ".join(scaling) or None if has_rotary else None,
    )


def rope_parameters(cfg) -> tuple[dict, dict[str, dict]]:
    """The config's RoPE parameters: those of the full-attention layers, and one set per layer type where the
    model keeps them apart (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``), else {}."""
    rope = getattr(cfg, "rope_parameters", None)
    if not isinstance(rope, dict):
        return {}, {}
    per_type = {kind: p for kind, p in rope.items() if isinstance(p, dict)}
    if per_type:
        return per_type.get("full_attention") or next(iter(per_type.values())), per_type
    return rope, {}


def window_summary(facts: ModelFacts) -> str:
    """The model's sliding layers in words: "none", or how many and their windows."""
    windows = [w for w in facts.layer_windows if w is not None]
    if not windows:
        return "none"
    sizes = ", ".join(str(w) for w in sorted(set(windows)))
    return f"{len(windows)} of {facts.n_layers} (window {sizes})"


def softcap_summary(facts: ModelFacts) -> str:
    """The attention soft-cap in words: "none", or the cap."""
    return "none" if facts.attn_softcap is None else f"tanh cap {facts.attn_softcap:g} on attention scores"


def rope_summary(facts: ModelFacts) -> str:
    """The RoPE layout in words: how much of each head turns, the bases per layer type, any scaling."""
    if not facts.has_rope:
        return "no RoPE"
    rotary = round(facts.head_dim * facts.rotary_fraction)
    parts = [f"partial: {rotary} of {facts.head_dim} dims turn" if rotary < facts.head_dim
             else f"all {facts.head_dim} dims turn"]
    if facts.rope_bases:
        parts.append("θ " + ", ".join(f"{base:,.0f} {kind.removesuffix('_attention')}"
                                      for kind, base in facts.rope_bases))
    if facts.rope_scaling:
        parts.append(f"{facts.rope_scaling} scaling")
    return "; ".join(parts)


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
