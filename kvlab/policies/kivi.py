"""KIVI (Liu et al., 2024): the cache stored at 2/4/8 bits, composed with any eviction policy.

Reference: jy-yuan/KIVI ``models/llama_kivi.py``; the quantization itself is ``kvlab/engine/quantization.py``.
``evict_with`` names the eviction policy it runs with (its paper defaults): ``full`` keeps
everything at low precision, ``streamingllm`` is "StreamingLLM at ``bits`` bits". ``bits=16``
turns quantization off, leaving exactly the eviction policy. The choices are every registered
policy that stores at the model's precision, reads every key and runs no pass of its own before evicting
(``composable``: not KVzip), plug-ins included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.engine.facts import LoadedModel
from kvlab.engine.head_patterns import HeadPattern
from kvlab.engine.progress import Progress
from kvlab.engine.quantization import FULL_PRECISION, Kivi
from kvlab.policies.base import LayerView, Policy, Wrapper, param, require


def composable(policy: type[Policy]) -> bool:
    """Whether KIVI can run over ``policy``: it stores at the model's precision and reads every key, and needs no
    pass of its own before evicting (KVzip's reconstruction, whose one budget over every layer also has no
    per-layer worst case for a byte budget of quantized layers). KIVI runs it at its defaults, so a flag that
    depends on the parameters (AdaKV's, from its scorer) is read off the default instance."""
    if policy.quantizer is not Policy.quantizer or policy.reads is not Policy.reads:
        return False  # KIVI itself among them: asked first, so its own default instance is never built here
    repeats = policy.needs_reconstruction
    if isinstance(repeats, property):
        repeats = policy().needs_reconstruction
    return not repeats


@dataclass
class KiviPolicy(Wrapper):
    name, label = "kivi", "KIVI"
    summary = "keys per channel and values per token at low bits, newest tokens in full precision"
    bits: int = param(2, "bits per stored key and value: 2, 4 or 8 (16: not quantized)")  # check() says which
    group_size: int = param(32, "tokens per key group (per channel), channels per value group (per token)", min=1)
    residual: int = param(128, "newest tokens kept in full precision (a multiple of the group size)", min=0)
    evict_with: str = param("full", "the eviction policy it composes with, at that policy's defaults")

    @classmethod
    def choices(cls, param_name: str) -> tuple[str, ...]:
        if param_name == "evict_with":
            return tuple(name for name, policy in cls.registry.items() if composable(policy))
        return super().choices(param_name)

    def check(self) -> None:
        super().check()
        require(self.bits in (2, 4, 8, FULL_PRECISION), f"kivi: bits must be 2, 4, 8 or 16, not {self.bits!r}")
        require(self.residual % self.group_size == 0,
                f"kivi: residual {self.residual} must be a multiple of the group size {self.group_size}")

    def wrapped(self) -> Policy:
        """The eviction policy it composes with, at its defaults."""
        return self.registry[self.evict_with]()

    @property
    def evicts(self) -> bool:  # type: ignore[override]
        return self.wrapped().evicts

    @property
    def shared_budget(self) -> bool:  # type: ignore[override]
        return self.wrapped().shared_budget  # AdaKV under KIVI still spends one budget over a layer's heads

    def quantizer(self) -> Kivi:
        return Kivi(self.bits, self.group_size, self.residual)

    def head_budgets(self, layer: int, budget: int, kv_heads: int) -> list[int]:
        return self._bound_evictor().head_budgets(layer, budget, kv_heads)

    def prepare(self, lm: LoadedModel, progress: Progress | None = None) -> None:
        self._bound_evictor().prepare(lm, progress)

    def learned_heads(self) -> tuple[HeadPattern, float] | None:
        return self._bound_evictor().learned_heads()

    def _bound_evictor(self) -> Policy:
        """The eviction policy, one instance that keeps what ``prepare`` taught it (DuoAttention's pattern)."""
        if getattr(self, "_evictor", None) is None or self._evictor.name != self.evict_with:
            self._evictor = self.wrapped()
        return self._evictor

    def scores(self, view: LayerView) -> torch.Tensor:
        return self._bound_evictor().scores(view)
