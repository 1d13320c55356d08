"""Saved runs: the stamp every downloaded record carries (when, which model, which kvlab) and reading a file back."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from kvlab import __version__
from kvlab.files import decode_utf8, parse_json

MAX_RECORD_BYTES = 200 * 1024 * 1024  # a saved run with every turn's maps is a few MB; far more is not one of ours
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
