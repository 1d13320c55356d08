"""Code edits with prefix reuse: keep the K/V of the unchanged token prefix, re-prefill the rest.

The file is the whole prompt (no chat template, no special tokens). After an edit the old and new
texts are tokenised and the longest common prefix (LCP) of the token ids is found: BPE may merge
the characters just before the edit point differently, so characters would over-count. The cached
K/V is cut to the LCP and the suffix is prefilled at explicit positions ``LCP, LCP+1, …``.

Scripted edit sequences (``data/edits/*.json``)::

    {
      "title": "Edits early, middle and late",
      "file": "code/lru_scheduler.py",          # relative to data/; optional (the CLI may pass --file)
      "edits": [
        {"label": "add a header comment", "op": "insert", "line": 1, "text": "# header\\n"},
        {"label": "rename", "op": "replace", "line": 40, "count": 1,
         "old": "    def get(self, key, default=None):\\n", "text": "    def fetch(self, key, default=None):\\n"},
        {"label": "drop a check", "op": "delete", "at": 0.9, "count": 2}
      ]
    }

``op`` is ``insert`` (``text`` goes before line ``line``; ``len(lines) + 1`` appends), ``replace``
(``count`` lines from ``line`` become ``text``) or ``delete`` (``count`` lines from ``line`` go).
Lines are 1-based and refer to the text as it is when the edit applies (edits apply in order).
``at`` (0..1, a fraction of the current line count) may stand in for ``line`` so that one
sequence fits any file. ``old``, when given, must equal the replaced or deleted lines exactly.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from kvlab.engine.cache import common_prefix, cropped, new_cache
from kvlab.engine.chatformat import start_ids
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run
from kvlab.engine.timing import time_call
from kvlab.errors import KvlabError
from kvlab.files import MB, decode_utf8, parse_json, read_bytes

OPS = ("insert", "replace", "delete")


@dataclass(frozen=True)
class Edit:
    """One line-based edit; see the module docstring for the fields."""

    op: str
    line: int | None = None
    at: float | None = None
    count: int = 1
    text: str = ""
    old: str | None = None
    label: str = ""


@dataclass(frozen=True)
class EditScript:
    title: str
    file: str | None
    edits: tuple[Edit, ...]


def parse_edit(raw: dict, index: int) -> Edit:
    """Validate one JSON edit; KvlabError names the edit that is wrong."""
    where = f"edit {index + 1}"
    if not isinstance(raw, dict):
        raise KvlabError(f"{where}: expected an object")
    unknown = set(raw) - {"op", "line", "at", "count", "text", "old", "label"}
    if unknown:
        raise KvlabError(f"{where}: unknown fields {sorted(unknown)}")
    op = raw.get("op")
    if op not in OPS:
        raise KvlabError(f"{where}: op must be one of {', '.join(OPS)}")
    line, at = raw.get("line"), raw.get("at")
    if (line is None) == (at is None):
        raise KvlabError(f"{where}: give exactly one of 'line' (1-based) or 'at' (0..1)")
    if line is not None and (not isinstance(line, int) or line < 1):
        raise KvlabError(f"{where}: 'line' must be an integer ≥ 1")
    if at is not None and (not isinstance(at, (int, float)) or not 0 <= at <= 1):
        raise KvlabError(f"{where}: 'at' must be a number between 0 and 1")
    count = raw.get("count", 1)
    if not isinstance(count, int) or count < 1:
        raise KvlabError(f"{where}: 'count' must be an integer ≥ 1")
    text = raw.get("text", "")
    if op != "delete" and (not isinstance(text, str) or not text):
        raise KvlabError(f"{where}: {op} needs a non-empty 'text'")
    old = raw.get("old")
    if old is not None and not isinstance(old, str):
        raise KvlabError(f"{where}: 'old' must be a string")
    label = str(raw.get("label", f"{op} {index + 1}"))
    return Edit(op, line, None if at is None else float(at), count, text, old, label)


def load_script(path: str | Path) -> EditScript:
    """Read and validate an edit sequence from JSON."""
    path = Path(path)
    name = f"edit file {path.name!r}"
    raw = parse_json(decode_utf8(read_bytes(path, "edit file"), name, MB, "edit files"), name)
    if not isinstance(raw, dict) or not isinstance(raw.get("edits"), list) or not raw["edits"]:
        raise KvlabError(f"edit file {path.name!r} needs a non-empty 'edits' list")
    try:
        edits = tuple(parse_edit(e, i) for i, e in enumerate(raw["edits"]))
    except KvlabError as exc:  # "edit 1: …" alone does not say which file
        raise KvlabError(f"{name}: {exc}") from None
    return EditScript(str(raw.get("title", path.stem)), raw.get("file"), edits)


def apply_edit(text: str, edit: Edit) -> tuple[str, int]:
    """The edited text and the 1-based line the edit starts at."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    last = len(lines) + 1 if edit.op == "insert" else len(lines)
    line = edit.line if edit.line is not None else 1 + round(edit.at * (last - 1))
    if not 1 <= line <= last:
        raise KvlabError(f"{edit.label}: line {line} is outside 1…{last}")
    start = line - 1
    end = start if edit.op == "insert" else start + edit.count
    if end > len(lines):
        raise KvlabError(f"{edit.label}: lines {line}…{end} run past the end ({len(lines)} lines)")
    if edit.old is not None and "".join(lines[start:end]) != edit.old:
        raise KvlabError(f"{edit.label}: line {line} does not hold the expected text")
    new = "" if edit.op == "delete" else edit.text if edit.text.endswith("\n") else edit.text + "\n"
    return "".join(lines[:start]) + new + "".join(lines[end:]), line


def encode_checked(lm: LoadedModel, text: str) -> list[int]:
    """Token ids of a whole file; KvlabError if it is empty or longer than the model's context."""
    ids = lm.encode(text)
    if not ids:
        raise KvlabError("the code is empty")
    ids = start_ids(lm.tokenizer) + ids  # a file starts as tokenizer(text) starts it: with BOS if it adds one
    if len(ids) > lm.facts.context_length:
        raise KvlabError(f"the code is {len(ids)} tokens; the model's context is {lm.facts.context_length}")
    return ids


def prefill(lm: LoadedModel, ids: list[int], cache: DynamicCache | None = None, start: int = 0
            ) -> tuple[DynamicCache, torch.Tensor]:
    """Forward ``ids[start:]`` after ``start`` cached tokens; the cache and the last logits [vocab]."""
    cache = cache if cache is not None else new_cache(lm)
    logits = run(lm, torch.tensor([ids[start:]]), torch.arange(start, len(ids))[None], cache, logits_to_keep=1)
    return cache, logits[0, -1]


@dataclass
class EditResult:
    """What one edit cost with prefix reuse, against a full prefill of the new text."""

    index: int
    label: str
    op: str
    line: int
    old_tokens: int
    new_tokens: int
    lcp: int
    reused: int  # prefix tokens whose K/V were kept (≤ new_tokens - 1: the last token is always run)
    suffix: int
    reuse_pct: float
    reprefill_ms: float  # median of ``runs``
    full_ms: float  # median of ``runs``
    speedup: float  # the median over runs of full / reprefill, each pair timed back to back
    reprefill_spread_ms: float  # slowest − fastest run
    full_spread_ms: float
    runs: int
    max_logit_diff: float  # last-token logits, reuse vs full prefill
    speedups: list[float] = field(default_factory=list)  # each run's full / reprefill (older records: none)
    # each run's full − reprefill, the pair timed back to back: its median and the fewest and most ms a run saved
    # (older records: None)
    saved_ms: float | None = None
    saved_low_ms: float | None = None
    saved_high_ms: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class EditState:
    """The current text, its ids and its cache (built by prefix reuse after each edit)."""

    text: str
    ids: list[int]
    cache: DynamicCache


def start_state(lm: LoadedModel, text: str) -> EditState:
    """Prefill a file from scratch."""
    ids = encode_checked(lm, text)
    cache, _ = prefill(lm, ids)
    return EditState(text, ids, cache)


def reuse_edit(lm: LoadedModel, state: EditState, new_text: str, index: int = 0, label: str = "edit",
               op: str = "edit", line: int = 0, repeats: int = 1) -> tuple[EditState, EditResult]:
    """Re-prefill ``new_text`` reusing the longest common token prefix of ``state``; time both ways."""
    new_ids = encode_checked(lm, new_text)
    common = common_prefix(state.ids, new_ids)
    reused = min(common, len(new_ids) - 1)
    pairs: list[tuple[float, float]] = []  # (reuse, full) seconds, timed back to back in alternating order
    for attempt in range(max(1, repeats)):
        seed = cropped(lm, state.cache, reused)
        sides = {"reuse": lambda: prefill(lm, new_ids, seed, start=reused), "full": lambda: prefill(lm, new_ids)}
        order = ("reuse", "full") if attempt % 2 == 0 else ("full", "reuse")
        timed = {name: time_call(sides[name]) for name in order}
        (reuse_s, (cache, logits)), (full_s, (_, full_logits)) = timed["reuse"], timed["full"]
        pairs.append((reuse_s.median, full_s.median))
    reuse_runs, full_runs = [p[0] for p in pairs], [p[1] for p in pairs]
    result = EditResult(
        index=index, label=label, op=op, line=line, old_tokens=len(state.ids), new_tokens=len(new_ids),
        lcp=common, reused=reused, suffix=len(new_ids) - reused, reuse_pct=100.0 * reused / len(new_ids),
        reprefill_ms=1000 * statistics.median(reuse_runs), full_ms=1000 * statistics.median(full_runs),
        speedup=statistics.median(f / r for r, f in pairs),
        reprefill_spread_ms=1000 * (max(reuse_runs) - min(reuse_runs)),
        full_spread_ms=1000 * (max(full_runs) - min(full_runs)), runs=len(pairs),
        max_logit_diff=(logits - full_logits).abs().max().item(), speedups=[f / r for r, f in pairs],
        saved_ms=1000 * statistics.median(f - r for r, f in pairs), saved_low_ms=1000 * min(f - r for r, f in pairs),
        saved_high_ms=1000 * max(f - r for r, f in pairs),
    )
    return EditState(new_text, new_ids, cache), result


def first_changed_line(old: str, new: str) -> int:
    """1-based line of the first difference (for edits typed in an editor)."""
    for i, (a, b) in enumerate(zip(old.splitlines(), new.splitlines())):
        if a != b:
            return i + 1
    return min(len(old.splitlines()), len(new.splitlines())) + 1


def step(lm: LoadedModel, state: EditState, edit: Edit, index: int, repeats: int = 1
         ) -> tuple[EditState, EditResult]:
    """Apply one scripted edit to ``state`` and re-prefill with prefix reuse."""
    new_text, line = apply_edit(state.text, edit)
    return reuse_edit(lm, state, new_text, index, edit.label, edit.op, line, repeats)
