"""An arena run in a background thread for the app: in this process, or on Ray workers."""

from __future__ import annotations

import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.experiments.background import BackgroundJob
from kvlab.experiments.plan import ArenaSettings, ModelSource, RayPlan, grid_size
from kvlab.experiments.runner import check_grid, run_arena
from kvlab.workloads.chat.conversation import Conversation


class ArenaJob(BackgroundJob):
    """A grid run in a background thread; the app polls ``fraction`` and reads ``table``."""

    thread_name = "kvlab-arena"

    def __init__(self, lm: LoadedModel, conversations: list[Conversation], settings: ArenaSettings,
                 plan: RayPlan | None = None, source: ModelSource | None = None) -> None:
        """``plan`` runs the grid on Ray workers that load ``source``; without one it runs in this process."""
        if plan is not None and source is None:
            raise KvlabError("a run on Ray workers needs the model source the workers load")
        super().__init__()
        self.lm, self.conversations, self.settings = lm, conversations, settings
        self.plan, self.source = plan, source
        self.total = grid_size(conversations, settings)  # the fraction is of this many turns
        self.table: pd.DataFrame | None = None

    @property
    def done(self) -> int:
        """Turns finished so far (the fraction is of a whole number of turns)."""
        return round(self.fraction * self.total)

    def work(self) -> None:
        if self.plan is None:
            self.table = run_arena(self.lm, self.conversations, self.settings, self.cancel_event, self.progress)
        else:
            from kvlab.experiments.workers import run_arena_ray  # Ray is imported only for a run that uses it

            check_grid(self.lm, self.conversations, self.settings)
            self.table = run_arena_ray(self.source, self.conversations, self.settings, self.plan,
                                       self.cancel_event, self.progress)

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set() and self.done < self.total

    @property
    def workload_names(self) -> list[str]:
        return [c.name for c in self.conversations]
