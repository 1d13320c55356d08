"""The arena's runner: each cell's turns through one ``ChatSession``, one row per turn and policy.

One ``ChatSession`` per (workload, budget) runs every policy side by side, so all policies at a
budget see the same token stream and are compared with the same Full reference. ``cancel`` is the one
way to stop a run: the session checks it before every decoder layer, and the turn it stops is dropped.
``run_arena`` runs every cell in this process; ``kvlab.experiments.workers`` runs the same cells on Ray.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from typing import Callable

import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.engine.future import FutureAttention
from kvlab.engine.progress import Progress
from kvlab.errors import KvlabError, Stopped
from kvlab.experiments.plan import ArenaSettings, cell_plan, grid_cells, grid_size, step_label
from kvlab.workloads.chat.conversation import Conversation, first_turns, short_replies
from kvlab.workloads.chat.positions import check_script_fits
from kvlab.workloads.chat.records import ROW_COLUMNS, TurnResult, policy_row
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import model_policies

# one row per workload, budget (in the grid's unit), mode, turn and policy: the run's coordinates, then the policy's
# turn, with the tokens and bytes its budget gave it on that turn (budget_tokens, budget_kib)
COLUMNS = ["workload", "budget", "mode", *ROW_COLUMNS]


def turn_rows(workload: str, budget: float, mode: str, number: int, turn: TurnResult,
              params: dict[str, dict]) -> list[dict]:
    """One turn's records as table rows, one per policy (``records.policy_row`` after the run's coordinates).

    ``number`` is the turn's place in the conversation (a single-shot record's index counts kept turns only).
    """
    return [{"workload": workload, "budget": budget, "mode": mode} | policy_row(turn, name, params[name], number)
            for name in turn.policies]


def check_grid(lm: LoadedModel, conversations: list[Conversation], settings: ArenaSettings) -> None:
    """Refuse a grid that cannot run on this model, before any turn runs."""
    if not conversations:
        raise KvlabError("choose at least one workload")
    names = [c.name for c in conversations]
    if len(set(names)) != len(names):
        raise KvlabError(f"workload names must be distinct: {', '.join(names)}")
    limit = lm.facts.context_length
    for conv in conversations:
        check_script_fits(lm, settings.position_mode, conv, settings.max_new_tokens, settings.questions_of(conv),
                          settings.modes)
    if settings.budget_unit == "mib":
        for b in reversed(settings.budgets):  # one past the context's K/V, or below a policy's minimum: refused here
            model_policies(lm, settings.chat_settings(b, lm.facts))
    elif settings.budget_unit == "tokens" and settings.budgets[-1] > limit:
        raise KvlabError(f"budget {settings.budgets[-1]} exceeds the model's context of {limit} tokens")


def grid_short_replies(lm: LoadedModel, conversations: list[Conversation], settings: ArenaSettings) -> str | None:
    """``short_replies`` over the turns the grid runs of each workload, at its reply length (page and CLI)."""
    return short_replies(lm.encode, [first_turns(c, settings.max_turns) for c in conversations],
                         settings.max_new_tokens)


@dataclass
class ScriptPass:
    """Full's pass over a workload's script (the oracle's future), kept for the grid's next cell of that workload:
    it does not depend on the budget, and cells run workload by workload, so only the latest workload's is held."""

    conv: Conversation | None = None
    future: FutureAttention | None = None

    def take(self, conv: Conversation) -> FutureAttention | None:
        """A copy of ``conv``'s pass for a new cell (a session drops its copy's ``resume`` when done with it)."""
        if self.conv is not conv:
            self.conv, self.future = conv, None
        return None if self.future is None else replace(self.future)

    def keep(self, conv: Conversation, future: FutureAttention | None) -> None:
        """Hold ``conv``'s pass as its first cell's session left it after turn 1 (``resume`` still set)."""
        if self.conv is conv and self.future is None and future is not None:
            self.future = replace(future)


def run_cell(lm: LoadedModel, conv: Conversation, budget: int, settings: ArenaSettings,
             cancel: threading.Event | None = None, on_turn: Callable[[int], None] | None = None,
             script_pass: ScriptPass | None = None) -> list[dict]:
    """One cell's rows, mode by mode; ``on_turn(i)`` is told before the cell's ``i``-th turn (of
    ``settings.turns_of``) starts. ``script_pass``: where the oracle's pass over this workload is shared with the
    grid's other cells of it.

    Turn 1 runs once and its record serves every mode; single-shot questions then run against the
    caches it left (each rolled back after), and multi-turn carries on from the same caches. Setting
    ``cancel`` stops the cell before the next decoder layer (inside a long prefill too): the turn in
    progress is dropped (its caches rolled back) and the rows of the finished turns are returned.
    """
    chat = settings.chat_settings(budget, lm.facts)
    script = first_turns(conv, settings.max_turns)
    turns = script.turns
    session = ChatSession(lm, chat, conv.system, script=script,  # the oracle's future
                          script_future=script_pass.take(conv) if script_pass else None)
    rows: dict[str, list[dict]] = {m: [] for m in settings.modes}
    for step, (i, modes, keep) in enumerate(cell_plan(conv, settings)):
        if on_turn is not None:
            on_turn(step)
        turn = turns[i]
        try:
            result = session.run_turn(turn.user, golden=turn.golden, prefill=turn.prefill, answer=turn.answer,
                                      keep=keep, stop=cancel, metric=turn.metric)
        except Stopped:
            break
        if step == 0 and script_pass is not None:
            script_pass.keep(conv, session.script_future)
        for mode in modes:
            rows[mode] += turn_rows(conv.name, budget, mode, i + 1, result, settings.params)
    return [r for mode in settings.modes for r in rows[mode]]


def turns_ran(rows: list[dict], settings: ArenaSettings) -> int:
    """How many turns a cell's rows come from (turn 1's record is in every mode's rows)."""
    keys = {(r["mode"], r["turn"]) for r in rows}
    return len(keys) - (len(settings.modes) - 1) * any(t == 1 for _, t in keys)


def failed_cell_rows(conv: Conversation, budget: int, settings: ArenaSettings, error: str) -> list[dict]:
    """The rows of a cell that could not run: every turn and policy, no score, and the error."""
    empty = dict.fromkeys(COLUMNS)
    return [empty | {"workload": conv.name, "budget": budget, "mode": mode, "turn": i + 1, "policy": name,
                     "params": json.dumps(settings.params[name], sort_keys=True), "scored": False,
                     "answer": turn.answer, "error": error, "metric": turn.metric if turn.answer else None}
            for mode in settings.modes for i, turn in enumerate(first_turns(conv, settings.max_turns).turns)
            for name in settings.policies]


def cells_not_run(table: pd.DataFrame, conversations: list[Conversation], settings: ArenaSettings) -> int:
    """How many cells of the grid have no row in ``table`` (a cancelled run's remainder)."""
    ran = set(table[["workload", "budget"]].itertuples(index=False, name=None))
    return sum((c.name, b) not in ran for c in conversations for b in settings.budgets)


def run_arena(
    lm: LoadedModel,
    conversations: list[Conversation],
    settings: ArenaSettings,
    cancel: threading.Event | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Run the grid in this process; one row per workload, budget, turn and policy (see ``COLUMNS``).

    ``cancel`` is checked before every decoder layer: a cancelled run returns the rows of the finished turns.
    ``progress`` gets the share of the grid's turns done and what runs next.
    """
    check_grid(lm, conversations, settings)
    if progress:  # what a policy learns from the model first (DuoAttention's head pattern) reports at 0 % done
        model_policies(lm, settings.chat_settings(settings.budgets[0], lm.facts), lambda _, what: progress(0.0, what))
    total, done = grid_size(conversations, settings), 0
    rows: list[dict] = []
    script_pass = ScriptPass()
    for cell in grid_cells(conversations, settings):
        conv = conversations[cell.workload]

        def on_turn(i: int) -> None:
            if progress:
                progress((done + i) / total, f"{conv.name} · budget {cell.budget:g} {settings.unit_name} · "
                                                 f"{step_label(conv, settings, i)}")

        cell_rows = run_cell(lm, conv, cell.budget, settings, cancel, on_turn, script_pass)
        rows += cell_rows
        done += turns_ran(cell_rows, settings)
        if cancel is not None and cancel.is_set() and done < total:
            return pd.DataFrame(rows, columns=COLUMNS)
    if progress:
        progress(done / total, "done")
    return pd.DataFrame(rows, columns=COLUMNS)
