"""The policy arena: workloads × budgets × policies, one row per turn and policy, plus summaries.

One ``ChatSession`` per (workload, budget) runs every policy side by side, so all policies at a
budget see the same token stream and are compared with the same Full reference. A run can be
cancelled between decode steps; ``ArenaJob`` runs it in a background thread for the app. Each (workload,
budget) is a cell (``run_cell``): ``kvlab.experiments.workers`` runs cells on Ray workers with the same rows.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

import pandas as pd

from kvlab.workloads.chat.conversation import Conversation
from kvlab.errors import KvlabError, Stopped
from kvlab.engine.model import LoadedModel, ModelFacts
from kvlab.export import records
from kvlab.engine.progress import Progress
from kvlab.engine.timing import clock
from kvlab.workloads.chat.session import ChatSession, ChatSettings, TurnResult, model_policies
from kvlab.policies import DEFAULT_COMPARISON, make_policy
from kvlab.policies.memory import MIB, tokens_within
from kvlab.stats import bootstrap_mean, wilson

if TYPE_CHECKING:
    from kvlab.experiments.workers import ModelSource, RayPlan

MAX_BUDGETS = 16
# multi-turn: answers stay and caches carry over (SCBench multi-turn). single-shot: turn 1 is the shared
# context; every later question is asked against the caches as turn 1 left them, its answer not kept
# (SCBench multi-request, kvpress). Turn 1 is the same in both modes.
MODES = ("multi-turn", "single-shot")
# tokens: every policy keeps that many tokens per layer and KV head. mib: MiB of K/V the whole cache may
# hold; each policy gets the most tokens whose worst case fits (kvlab.policies.memory), so a 4-bit cache
# keeps more tokens than a full-precision one at the same memory
BUDGET_UNITS = {"tokens": "tokens per layer per KV head", "mib": "MiB of K/V held at most"}
UNIT_NAMES = {"tokens": "tokens", "mib": "MiB"}  # the same units, short

COLUMNS = [
    "workload", "budget", "budget_tokens", "mode", "turn", "policy", "params", "scored", "correct", "kl", "top1",
    "total_tokens",
    "kept_tokens", "compression", "kv_bytes", "kv_kib", "read_share", "kv_bytes_read", "n_blocks", "free_blocks",
    "fragmented_blocks", "full_blocks", "bytes_reserved", "bytes_freeable", "bytes_compaction_copy", "time_s", "evict_ms", "reply", "answer", "error",
]


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
        by_bytes = self.budget_unit == "mib"
        if isinstance(self.modes, str) or not self.modes or any(m not in MODES for m in self.modes):
            raise KvlabError(f"modes must be one or both of {', '.join(MODES)}, not {self.modes!r}")
        object.__setattr__(self, "modes", tuple(m for m in MODES if m in self.modes))
        numbers = (int, float) if by_bytes else int
        if any(not isinstance(b, numbers) or isinstance(b, bool) or not math.isfinite(b) for b in self.budgets):
            what = "numbers of MiB" if by_bytes else "whole numbers of tokens"
            raise KvlabError(f"budgets must be {what}, not {list(self.budgets)}")
        budgets = tuple(sorted(set(self.budgets)))
        if not budgets:
            raise KvlabError("give at least one budget")
        if by_bytes and budgets[0] <= 0:
            raise KvlabError(f"budgets must be more than 0 MiB, not {budgets[0]}")
        if not by_bytes and budgets[0] < 1:
            raise KvlabError(f"budgets must be at least 1 token, not {budgets[0]}")
        if len(budgets) > MAX_BUDGETS:
            raise KvlabError(f"{len(budgets)} budgets given; at most {MAX_BUDGETS} per run")
        if self.max_turns is not None and self.max_turns < 1:
            raise KvlabError(f"max turns must be at least 1, not {self.max_turns}")
        object.__setattr__(self, "budgets", budgets)
        # ChatSettings refuses unknown policies, bad parameters and budgets below a policy's minimum,
        # and fills in every parameter each policy runs with; byte budgets become tokens only on a model
        # (check_grid), so here any policy's minimum passes
        first = self._chat_settings(1 << 30 if by_bytes else budgets[0])
        object.__setattr__(self, "policies", first.policies)
        object.__setattr__(self, "params", first.params)
        if not by_bytes:
            for b in budgets[1:]:
                self._chat_settings(b)

    def _chat_settings(self, budget: int, policy_budgets: dict[str, int] | None = None) -> ChatSettings:
        return ChatSettings(policies=tuple(self.policies), budget=budget, block_size=self.block_size,
                            position_mode=self.position_mode, params=self.params,
                            max_new_tokens=self.max_new_tokens, policy_budgets=policy_budgets or {})

    def chat_settings(self, budget: float, facts: ModelFacts | None = None) -> ChatSettings:
        """The engine's settings for one budget of the grid; a byte budget needs the model's ``facts``
        and refuses a policy whose minimum budget it cannot hold."""
        if self.budget_unit == "tokens":
            return self._chat_settings(int(budget))
        if facts is None:
            raise KvlabError("a budget in MiB becomes tokens only on a loaded model")
        nbytes = int(budget * MIB)
        tokens = {name: tokens_within(make_policy(name, **self.params[name]), nbytes, facts, facts.context_length,
                                      f"{budget:g} MiB") for name in self.policies}
        base = tokens["full"]  # Full keeps everything at any budget: its number is what the bytes hold unquantized
        return self._chat_settings(base, {n: t for n, t in tokens.items() if t != base})

    @property
    def budget_label(self) -> str:
        """What a budget of this grid counts, in words."""
        return BUDGET_UNITS[self.budget_unit]

    @property
    def unit_name(self) -> str:
        """The budget's unit, short (an axis title's)."""
        return UNIT_NAMES[self.budget_unit]

    def questions_of(self, conv: Conversation) -> int:
        """How many of a workload's turns the grid runs."""
        return len(conv.turns) if self.max_turns is None else min(len(conv.turns), self.max_turns)

    def turns_of(self, conv: Conversation) -> int:
        """How many turns one cell of this workload runs: turn 1 once, each later turn once per mode."""
        n = self.questions_of(conv)
        return n + (len(self.modes) - 1) * (n - 1)

    def to_dict(self) -> dict:
        return asdict(self) | {"policies": list(self.policies), "budgets": list(self.budgets),
                               "modes": list(self.modes)}


def parse_budgets(text: str, unit: str = "tokens") -> tuple[float, ...]:
    """'64,128,256' → (64, 128, 256) (in MiB: '2.5,5' → (2.5, 5.0)); anything else is a user error."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        budgets = tuple(float(p) if unit == "mib" else int(p) for p in parts)
    except ValueError:
        like = "numbers like 2.5,5,10 (MiB)" if unit == "mib" else "whole numbers like 64,128,256"
        raise KvlabError(f"budgets must be comma-separated {like}, not {text!r}") from None
    if not budgets:
        raise KvlabError("give at least one budget, e.g. 64,128,256,512")
    return budgets


def turn_rows(workload: str, budget: float, mode: str, number: int, turn: TurnResult,
              params: dict[str, dict], tokens: dict[str, int]) -> list[dict]:
    """One turn's records as table rows, one per policy; a failed policy's row has its error and no score.

    ``number`` is the turn's place in the conversation (a single-shot record's index counts kept turns only);
    ``tokens`` is each policy's token budget (the budget itself, or what a byte budget gave it).
    """
    rows = []
    for name, p in turn.policies.items():
        kept = sum(p.cache_tokens) / len(p.cache_tokens) if p.cache_tokens else None
        rows.append({
            "workload": workload, "budget": budget, "budget_tokens": tokens[name], "mode": mode, "turn": number,
            "policy": name,
            "params": json.dumps(params[name], sort_keys=True),
            "scored": turn.answer is not None and p.error is None, "correct": p.correct, "kl": p.kl, "top1": p.top1,
            "total_tokens": turn.total_tokens, "kept_tokens": kept,
            "compression": None if kept is None else kept / turn.total_tokens, "kv_bytes": p.kv_bytes,
            "kv_kib": None if p.kv_bytes is None else p.kv_bytes / 1024, "read_share": p.read_share,
            "kv_bytes_read": p.bytes_read, "n_blocks": p.blocks.get("n_blocks"),
            "free_blocks": p.blocks.get("free"), "fragmented_blocks": p.blocks.get("fragmented"),
            "full_blocks": p.blocks.get("full"), "bytes_reserved": p.blocks.get("bytes_reserved_now"),
            "bytes_freeable": p.blocks.get("bytes_freeable"),
            "bytes_compaction_copy": p.blocks.get("bytes_compaction_copy"), "time_s": p.time_s,
            "evict_ms": p.evict_s * 1000, "reply": p.reply, "answer": turn.answer, "error": p.error,
        })
    return rows


def grid_size(conversations: list[Conversation], settings: ArenaSettings) -> int:
    """Turns the whole grid runs (each runs every policy)."""
    return sum(settings.turns_of(c) for c in conversations) * len(settings.budgets)


def check_grid(lm: LoadedModel, conversations: list[Conversation], settings: ArenaSettings) -> None:
    """Refuse a grid that cannot run on this model, before any turn runs."""
    if not conversations:
        raise KvlabError("choose at least one workload")
    names = [c.name for c in conversations]
    if len(set(names)) != len(names):
        raise KvlabError(f"workload names must be distinct: {', '.join(names)}")
    limit = lm.facts.context_length
    if settings.budget_unit == "mib":
        for b in settings.budgets:  # a policy whose minimum a byte budget cannot hold is refused here
            model_policies(lm, settings.chat_settings(b, lm.facts))
    elif settings.budgets[-1] > limit:
        raise KvlabError(f"budget {settings.budgets[-1]} exceeds the model's context of {limit} tokens")


@dataclass(frozen=True)
class Cell:
    """One workload at one budget: a session with every policy side by side, in every mode of the grid."""

    workload: int  # index into the grid's conversations
    budget: int


def grid_cells(conversations: list[Conversation], settings: ArenaSettings) -> list[Cell]:
    """The grid's cells in run order, which is also the order of the result rows."""
    return [Cell(w, b) for w in range(len(conversations)) for b in settings.budgets]


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


def run_cell(lm: LoadedModel, conv: Conversation, budget: int, settings: ArenaSettings,
             before_turn: Callable[[int], bool] | None = None,
             should_stop: Callable[[], bool] | None = None, cancel: threading.Event | None = None) -> list[dict]:
    """One cell's rows, mode by mode; ``before_turn(i)`` runs before the cell's ``i``-th turn (of
    ``settings.turns_of``) and stops the cell when it returns False.

    Turn 1 runs once and its record serves every mode; single-shot questions then run against the
    caches it left (each rolled back after), and multi-turn carries on from the same caches.
    ``should_stop`` is asked between decode steps and phases: when it says yes the turn in progress
    is dropped (its caches rolled back) and the rows of the finished turns are returned. Setting
    ``cancel`` does the same before the next decoder layer, inside a long prefill too.
    """
    chat = settings.chat_settings(budget, lm.facts)
    session = ChatSession(lm, chat, conv.system)
    tokens = {name: chat.budget_of(name) for name in chat.policies}

    def check(*_: str) -> None:
        if should_stop is not None and should_stop():
            raise Stopped("cancelled")

    turns = conv.turns[:settings.questions_of(conv)]
    rows: dict[str, list[dict]] = {m: [] for m in settings.modes}
    for step, (i, modes, keep) in enumerate(cell_plan(conv, settings)):
        if before_turn is not None and not before_turn(step):
            break
        turn = turns[i]
        try:
            result = session.run_turn(turn.user, golden=turn.golden, prefill=turn.prefill, answer=turn.answer,
                                      on_token=check, on_phase=check, keep=keep, stop=cancel)
        except Stopped:
            break
        for mode in modes:
            rows[mode] += turn_rows(conv.name, budget, mode, i + 1, result, settings.params, tokens)
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
                     "answer": turn.answer, "error": error}
            for mode in settings.modes for i, turn in enumerate(conv.turns[:settings.questions_of(conv)])
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

    ``cancel`` is checked between decode steps: a cancelled run returns the rows of the finished turns.
    ``progress`` gets the share of the grid's turns done and what runs next.
    """
    check_grid(lm, conversations, settings)
    total, done = grid_size(conversations, settings), 0
    rows: list[dict] = []
    for cell in grid_cells(conversations, settings):
        conv = conversations[cell.workload]

        def before_turn(i: int) -> bool:
            if progress:
                progress((done + i) / total, f"{conv.name} · budget {cell.budget} · {step_label(conv, settings, i)}")
            return cancel is None or not cancel.is_set()

        cell_rows = run_cell(lm, conv, cell.budget, settings, before_turn, cancel=cancel)  # checked before every layer
        rows += cell_rows
        done += turns_ran(cell_rows, settings)
        if cancel is not None and cancel.is_set() and done < total:
            return pd.DataFrame(rows, columns=COLUMNS)
    if progress:
        progress(done / total, "done")
    return pd.DataFrame(rows, columns=COLUMNS)


INTERVALS = ["accuracy_low", "accuracy_high", "kl_low", "kl_high"]


def with_intervals(summary: pd.DataFrame, t: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``summary`` (one row per group of ``keys``) with each group's 95 % intervals: accuracy's Wilson interval over
    its scored questions (``scored`` is that n) and the mean KL's bootstrap interval over its scored rows (seed 0,
    so a table is the same every time it is built). ``t`` holds the rows, with ``hit`` (1, 0 or NaN: unscored)."""
    out = []
    for key, g in t.groupby(keys, sort=False):
        hits = g["hit"].dropna()
        acc, kl = wilson(int(hits.sum()), len(hits)), bootstrap_mean(g["kl"])
        out.append([*key, acc.low, acc.high, kl.low, kl.high])
    return summary.merge(pd.DataFrame(out, columns=[*keys, *INTERVALS]), on=keys, how="left")


def per_turn(table: pd.DataFrame) -> pd.DataFrame:
    """Accuracy and fidelity per policy, budget and turn, averaged over workloads, with 95 % intervals.

    accuracy is over the turns with an answer to check (NaN where none had one; ``scored`` counts them) with its
    Wilson interval; kl with its bootstrap interval (``with_intervals``). Means skip the rows of failed policies
    (no score); ``failed`` counts them.
    """
    t = table.assign(hit=table["correct"].where(table["scored"]).astype(float))
    keys = ["policy", "budget", "turn"]
    out = (t.groupby(keys, sort=False)
           .agg(accuracy=("hit", "mean"), scored=("scored", "sum"), kl=("kl", "mean"), top1=("top1", "mean"),
                workloads=("workload", "nunique"), failed=("error", "count"))
           .reset_index())
    return with_intervals(out, t, keys)


def fidelity_vs_budget(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy and budget over every turn: accuracy and KL with 95 % intervals (``with_intervals``), top-1
    agreement and first vs later turns.

    Means skip the rows of failed policies (no score); ``failed`` counts them.
    """
    t = table.assign(hit=table["correct"].where(table["scored"]).astype(float))
    first, later = t[t["turn"] == 1], t[t["turn"] > 1]
    keys = ["policy", "budget"]
    out = (t.groupby(keys, sort=False)
           .agg(accuracy=("hit", "mean"), scored=("scored", "sum"), kl=("kl", "mean"), top1=("top1", "mean"),
                failed=("error", "count"))
           .reset_index())
    out = with_intervals(out, t, keys)
    out = out.merge(first.groupby(keys)["hit"].mean().rename("accuracy_turn1").reset_index(), on=keys, how="left")
    out = out.merge(later.groupby(keys)["hit"].mean().rename("accuracy_later").reset_index(), on=keys, how="left")
    return out


def after_turn_one(summary: pd.DataFrame) -> list[str]:
    """SCBench's question in words, from ``fidelity_vs_budget``: per policy and budget, turn 1 vs later accuracy.

    Only rows where both turn 1 and later turns were scored, and accuracy moved, are told.
    """
    lines = []
    both = summary.dropna(subset=["accuracy_turn1", "accuracy_later"])
    for row in both[both["policy"] != "full"].itertuples():
        change = row.accuracy_later - row.accuracy_turn1
        if change:
            verb = "falls" if change < 0 else "rises"
            lines.append(f"{row.policy} at {row.budget}: {verb} from {row.accuracy_turn1:.0%} on turn 1 to "
                         f"{row.accuracy_later:.0%} after")
    return lines


def memory_vs_fidelity(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy and budget: memory held next to KL and accuracy.

    kv_kib counts the kept tokens densely; paged_kib is what a paged allocator (vLLM-style blocks)
    still reserves without compaction: every block that holds at least one kept token. Means skip
    the rows of failed policies; ``failed`` counts them.
    """
    t = table.assign(hit=table["correct"].where(table["scored"]).astype(float),
                     fragmented_share=table["fragmented_blocks"] / table["n_blocks"],
                     time_s=table["time_s"].where(table["error"].isna()))  # a dropped policy's 0 s is not speed
    return (t.groupby(["policy", "budget"], sort=False)
            .agg(kv_kib=("kv_kib", "mean"), paged_kib=("bytes_reserved", lambda s: s.mean() / 1024),
                 kept_tokens=("kept_tokens", "mean"), compression=("compression", "mean"),
                 fragmented_share=("fragmented_share", "mean"),
                 compaction_copy_kib=("bytes_compaction_copy", lambda s: s.mean() / 1024),
                 kl=("kl", "mean"), top1=("top1", "mean"), accuracy=("hit", "mean"), time_s=("time_s", "mean"),
                 failed=("error", "count"))
            .reset_index())


def memory_equal(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy and budget: KV bytes held and bytes read per generated token, as shares of Full's, with
    accuracy and KL — so eviction, quantization and sparse reading stand on one memory axis.

    Measured, not set: held is ``kv_bytes`` after each turn (kivi: packed integers, scales and zero
    points; quest: every key plus its page metadata) over Full's on the same workload, budget, mode and
    turn; ``budget_tokens`` is the token budget the policy ran with (a byte budget gives each its own). Read
    is what one decoding query reads (quest: every page's min and max, then its share of the
    keys and values; every other policy reads all it holds). Means skip failed rows.
    """
    keys = ["workload", "budget", "mode", "turn"]
    if "budget_tokens" not in table:  # rows written before byte budgets: every budget was in tokens
        table = table.assign(budget_tokens=table["budget"])
    full = table[table["policy"] == "full"].set_index(keys)["kv_bytes"].rename("full_bytes")
    t = table.join(full, on=keys)
    t = t.assign(hit=t["correct"].where(t["scored"]).astype(float), held_share=t["kv_bytes"] / t["full_bytes"],
                 read_share_of_full=t["kv_bytes_read"] / t["full_bytes"], read_kib=t["kv_bytes_read"] / 1024)
    return (t.groupby(["policy", "budget"], sort=False)
            .agg(budget_tokens=("budget_tokens", "first"), held_share=("held_share", "mean"),
                 read_share_of_full=("read_share_of_full", "mean"),
                 kv_kib=("kv_kib", "mean"), read_kib=("read_kib", "mean"), accuracy=("hit", "mean"),
                 kl=("kl", "mean"), failed=("error", "count"))
            .reset_index())


def one_mode(table: pd.DataFrame) -> pd.DataFrame:
    """The rows the per-budget summaries read: multi-turn where the run has it, else single-shot."""
    mode = "multi-turn" if (table["mode"] == "multi-turn").any() else "single-shot"
    return table[table["mode"] == mode]


# Turns 1 and 2 meet the same caches in both modes (turn 2 follows turn 1 alone either way): their rows are equal by
# construction, so only turn 3 on can show what carrying a conversation costs.
FIRST_TURN_MODES_DIFFER = 3


def mode_drop(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy, budget and turn: accuracy and KL multi-turn next to single-shot, and what turns cost.

    drop = single-shot accuracy − multi-turn accuracy on the same question (positive: carrying the
    conversation lost answers); kl_rise = multi-turn KL − single-shot KL; ``modes can differ`` is False on turns
    1 and 2, equal in both modes by construction. Empty unless both modes ran.
    """
    columns = ["policy", "budget", "turn", "modes can differ", "accuracy multi-turn", "accuracy single-shot", "drop",
               "kl multi-turn", "kl single-shot", "kl_rise"]
    if not set(MODES) <= set(table["mode"]):
        return pd.DataFrame(columns=columns)
    keys = ["policy", "budget", "turn"]
    multi, single = (per_turn(table[table["mode"] == m]).set_index(keys)[["accuracy", "kl"]] for m in MODES)
    out = multi.join(single, lsuffix=" multi-turn", rsuffix=" single-shot", how="inner").reset_index()
    out["drop"] = out["accuracy single-shot"] - out["accuracy multi-turn"]
    out["kl_rise"] = out["kl multi-turn"] - out["kl single-shot"]
    out["modes can differ"] = out["turn"] >= FIRST_TURN_MODES_DIFFER
    return out[columns]


def modes_note(drop: pd.DataFrame) -> str | None:
    """Why a ``mode_drop`` table shows no difference, when no turn in it can differ between the modes (None when
    some can)."""
    if drop.empty or drop["modes can differ"].any():
        return None
    return (f"Every workload here stops by turn {FIRST_TURN_MODES_DIFFER - 1}: single-shot equals multi-turn by "
            f"construction (turn 2 follows turn 1 alone in both modes), so drop is 0. Run workloads with "
            f"{FIRST_TURN_MODES_DIFFER} turns or more to measure what carrying the conversation costs.")


def failures(table: pd.DataFrame) -> pd.DataFrame:
    """Every policy that failed, once per workload and budget: the turn it failed on and its error."""
    failed = table[table["error"].notna()]
    return failed.drop_duplicates(["workload", "budget", "policy"])[
        ["workload", "budget", "policy", "turn", "error"]].reset_index(drop=True)


def interval_text(low: float, high: float, digits: int = 2) -> str | None:
    """'[0.41, 0.93]'; None where there is no interval (nothing scored: a missing value, never a number)."""
    return None if pd.isna(low) else f"[{low:.{digits}f}, {high:.{digits}f}]"


def accuracy_grid(table: pd.DataFrame) -> pd.DataFrame:
    """The closing table: rows policy × budget, one accuracy column per turn, and the overall figure with its n
    (questions scored) and 95 % intervals (Wilson for accuracy, bootstrap for the mean KL)."""
    pt = per_turn(table)
    wide = pt.pivot_table(index=["policy", "budget"], columns="turn", values="accuracy", sort=False,
                          dropna=False).astype(float)
    wide.columns = [f"turn {c}" for c in wide.columns]
    overall = fidelity_vs_budget(table).set_index(["policy", "budget"])
    return wide.join(pd.DataFrame({
        "all turns": overall["accuracy"], "n": overall["scored"].astype("Int64").where(overall["scored"] > 0),
        "all turns 95 %": [interval_text(lo, hi) for lo, hi in zip(overall["accuracy_low"], overall["accuracy_high"])],
        "kl": overall["kl"], "kl 95 %": [interval_text(lo, hi, 3) for lo, hi in zip(overall["kl_low"],
                                                                                    overall["kl_high"])],
        "top1": overall["top1"]}, index=overall.index)).reset_index()


def results_json(table: pd.DataFrame, settings: ArenaSettings, model: str, workloads: list[str],
                 cancelled: bool = False) -> dict:
    """Everything a run produced, as plain JSON."""
    return {
        "kvlab_arena": 1, "model": model, "workloads": workloads, "settings": settings.to_dict(),
        "cancelled": cancelled, "rows": records(table),
        "accuracy_grid": records(accuracy_grid(one_mode(table))) if len(table) else [],
        "mode_drop": records(mode_drop(table)) if len(table) else [],
        "memory_equal": records(memory_equal(one_mode(table))) if len(table) else [],
    }


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
