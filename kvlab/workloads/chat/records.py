"""What a chat turn records: one ``PolicyTurn`` per policy, a ``TurnResult`` per turn, and their table rows.

``policy_row`` is the one row of a policy's turn: the chat's turn table and the arena's results take their
columns from it, so the two cannot name the same measure differently.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd

from kvlab.engine.reconstruction import Repeat


@dataclass
class PolicyTurn:
    """One policy's record of one turn; a policy that failed has ``error`` set and no score (None)."""

    policy: str
    reply: str = ""
    correct: bool | None = None
    kl: float | None = None
    top1: float | None = None
    retained: list[list[list[int]]] = field(default_factory=list)  # [layer][kv_head] original positions
    blocks: dict = field(default_factory=dict)
    kv_bytes: int | None = None
    cache_tokens: list[float] = field(default_factory=list)  # keys per layer and KV head after the turn (head mean)
    sink_mass: list[list[float]] = field(default_factory=list)  # [layer][head] attention on the first k tokens
    # Where its time went. Policies run together: the forwards that feed and decode every cache at once are
    # split evenly (``shared_s``, the same for every policy of the batch); ``own_s`` is what only this policy
    # ran: its eviction step and a pass on top of the turn's prefills (KVzip's reconstruction, the oracle's run
    # of Full over the whole script), with the tokens that pass ran.
    shared_s: float = 0.0
    evict_s: float = 0.0
    extra_prefill_tokens: int = 0
    extra_prefill_s: float = 0.0
    read_share: float | None = None  # share of held keys its decoding queries read (Quest); None: every key
    bytes_read: float | None = None  # K/V bytes a decoding query reads from this cache (see scoring.record_cache)
    pages_read: list[list[list[int]]] = field(default_factory=list)  # Quest: [layer][kv_head] pages the last query read
    # its budget at the turn's last compression (kvlab.workloads.chat.budgets): tokens per layer and KV head (Quest:
    # read per query), and the K/V bytes they allow; None: it keeps every token, no budget bounds what it holds
    budget_tokens: int | None = None
    budget_bytes: int | None = None
    # the largest rotary position its queries sat at this turn, and whether it passed the model's trained context:
    # scores from there on come from positions the model never saw in training (None: not recorded, older files)
    max_position: int | None = None
    past_context: bool = False
    error: str | None = None
    dropped: bool = False  # failed on an earlier turn: this turn it ran nothing, so it has no cost either

    @property
    def own_s(self) -> float:
        """Seconds of work only this policy ran: its eviction and its extra pass."""
        return self.evict_s + self.extra_prefill_s

    @property
    def time_s(self) -> float:
        """Its share of the turn and its own work: what this policy cost the turn."""
        return self.shared_s + self.own_s

    def repeated(self, cost: Repeat) -> None:
        """Count an extra pass of its own (KVzip's reconstruction, the oracle's run of Full): tokens and seconds."""
        self.extra_prefill_tokens += cost.tokens
        self.extra_prefill_s += cost.seconds

    @staticmethod
    def from_dict(d: dict) -> PolicyTurn:
        """A saved record (``TurnResult.to_dict``'s form, or plain kept positions); files from before the split kept
        one ``time_s``: its shared part is what is not its own."""
        d = dict(d)
        if "retained" in d:
            d["retained"] = [[positions_of(head) for head in heads] for heads in d["retained"]]
        if "time_s" in d:
            d["shared_s"] = d.pop("time_s") - d.get("evict_s", 0.0) - d.get("extra_prefill_s", 0.0)
        return PolicyTurn(**d)


COSTS = ("shared_s", "evict_s", "extra_prefill_tokens", "extra_prefill_s")  # what a turn spent: a failed one keeps them


@dataclass
class TurnResult:
    """Everything recorded for one turn, for every policy."""

    index: int
    user: str
    reply: str  # the reply all caches were fed (golden, or Full's own)
    reply_source: str  # "golden" or "full"
    prefill: str
    answer: str | None
    total_tokens: int  # tokens in the conversation after this turn
    segments: list[dict]  # token ranges: {"start", "end", "turn", "role"}
    profile: list[list[float]]  # Full: [layer][key position] mean attention of the last queries
    policies: dict[str, PolicyTurn]
    metric: str = "contains"  # how ``answer`` was checked (kvlab.workloads.chat.metrics)
    turn_s: float | None = None  # wall-clock seconds of the whole turn, every policy together (None: not recorded)

    def to_dict(self) -> dict:
        """The turn as a session file holds it: kept positions as runs (``position_runs``), Full's attention
        profile at float32's digits, every other field as it is. Both lose nothing: the profile is float32 or
        narrower when measured. A session file grows with turns × tokens × layers, and these two were most of it."""
        # the two largest fields are written from the record itself: asdict would deep-copy them only to be replaced
        policies = {name: {**asdict(replace(p, retained=[])),
                           "retained": [[position_runs(head) for head in heads] for heads in p.retained]}
                    for name, p in self.policies.items()}
        return {**asdict(replace(self, profile=[], policies={})), "profile": [float32_digits(r) for r in self.profile],
                "policies": policies}

    @staticmethod
    def from_dict(d: dict) -> "TurnResult":
        return TurnResult(**{**d, "policies": {k: PolicyTurn.from_dict(v) for k, v in d["policies"].items()}})


def position_runs(positions: list[int]) -> list[int | list[int]]:
    """Positions as a session file writes them: each run of three or more consecutive ones as ``[first, last + 1]``,
    the others as they are, in their order (Full keeps every position: one pair per KV head)."""
    a = np.asarray(positions, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(a) != 1) + 1
    out: list[int | list[int]] = []
    for start, end in zip([0, *breaks.tolist()], [*breaks.tolist(), len(a)]):
        out.extend([[positions[start], positions[end - 1] + 1]] if end - start >= 3 else positions[start:end])
    return out


def positions_of(runs: list) -> list[int]:
    """``position_runs`` read back; a list of plain positions (files written before runs) reads as it is."""
    out: list[int] = []
    for item in runs:
        if isinstance(item, int):
            out.append(item)
        elif isinstance(item, list) and len(item) == 2 and all(isinstance(x, int) for x in item):
            out.extend(range(*item))
        else:
            raise TypeError(f"a kept position must be a number or a [first, end] run, not {item!r}")
    return out


def float32_digits(values: list[float]) -> list[float]:
    """``values`` with the fewest digits that read back as the same float32s (0.10439666 for 0.10439666360616684)."""
    return [float(text) for text in np.asarray(values, dtype=np.float32).astype(str)]


# a policy's turn as a table row; the arena's results add the run's coordinates in front (runner.COLUMNS)
ROW_COLUMNS = [
    "turn", "policy", "params", "scored", "correct", "kl", "top1", "total_tokens", "kept_tokens", "compression",
    "budget_tokens", "budget_kib", "kv_bytes", "kv_kib", "held_share", "read_share", "kv_bytes_read", "n_blocks",
    "free_blocks", "fragmented_blocks",
    "full_blocks", "bytes_reserved", "bytes_freeable", "bytes_compaction_copy", "turn_s", "shared_s",
    "own_s", "evict_ms", "extra_prefill_tokens", "extra_prefill_s", "max_position", "past_context", "reply", "answer",
    "error", "metric",
]
# the chat page's and CLI's turn table: the measures of ROW_COLUMNS a reader compares turn by turn
TURN_COLUMNS = [
    "turn", "policy", "kl", "top1", "correct", "metric", "past_context", "max_position", "total_tokens",
    "kept_tokens", "budget_tokens", "budget_kib", "kv_kib", "held_vs_budget", "held_share", "free_blocks",
    "fragmented_blocks",
    "full_blocks", "turn_s", "shared_s", "own_s", "evict_ms", "extra_prefill_tokens", "extra_prefill_s",
    "read_share", "error",
]


def policy_row(turn: TurnResult, name: str, params: dict, number: int | None = None) -> dict:
    """One policy's turn as a row (``ROW_COLUMNS``); a failed policy's row has its error and no score.

    ``params`` are the parameters it ran with; ``number`` is the turn's place in the conversation (default
    the record's own: a single-shot record's index counts kept turns only). ``budget_kib`` is what its budget
    allowed at the turn's last compression (None: it keeps every token), ``kv_kib`` what it held after the turn and
    ``held_share`` that over what Full held.
    """
    p = turn.policies[name]
    ran = not p.dropped  # one dropped on an earlier turn spent nothing here: no cost, not 0
    kept = sum(p.cache_tokens) / len(p.cache_tokens) if p.cache_tokens else None
    full = turn.policies["full"].kv_bytes
    return {
        "turn": turn.index + 1 if number is None else number, "policy": name,
        "params": json.dumps(params, sort_keys=True),
        "scored": turn.answer is not None and p.error is None, "correct": p.correct, "kl": p.kl, "top1": p.top1,
        "total_tokens": turn.total_tokens, "kept_tokens": kept,
        "compression": None if kept is None else kept / turn.total_tokens, "budget_tokens": p.budget_tokens,
        "budget_kib": None if p.budget_bytes is None else p.budget_bytes / 1024, "kv_bytes": p.kv_bytes,
        "kv_kib": None if p.kv_bytes is None else p.kv_bytes / 1024,
        "held_share": None if p.kv_bytes is None or not full else p.kv_bytes / full, "read_share": p.read_share,
        "kv_bytes_read": p.bytes_read, "n_blocks": p.blocks.get("n_blocks"),
        "free_blocks": p.blocks.get("free"), "fragmented_blocks": p.blocks.get("fragmented"),
        "full_blocks": p.blocks.get("full"), "bytes_reserved": p.blocks.get("bytes_reserved_now"),
        "bytes_freeable": p.blocks.get("bytes_freeable"),
        "bytes_compaction_copy": p.blocks.get("bytes_compaction_copy"), "turn_s": turn.turn_s,
        "shared_s": p.shared_s if ran else None, "own_s": p.own_s if ran else None,
        "evict_ms": p.evict_s * 1000 if ran else None,
        "extra_prefill_tokens": p.extra_prefill_tokens if ran else None,
        "extra_prefill_s": p.extra_prefill_s if ran else None, "max_position": p.max_position,
        "past_context": p.past_context if p.error is None else None,
        "reply": p.reply, "answer": turn.answer, "error": p.error,
        "metric": turn.metric if turn.answer is not None else None,
    }


def over_budget(rows: pd.DataFrame) -> pd.Series:
    """Per row: whether the policy held more K/V than its budget allowed at that turn (PyramidKV's integer floors;
    a % of Full's bytes too small for its minimum); False where no budget bounds it."""
    return rows["kv_kib"] > rows["budget_kib"].astype(float) * (1 + 1e-9)


def budget_marks(over: pd.Series, budget_kib: pd.Series, held_kib: pd.Series) -> pd.Series:
    """``over`` in words beside the budget: "over its budget", "within", or "no budget bounds it"; missing where
    nothing was held to compare (a failed policy's row)."""
    marks = over.map({True: "over its budget", False: "within"}).where(budget_kib.notna(), "no budget bounds it")
    return marks.where(held_kib.notna(), None)


def turn_table(turns: list[TurnResult]) -> pd.DataFrame:
    """One row per turn and policy (``TURN_COLUMNS``): fidelity, accuracy, memory and time."""
    rows = pd.DataFrame([policy_row(t, name, {}) for t in turns for name in t.policies],  # no parameters shown
                        columns=ROW_COLUMNS)
    marks = budget_marks(over_budget(rows), rows["budget_kib"], rows["kv_kib"])
    return rows.assign(held_vs_budget=marks)[TURN_COLUMNS]


def failures(turns: list[TurnResult]) -> dict[str, tuple[int, str]]:
    """policy -> (turn number, error) for every policy that failed, at the turn it failed."""
    out: dict[str, tuple[int, str]] = {}
    for t in turns:
        for name, p in t.policies.items():
            if p.error is not None:
                out.setdefault(name, (t.index + 1, p.error))
    return out
