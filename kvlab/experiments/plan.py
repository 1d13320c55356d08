"""The arena's plan: the grid's settings, its cells, and where it runs (a model source and a Ray plan).

Nothing here imports Ray, so pages and the CLI can build a plan for Ray workers without loading Ray;
``kvlab.experiments.workers`` runs it there and ``kvlab.experiments.runner`` in this process.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Protocol

from kvlab.engine.facts import LoadedModel, ModelFacts
from kvlab.engine.model import load_model
from kvlab.errors import KvlabError
from kvlab.lists import split_items
from kvlab.policies import DEFAULT_COMPARISON
from kvlab.workloads.chat.budgets import BUDGET_UNITS, UNCONVERTED, budget_free, mib_settings
from kvlab.workloads.chat.conversation import Conversation, check_max_turns, first_turns
from kvlab.workloads.chat.settings import ChatSettings

MAX_WORKERS = 64
MAX_BUDGETS = 16
# multi-turn: answers stay and caches carry over (SCBench multi-turn). single-shot: turn 1 is the shared
# context; every later question is asked against the caches as turn 1 left them, its answer not kept
# (SCBench multi-request, kvpress). Turn 1 is the same in both modes.
MODES = ("multi-turn", "single-shot")


@dataclass(frozen=True)
class ArenaSettings:
    """The grid: which policies at which budgets, and how much of each workload to run."""

    policies: tuple[str, ...] = DEFAULT_COMPARISON
    budgets: tuple[float, ...] = (64, 128, 256, 512)  # in ``budget_unit``s
    max_new_tokens: int = 8
    max_turns: int | None = None
    block_size: int = 16
    position_mode: str = "original"
    params: dict[str, dict] = field(default_factory=dict)
    modes: tuple[str, ...] = ("multi-turn",)
    budget_unit: str = "tokens"

    def __post_init__(self) -> None:
        if self.budget_unit not in BUDGET_UNITS:
            raise KvlabError(f"the budget unit must be one of {', '.join(BUDGET_UNITS)}, not {self.budget_unit!r}")
        by_bytes, percent = self.budget_unit == "mib", self.budget_unit == "percent"
        if isinstance(self.modes, str) or not self.modes or any(m not in MODES for m in self.modes):
            given = self.modes if isinstance(self.modes, str) else ", ".join(map(str, self.modes)) or "none"
            raise KvlabError(f"modes must be one or both of {', '.join(MODES)}, not {given}")
        object.__setattr__(self, "modes", tuple(m for m in MODES if m in self.modes))
        numbers = (int, float) if by_bytes or percent else int
        if any(not isinstance(b, numbers) or isinstance(b, bool) or not math.isfinite(b) for b in self.budgets):
            raise KvlabError(f"budgets must be {BUDGET_UNITS[self.budget_unit].numbers}, "
                             f"not {', '.join(map(str, self.budgets))}")
        if twice := sorted({b for b in self.budgets if self.budgets.count(b) > 1}):
            raise KvlabError(f"give each budget once: {', '.join(f'{b:g}' for b in twice)} "
                             f"{'is' if len(twice) == 1 else 'are'} given more than once")
        budgets = tuple(sorted(self.budgets))
        if not budgets:
            raise KvlabError("give at least one budget")
        if by_bytes and budgets[0] <= 0:
            raise KvlabError(f"budgets must be more than 0 MiB, not {budgets[0]:g}")
        if percent and (outside := [b for b in budgets if not 0 < b <= 100]):
            raise KvlabError(f"budgets in % of Full's K/V bytes must be more than 0 and at most 100, "
                             f"not {', '.join(f'{b:g}' for b in outside)}")
        if not by_bytes and not percent and budgets[0] < 1:
            raise KvlabError(f"budgets must be at least 1 token, not {budgets[0]}")
        if len(budgets) > MAX_BUDGETS:
            raise KvlabError(f"{len(budgets)} budgets given; at most {MAX_BUDGETS} per run")
        check_max_turns(self.max_turns)
        object.__setattr__(self, "budgets", budgets)
        # ChatSettings refuses unknown policies, bad parameters and budgets below a policy's minimum,
        # and fills in every parameter each policy runs with; byte budgets become tokens only on a model
        # (check_grid), so here any policy's minimum passes, and a % budget keeps at least each policy's minimum
        first = self._chat_settings(UNCONVERTED if by_bytes else budgets[0])
        object.__setattr__(self, "policies", first.policies)
        object.__setattr__(self, "params", first.params)
        if self.budget_unit == "tokens":
            for b in budgets[1:]:
                self._chat_settings(b)

    def _chat_settings(self, budget: float) -> ChatSettings:
        percent = self.budget_unit == "percent"
        return ChatSettings(policies=tuple(self.policies), budget=128 if percent else int(budget),
                            block_size=self.block_size, position_mode=self.position_mode, params=self.params,
                            max_new_tokens=self.max_new_tokens, budget_percent=budget if percent else None)

    def chat_settings(self, budget: float, facts: ModelFacts | None = None) -> ChatSettings:
        """The engine's settings for one budget of the grid; a byte budget needs the model's ``facts``
        and refuses a policy whose minimum budget it cannot hold (a % budget is converted turn by turn)."""
        if self.budget_unit != "mib":
            return self._chat_settings(budget)
        if facts is None:
            raise KvlabError("a budget in MiB becomes tokens only on a loaded model")
        return mib_settings(self._chat_settings(UNCONVERTED), budget, facts)

    def budget_blind(self) -> list[str]:
        """The policies besides Full that no budget reaches (``Policy.budget_free``: kivi on full, duoattention),
        so their rows are the same at every budget of the grid."""
        return budget_free(self.policies, self.params)

    def budget_blind_note(self) -> str | None:
        """``budget_blind`` in a sentence for pages, reports and the CLI; None when there is none or one budget."""
        blind = self.budget_blind()
        if not blind or len(self.budgets) < 2:
            return None
        named = [f"{n} (evict_with={self.params[n]['evict_with']})" if "evict_with" in self.params[n] else n
                 for n in blind]
        one = len(blind) == 1
        return (f"{', '.join(named)}: no budget changes what {'it keeps' if one else 'they keep'} or "
                f"read{'s' * one}, so {'its' if one else 'their'} rows are the same at every budget.")

    @property
    def budget_label(self) -> str:
        """What a budget of this grid counts, in words."""
        return BUDGET_UNITS[self.budget_unit].summary

    @property
    def unit_name(self) -> str:
        """The budget's unit, short (an axis title's)."""
        return BUDGET_UNITS[self.budget_unit].label

    def questions_of(self, conv: Conversation) -> int:
        """How many of a workload's turns the grid runs."""
        return len(first_turns(conv, self.max_turns).turns)

    def turns_of(self, conv: Conversation) -> int:
        """How many turns one cell of this workload runs: turn 1 once, each later turn once per mode."""
        n = self.questions_of(conv)
        return n + (len(self.modes) - 1) * (n - 1)

    def to_dict(self) -> dict:
        return asdict(self) | {"policies": list(self.policies), "budgets": list(self.budgets),
                               "modes": list(self.modes)}


def parse_budgets(text: str, unit: str = "tokens") -> tuple[float, ...]:
    """'64,128,256' → (64, 128, 256) (in MiB: '2.5,5' → (2.5, 5.0); in %: '12.5,25' → (12.5, 25.0)); anything else
    is a user error."""
    parts = [p.removesuffix("%").strip() for p in split_items(text, "budgets")]
    try:
        budgets = tuple(float(p) if unit in ("mib", "percent") else int(p) for p in parts)
        if unit == "percent":  # 25, not 25.0, in labels and rows
            budgets = tuple(int(b) if b.is_integer() else b for b in budgets)
    except ValueError:
        said = BUDGET_UNITS[unit]
        if len(parts) == 1:  # one budget given (the chat takes one): said of one
            raise KvlabError(f"the budget must be {said.one}, not {text!r}") from None
        raise KvlabError(f"budgets must be comma-separated {said.numbers} like {said.example}, not {text!r}") from None
    if not budgets:
        raise KvlabError(f"give at least one budget, e.g. {BUDGET_UNITS[unit].example}")
    return budgets


def grid_size(conversations: list[Conversation], settings: ArenaSettings) -> int:
    """Turns the whole grid runs (each runs every policy)."""
    return sum(settings.turns_of(c) for c in conversations) * len(settings.budgets)


def cell_plan(conv: Conversation, settings: ArenaSettings) -> list[tuple[int, tuple[str, ...], bool]]:
    """The turns one cell runs, in order: (turn index, the modes its record serves, whether it is kept).

    Turn 1 once for every mode; then each later question once single-shot (not kept), then the conversation
    carries on multi-turn from turn 1's caches.
    """
    later = range(1, settings.questions_of(conv))
    plan = [(0, settings.modes, True)]
    plan += [(i, ("single-shot",), False) for i in later if "single-shot" in settings.modes]
    plan += [(i, ("multi-turn",), True) for i in later if "multi-turn" in settings.modes]
    return plan


def step_label(conv: Conversation, settings: ArenaSettings, step: int) -> str:
    """What the cell's ``step``-th run is, counted as asked for: 'turn 2/2' or, with both modes, 'turn 1/2 (both
    modes)', 'single-shot re-ask 1/1 (turn 2)', 'turn 2/2 (multi-turn)'."""
    n = settings.questions_of(conv)
    i, modes, keep = cell_plan(conv, settings)[step]
    if not keep:
        return f"single-shot re-ask {i}/{n - 1} (turn {i + 1})"
    if len(settings.modes) == 1:
        return f"turn {i + 1}/{n}"
    return f"turn {i + 1}/{n} ({'both modes' if len(modes) > 1 else 'multi-turn'})"


@dataclass(frozen=True)
class Cell:
    """One workload at one budget: a session with every policy side by side, in every mode of the grid."""

    workload: int  # index into the grid's conversations
    budget: int


def grid_cells(conversations: list[Conversation], settings: ArenaSettings) -> list[Cell]:
    """The grid's cells in run order, which is also the order of the result rows."""
    return [Cell(w, b) for w in range(len(conversations)) for b in settings.budgets]


class ModelSource(Protocol):
    """What a worker loads its model from; pickled to every worker."""

    def load(self) -> LoadedModel: ...


@dataclass(frozen=True)
class ModelSpec:
    """A model by name, loaded by each worker with ``load_model`` (the same arguments as in-process)."""

    name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False

    def load(self) -> LoadedModel:
        return load_model(self.name, device=self.device, dtype=self.dtype, trust_remote_code=self.trust_remote_code)


@dataclass(frozen=True)
class RayPlan:
    """Where the grid runs: ``workers`` local Ray workers, or workers on the cluster at ``address``.

    With an address and no worker count, the cluster gets one worker per GPU, or per CPU without GPUs.
    """

    workers: int | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        if self.address is not None:
            object.__setattr__(self, "address", self.address.strip() or None)
        if self.workers is None and self.address is None:
            raise KvlabError("give a number of local workers or a Ray cluster address")
        if self.workers is not None and not 1 <= self.workers <= MAX_WORKERS:
            raise KvlabError(f"workers must be between 1 and {MAX_WORKERS}, not {self.workers}")

    def describe(self) -> str:
        count = "its workers" if self.workers is None else f"{self.workers} workers"
        return f"{count} on the Ray cluster at {self.address}" if self.address else f"{count} on local Ray"
