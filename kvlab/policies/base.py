"""What a cache policy is: a scoring rule over cached slots, plus its per-layer budgets."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar

import torch

from kvlab.engine.attention import Probe, SparseReads
from kvlab.engine.facts import LoadedModel
from kvlab.engine.head_patterns import HeadPattern
from kvlab.engine.progress import Progress
from kvlab.engine.quantization import Kivi
from kvlab.engine.reconstruction import RepeatSpec
from kvlab.errors import KvlabError

UNBOUNDED = 1 << 62  # a budget that keeps every token: Full's, Quest's, DuoAttention's retrieval heads'


class Collected(dict):
    """Statistics by the window or position they were collected for: reading one that no probe asked for says how a
    policy asks, rather than a bare ``KeyError``."""

    def __init__(self, values: dict | None = None, name: str = "statistic", asked_by: str = "its probe") -> None:
        super().__init__(values or {})  # defaults: dataclasses.asdict rebuilds a dict field from its items alone
        self.name, self.asked_by = name, asked_by

    def __missing__(self, key: object) -> None:
        raise KeyError(f"LayerView.{self.name}[{key!r}] was not collected (collected: {sorted(self) or 'none'}): a "
                       f"policy asks for it by returning {key!r} from {self.asked_by}, and gets it where the forward "
                       "had queries to collect it from")


@dataclass
class LayerView:
    """Everything a policy may look at for one layer when it chooses which slots to keep.

    Attention statistics are already aggregated to KV heads (GQA), so they are ``[kv_heads, slots]``
    over the slots currently in this layer's cache. Query statistics stay per query head: a policy
    that scores keys with them (Expected Attention) aggregates its own scores, as its authors do.
    """

    layer: int
    budget: int
    positions: torch.Tensor  # [kv_heads, slots] original token position of each slot
    keys: torch.Tensor  # [kv_heads, slots, head_dim]
    window_mean: dict[int, torch.Tensor]  # n -> [kv_heads, slots] mean attention of the last n queries
    accumulated: torch.Tensor | None  # [kv_heads, slots] attention summed over every query so far
    values: torch.Tensor | None = None  # [kv_heads, slots, head_dim]
    # p -> [heads, head_dim] mean and [heads, head_dim, head_dim] covariance of the last forward's pre-RoPE
    # queries at original positions ≥ p (see ``Policy.probe_queries``)
    query_mean: dict[int, torch.Tensor] = field(default_factory=dict)
    query_cov: dict[int, torch.Tensor] = field(default_factory=dict)
    # n -> [head_dim, head_dim]: this layer's RoPE rotation averaged over the next n query positions, in the
    # frame the cached keys are rotated in now; None for a model without RoPE
    future_rotation: Callable[[int], torch.Tensor] | None = None
    future: torch.Tensor | None = None  # [kv_heads, slots] attention the conversation's later queries give (oracle)
    # [kv_heads, slots] the most attention a query of the reconstruction pass gave each slot (KVzip); None until
    # every slot has been scored
    reconstruction: torch.Tensor | None = None
    eligible: torch.Tensor | None = None  # [kv_heads, slots] slots that may be kept (a real key in view); None: all


MAX_WHOLE = 2**31 - 1  # the largest whole-number parameter a policy takes


def param(default: Any, help: str, *, min: float | None = None, max: float | None = None,
          choices: tuple[str, ...] = (), step: float | None = None) -> Any:
    """A policy parameter: its default, what it does and its valid range.

    ``Policy.check`` enforces the range and the widgets and ``--param`` read it, so they cannot disagree.
    """
    return field(default=default, metadata={"help": help, "min": min, "max": max, "choices": choices, "step": step})


@dataclass
class Policy:
    """A KV-cache eviction policy. Subclasses set ``name`` and ``summary`` and implement ``scores``.

    ``label`` (what pages and figures show) defaults to the class name; ``plugin`` is where a plug-in
    policy came from (a file or an entry point), None for kvlab's own.
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    needs_accumulated: ClassVar[bool] = False
    shared_budget: ClassVar[bool] = False  # one top-k over every head of a layer (heads keep different numbers)
    needs_future: ClassVar[bool] = False  # reads what a script's later queries attend to (the oracle)
    model_budget: ClassVar[bool] = False  # one top-k over every head of every layer (layers keep different numbers)
    # reads the scores of a pass that repeats each new token (KVzip): the engine runs it (``repeat_spec``) first
    needs_reconstruction: ClassVar[bool] = False
    plugin: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "label" not in cls.__dict__:
            cls.label = cls.__name__

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse parameters of the wrong type or outside the range their ``param`` declares."""
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            low, high = meta.get("min"), meta.get("max")
            what = f"{self.name}: {f.name} must be"
            if isinstance(f.default, bool):
                require(isinstance(value, bool), f"{what} true or false, not {value!r}")
            elif isinstance(f.default, int):
                require(isinstance(value, int) and not isinstance(value, bool), f"{what} a whole number, not {value!r}")
                # past this, torch cuts a slice's bounds with a warning (and a count of tokens means nothing)
                require(abs(value) <= MAX_WHOLE, f"{what} at most {MAX_WHOLE:,} in size, not {value:,}")
            elif isinstance(f.default, float):
                require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                        f"{what} a number, not {value!r}")
            choices = self.choices(f.name)
            if choices:
                require(value in choices, f"{what} one of {', '.join(map(repr, choices))}, not {value!r}")
            if low is not None and high is not None:
                require(low <= value <= high, f"{what} between {low} and {high}, not {value!r}")
            elif low is not None:
                require(value >= low, f"{what} ≥ {low}, not {value!r}")
            elif high is not None:
                require(value <= high, f"{what} ≤ {high}, not {value!r}")

    @classmethod
    def choices(cls, param_name: str) -> tuple[str, ...]:
        """The values a choice parameter takes: those its ``param`` declares (a wrapper's, KIVI's and AdaKV's, come
        from the registry)."""
        return next(tuple(f.metadata.get("choices", ())) for f in fields(cls) if f.name == param_name)

    def probe_windows(self) -> tuple[int, ...]:
        """Observation windows (numbers of last queries) whose attention this policy reads."""
        return ()

    def probe_queries(self) -> tuple[int, ...]:
        """Original positions from which this policy reads the mean and covariance of a forward's queries."""
        return ()

    def probe(self, *windows: int) -> Probe:
        """What one forward must collect for this policy to evict after it (plus the other ``windows``)."""
        return Probe(windows=tuple(sorted({*windows, *self.probe_windows()})), queries_from=self.probe_queries())

    def min_budget(self) -> int:
        """Smallest budget the policy can honour."""
        return 1

    def validate(self, budget: int, context_length: int | None = None) -> None:
        """Refuse a budget the policy cannot honour (or, given a model's context, cannot hold)."""
        if budget < self.min_budget():
            # the minimum may be the user's own doing (n_sink, page sizes): the parameters changed say so
            changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != f.default]
            why = f" with {', '.join(changed)}" if changed else ""
            raise KvlabError(f"{self.name}: budget {budget} is below its minimum of {self.min_budget()} tokens{why}")
        if context_length is not None and budget > context_length:
            raise KvlabError(f"{self.name}: budget {budget} exceeds the model's context of {context_length} tokens")

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        """Retained tokens per layer (per KV head). Uniform unless a policy redistributes."""
        return [budget] * n_layers

    def head_budgets(self, layer: int, budget: int, kv_heads: int) -> list[int]:
        """Retained tokens per KV head of ``layer`` at its layer budget ``budget`` (not for a ``shared_budget``
        policy). Each head keeps the layer budget unless a policy gives heads their own (DuoAttention)."""
        return [budget] * kv_heads

    def keeps_growing(self) -> bool:
        """Whether some of its cache grows with the conversation whatever the budget (Full, Quest, DuoAttention's
        retrieval heads): no budget bounds the bytes it holds, they are measured."""
        return not self.evicts or min(self.layer_budgets(1, 1)) >= UNBOUNDED

    def budget_free(self) -> bool:
        """Whether no budget changes what it keeps or what a query reads (Full; KIVI on Full; DuoAttention, whose
        heads keep sizes of their own), so that its results are the same at every budget."""
        return not self.evicts and self.reads(1) is None

    def prepare(self, lm: LoadedModel, progress: Progress | None = None) -> None:
        """Look at the loaded model once, before its first turn (DuoAttention finds its head pattern on it);
        ``progress`` follows what takes long."""

    def learned_heads(self) -> tuple[HeadPattern, float] | None:
        """The head pattern ``prepare`` found and the share of streaming heads it is split at (DuoAttention);
        None for a policy that learns none."""
        return None

    def scores(self, view: LayerView) -> torch.Tensor:
        """[kv_heads, slots]: higher keeps; ``inf`` marks slots that must stay."""
        raise NotImplementedError

    def reads(self, budget: int) -> SparseReads | None:
        """Which keys each decoding query reads at ``budget`` (Quest); None: every key the cache holds."""
        return None

    def repeat_spec(self) -> RepeatSpec:
        """How the reconstruction pass runs for a policy that ``needs_reconstruction`` (KVzip)."""
        return RepeatSpec()

    def quantizer(self) -> Kivi | None:
        """How the cache stores keys and values (KIVI); None: at the model's precision."""
        return None

    def params(self) -> dict:
        """Its parameters (what a model taught it in ``prepare`` is not one)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Wrapper(Policy):
    """A policy that runs another's scoring machinery and changes one thing about it (AdaKV how budgets are spent,
    KIVI how the cache is stored): what the wrapped policy reads, its minimum, its checks and its per-layer budgets
    are the wrapper's. The policies it may wrap are looked up in ``registry`` when asked, plug-ins included."""

    # every registered policy by name: set by kvlab.policies, whose registry imports the wrappers
    registry: ClassVar[Mapping[str, type[Policy]]] = {}

    def wrapped(self) -> Policy:
        """The policy it wraps, at that policy's defaults."""
        raise NotImplementedError

    @property
    def needs_accumulated(self) -> bool:  # type: ignore[override]
        return self.wrapped().needs_accumulated

    @property
    def needs_reconstruction(self) -> bool:  # type: ignore[override]
        return self.wrapped().needs_reconstruction

    def probe_windows(self) -> tuple[int, ...]:
        return self.wrapped().probe_windows()

    def budget_free(self) -> bool:
        return self.wrapped().budget_free()

    def probe_queries(self) -> tuple[int, ...]:
        return self.wrapped().probe_queries()

    def repeat_spec(self) -> RepeatSpec:
        return self.wrapped().repeat_spec()

    def min_budget(self) -> int:
        return self.wrapped().min_budget()

    def validate(self, budget: int, context_length: int | None = None) -> None:
        self.wrapped().validate(budget, context_length)

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        return self.wrapped().layer_budgets(budget, n_layers)


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
