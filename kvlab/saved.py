"""Saved runs: the stamp every downloaded record carries (when, which model, which kvlab), reading a file back,
and where a re-run differs from it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone

from kvlab import __version__
from kvlab.files import MB, decode_utf8, parse_json

MAX_RECORD_BYTES = 200 * MB  # a saved run with every turn's maps is a few MB; far more is not one of ours
UNKNOWN = "unknown"  # what a file saved before stamps existed says about when, what model and what version


@dataclass(frozen=True)
class Stamp:
    """When a run was saved, on which model and by which kvlab version (``UNKNOWN`` where a file does not say)."""

    saved_at: str
    model: str
    kvlab_version: str

    def as_dict(self) -> dict:
        """The stamp's fields as a saved record holds them (a file opened and saved again keeps its stamp)."""
        return {"saved_at": self.saved_at, "model": self.model, "kvlab_version": self.kvlab_version}

    def label(self) -> str:
        """One line for a page: what the saved records are and where they came from."""
        return f"saved {self.saved_at} · model {self.model} · kvlab {self.kvlab_version}"


@dataclass(frozen=True)
class ReplayCheck:
    """What a replay of a saved run found against its file, in the one wording the pages and the CLI use."""

    found: list[str]  # where the replay differs (``at_most`` eight places named); empty: identical
    compared: str  # what a replay holds equal, e.g. "every question"
    stamp: Stamp  # the file's
    model: str  # the model the replay ran on

    @property
    def identical(self) -> bool:
        return not self.found

    def headline(self, source: str = "the file") -> str:
        """One sentence, no full stop: identical (timings aside), or differing and whether the model explains it."""
        if self.identical:
            return (f"Replay identical on {self.model}: {self.compared} equals {source}'s ({self.stamp.label()}), "
                    "timings aside")
        other = (f"; the file was made on {self.stamp.model}, so differences are expected"
                 if self.stamp.model != self.model else "")
        return f"The replay on {self.model} differs from {source} ({self.stamp.label()}){other}"


def stamp(model: str) -> dict:
    """The fields a saved record starts with: now (UTC, to the second), the model's name, this kvlab's version."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"saved_at": now, "model": model, "kvlab_version": __version__}


def now(model: str) -> Stamp:
    """The stamp of a run saved now on ``model``."""
    return stamp_of(stamp(model))


def stamp_of(data: dict) -> Stamp:
    """A saved record's stamp; fields an older file lacks read ``UNKNOWN``."""
    return Stamp(*(str(data.get(k) or UNKNOWN) for k in ("saved_at", "model", "kvlab_version")))


def read_json(raw: bytes, what: str) -> object:
    """A saved file's bytes as JSON, refused in words: too large, not UTF-8, or not valid JSON (with its line)."""
    name = f"that {what}"
    return parse_json(decode_utf8(raw, name, MAX_RECORD_BYTES, "saved runs"), name)


# wall-clock fields (seconds, milliseconds, TTFT, speed-ups and spreads of timings): a re-run on the same model
# differs in them and nowhere else
TIMED = re.compile(r"(_s|_ms)$|time|ttft|speedup|spread")
CLOSE = 1e-6  # numbers equal within float32 noise of a JSON round trip


def differences(saved: object, again: object, path: str = "", most: int | None = 8) -> list[str]:
    """Where a re-run's JSON record differs from a saved one, timings aside (``TIMED``); empty: identical.

    Both sides are plain JSON (dicts, lists, numbers, strings, None); numbers compare within ``CLOSE``, NaN equal
    to NaN. At most ``most`` places are named (None: all, for a caller that cuts its whole list once), each as a path
    like ``edits[2].reused``.
    """
    out: list[str] = []
    _compare(saved, again, path or "the record", out)
    return out if most is None else at_most(out, most)


def at_most(found: list[str], most: int = 8) -> list[str]:
    """The first ``most`` places a replay differs, then how many more there are."""
    return found[:most] + ([f"… and {len(found) - most} more"] if len(found) > most else [])


def _compare(a: object, b: object, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if TIMED.search(str(key)):
                continue
            if key not in a or key not in b:
                out.append(f"{path}.{key}: only in the {'file' if key in a else 're-run'}")
            else:
                _compare(a[key], b[key], f"{path}.{key}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items in the file, {len(b)} in the re-run")
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{path}[{i}]", out)
    elif _number(a) and _number(b):
        if not same_number(a, b):
            out.append(f"{path}: {a:.6g} in the file, {b:.6g} in the re-run")
    elif a != b:
        out.append(f"{path}: {_short(a)} in the file, {_short(b)} in the re-run")


def same_number(a: float | None, b: float | None) -> bool:
    """Whether a replay's number equals the file's: within ``CLOSE``, NaN equal to NaN, a missing one (None: no
    score) only to a missing one."""
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=CLOSE, abs_tol=CLOSE) or (math.isnan(a) and math.isnan(b))


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _short(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "…"
