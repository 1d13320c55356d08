"""One registry shape: named entries, each with a label and a summary, looked up with an error that lists the choices.

Policies, RAG strategies, sharing scheme families, lessons, reply metrics, budget units, SCBench tasks and RULER's
families and tasks are all ``Registry`` objects. An entry is anything (a class or an instance) with ``name``,
``label`` and ``summary`` strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Callable, Generic, TypeVar

from kvlab.errors import KvlabError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Entries by name, in the order they were added; an unknown name is a ``KvlabError`` naming the choices.

    ``kind`` words the error (``unknown policy 'x'; choose from …``); ``normalise`` maps what a user typed
    to a registered name (policies: ``str.strip().lower()``).
    """

    def __init__(self, kind: str, entries: Iterable[T] = (), normalise: Callable[[str], str] = str) -> None:
        self.kind = kind
        self.normalise = normalise
        self._entries: dict[str, T] = {}
        for entry in entries:
            self.add(entry)

    def add(self, entry: T) -> T:
        """Register ``entry`` under its name; a missing name, label or summary, or a name taken, is refused."""
        for attr in ("name", "label", "summary"):
            value = getattr(entry, attr, None)
            if not isinstance(value, str) or not value.strip():
                raise KvlabError(f"a {self.kind} needs a non-empty {attr} (text), not {value!r}")
        if entry.name in self._entries:
            raise KvlabError(f"the {self.kind} name {entry.name!r} is taken")
        self._entries[entry.name] = entry
        return entry

    def remove(self, name: str) -> None:
        """Take ``name``'s entry out (plug-ins unloaded)."""
        del self._entries[self.key(name)]

    def _normal(self, name: object) -> object:
        return self.normalise(name) if isinstance(name, str) else name

    def key(self, name: str) -> str:
        """The registered name ``name`` stands for; a ``KvlabError`` listing the choices if none."""
        key = self._normal(name)
        if key not in self._entries:
            raise KvlabError(f"unknown {self.kind} {name!r}; choose from {self.choices()}")
        return key

    def choices(self) -> str:
        """The registered names, comma-separated, for messages and help texts."""
        return ", ".join(self._entries)

    def labels(self) -> dict[str, str]:
        """Name → label of every entry."""
        return {name: entry.label for name, entry in self._entries.items()}

    def label(self, name: str) -> str:
        """The label of ``name``, or the name itself where none is registered (a record from elsewhere)."""
        entry = self._entries.get(name)
        return entry.label if entry is not None else name

    def __getitem__(self, name: str) -> T:
        return self._entries[self.key(name)]

    def __contains__(self, name: object) -> bool:
        return self._normal(name) in self._entries

    def get(self, name: str, default: T | None = None) -> T | None:  # type: ignore[override]
        return self._entries.get(self._normal(name), default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {self.choices()})"
