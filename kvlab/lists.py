"""The one reader of a comma-separated list a user typed: policies, budgets, sink counts, sharing schemes."""

from __future__ import annotations

from kvlab.errors import KvlabError


def split_items(text: str, what: str) -> tuple[str, ...]:
    """``text``'s comma-separated items, stripped, none at all for a blank text; an empty item between two others
    (``16,,32``: a number left out?) is refused."""
    parts = [part.strip() for part in str(text).split(",")]
    while parts and not parts[-1]:
        parts.pop()
    while parts and not parts[0]:
        parts.pop(0)
    if not all(parts):
        raise KvlabError(f"{what} {text!r} has an empty item between two commas")
    return tuple(parts)
