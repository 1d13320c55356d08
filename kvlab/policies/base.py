"""What a cache policy is: a scoring rule over cached slots, plus its per-layer budgets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from kvlab.engine.attention import SparseReads
from kvlab.errors import KvlabError
from kvlab.engine.quantization import Kivi


@dataclass
class LayerView:
    """Everything a policy may look at for one layer when it chooses which slots to keep.

    Query-head statistics are already aggregated to KV heads (GQA), so every tensor is
    ``[kv_heads, slots]`` over the slots currently in this layer's cache.
    """

    layer: int
    budget: int
    positions: torch.Tensor  # [kv_heads, slots] original token position of each slot
    keys: torch.Tensor  # [kv_heads, slots, head_dim]
    window_mean: dict[int, torch.Tensor]  # n -> [kv_heads, slots] mean attention of the last n queries
    accumulated: torch.Tensor | None  # [kv_heads, slots] attention summed over every query so far
    eligible: torch.Tensor | None = None  # [kv_heads, slots] slots that may be kept (a real key in view); None: all


def param(default: Any, help: str, *, min: float | None = None, max: float | None = None,
          choices: tuple[str, ...] = (), step: float | None = None) -> Any:
    """A policy parameter: its default, what it does and its valid range.

    ``Policy.check`` enforces the range and the widgets and ``--param`` read it, so they cannot disagree.
    """
    return field(default=default, metadata={"help": help, "min": min, "max": max, "choices": choices, "step": step})


@dataclass
class Policy:
    """A KV-cache eviction policy. Subclasses set ``name`` and implement ``scores``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    needs_accumulated: ClassVar[bool] = False
    shared_budget: ClassVar[bool] = False  # one top-k over every head of a layer (heads keep different numbers)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse parameters of the wrong type or outside the range their ``param`` declares."""
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            low, high, choices = meta.get("min"), meta.get("max"), meta.get("choices", ())
            what = f"{self.name}: {f.name} must be"
            if isinstance(f.default, bool):
                require(isinstance(value, bool), f"{what} true or false, not {value!r}")
            elif isinstance(f.default, int):
                require(isinstance(value, int) and not isinstance(value, bool), f"{what} a whole number, not {value!r}")
            elif isinstance(f.default, float):
                require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                        f"{what} a number, not {value!r}")
            if choices:
                require(value in choices, f"{what} one of {', '.join(map(repr, choices))}, not {value!r}")
            if low is not None and high is not None:
                require(low <= value <= high, f"{what} between {low} and {high}, not {value!r}")
            elif low is not None:
                require(value >= low, f"{what} ≥ {low}, not {value!r}")

    def probe_windows(self) -> tuple[int, ...]:
        """Observation windows (numbers of last queries) whose attention this policy reads."""
        return ()

    def min_budget(self) -> int:
        """Smallest budget the policy can honour."""
        return 1

    def validate(self, budget: int, context_length: int | None = None) -> None:
        """Refuse a budget the policy cannot honour (or, given a model's context, cannot hold)."""
        if budget < self.min_budget():
            raise KvlabError(f"{self.name}: budget {budget} is below its minimum of {self.min_budget()} tokens")
        if context_length is not None and budget > context_length:
            raise KvlabError(f"{self.name}: budget {budget} exceeds the model's context of {context_length} tokens")

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        """Retained tokens per layer (per KV head). Uniform unless a policy redistributes."""
        return [budget] * n_layers

    def scores(self, view: LayerView) -> torch.Tensor:
        """[kv_heads, slots]: higher keeps; ``inf`` marks slots that must stay."""
        raise NotImplementedError

    def reads(self, budget: int) -> SparseReads | None:
        """Which keys each decoding query reads at ``budget`` (Quest); None: every key the cache holds."""
        return None

    def quantizer(self) -> Kivi | None:
        """How the cache stores keys and values (KIVI); None: at the model's precision."""
        return None

    def params(self) -> dict:
        return dict(self.__dict__)


def require(ok: bool, message: str) -> None:
    """Raise a user-facing error unless ``ok``."""
    if not ok:
        raise KvlabError(message)


def recent_mask(positions: torch.Tensor, n_recent: int) -> torch.Tensor:
    """[kv_heads, slots] True for each head's ``n_recent`` newest slots (slots are in position order)."""
    slots = positions.shape[-1]
    idx = torch.arange(slots, device=positions.device)
    return (idx >= slots - n_recent).expand_as(positions)


def force(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Scores with the ``keep`` slots raised to infinity."""
    return scores.masked_fill(keep, float("inf"))
