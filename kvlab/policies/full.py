"""Full: keep every token. The reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.base import UNBOUNDED, Policy


@dataclass
class Full(Policy):
    name = "full"
    summary = "keeps every token (the exact reference)"
    evicts = False

    def validate(self, budget: int, context_length: int | None = None) -> None:
        """Full ignores the budget."""

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        return [UNBOUNDED] * n_layers
