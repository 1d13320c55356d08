"""An arena run in a background thread for the app: in this process, or on Ray workers."""

from __future__ import annotations

import threading

import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError
from kvlab.experiments.plan import ArenaSettings, ModelSource, RayPlan, grid_size
from kvlab.experiments.runner import check_grid, run_arena
from kvlab.workloads.chat.conversation import Conversation


class ArenaJob:
    """A grid run in a background thread; the app polls ``progress`` and reads ``table``.

    The thread never touches the UI: it only writes the fields below.
    """

    def __init__(self, lm: LoadedModel, conversations: list[Conversation], settings: ArenaSettings,
                 plan: RayPlan | None = None, source: ModelSource | None = None) -> None:
        """``plan`` runs the grid on Ray workers that load ``source``; without one it runs in this process."""
        if plan is not None and source is None:
            raise KvlabError("a run on Ray workers needs the model source the workers load")
        self.lm, self.conversations, self.settings = lm, conversations, settings
        self.plan, self.source = plan, source
        self.cancel_event = threading.Event()
        self.total = grid_size(conversations, settings)
        self.fraction, self.label = 0.0, "starting"  # share of the grid's turns done, what runs next
        self.table: pd.DataFrame | None = None
        self.error: str | None = None
        self.started = clock()
        self.elapsed_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kvlab-arena", daemon=True)

    def start(self) -> "ArenaJob":
        self._thread.start()
        return self

    def _progress(self, fraction: float, label: str) -> None:
        self.fraction, self.label = fraction, label

    @property
    def done(self) -> int:
        """Turns finished so far (the fraction is of a whole number of turns)."""
        return round(self.fraction * self.total)

    def _run(self) -> None:
        try:
            if self.plan is None:
                self.table = run_arena(self.lm, self.conversations, self.settings, self.cancel_event, self._progress)
            else:
                from kvlab.experiments.workers import run_arena_ray  # Ray is imported only for a run that uses it

                check_grid(self.lm, self.conversations, self.settings)
                self.table = run_arena_ray(self.source, self.conversations, self.settings, self.plan,
                                           self.cancel_event, self._progress)
        except Exception as exc:  # reported on the page; a failed run must not kill the app
            self.error = str(exc) if isinstance(exc, KvlabError) else f"{type(exc).__name__}: {exc}"
        finally:
            self.elapsed_s = clock() - self.started

    def cancel(self) -> None:
        self.cancel_event.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set() and self.done < self.total

    @property
    def workload_names(self) -> list[str]:
        return [c.name for c in self.conversations]
