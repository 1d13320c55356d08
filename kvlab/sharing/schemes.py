"""Cross-layer K/V sharing layouts: which layer's K/V each layer attends to.

- ``full``: every layer makes and keeps its own K/V.
- ``claK`` (Cross-Layer Attention, group size K): layers are split into groups of K adjacent
  layers; the first layer of each group produces K/V, the others reuse it. ``cla1`` is ``full``.
- ``yoco`` (You Only Cache Once): the lower half computes everything; the middle layer's K/V
  projection of the lower half's output is the one global K/V that every upper layer attends to.
  Because no upper layer writes K/V, a prefill only needs the upper half for the last token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from kvlab.errors import KvlabError
from kvlab.lists import split_items
from kvlab.registry import Registry


@dataclass(frozen=True)
class Scheme:
    """A sharing layout for ``n_layers`` layers.

    ``producers[l]`` is the layer whose K/V layer ``l`` attends to (``l`` itself when it makes its
    own). Layers from ``upper_start`` on (YOCO only) run at prefill for the last positions only.
    """

    name: str
    label: str
    producers: tuple[int, ...]
    upper_start: int | None = None

    @property
    def n_layers(self) -> int:
        return len(self.producers)

    @property
    def kv_layers(self) -> int:
        """How many layers compute and store K/V."""
        return len(set(self.producers))

    def produces(self, layer: int) -> bool:
        return self.producers[layer] == layer

    @property
    def claim_share(self) -> float:
        """The notes' claim: re-prefill cost ∝ layers that compute K/V, i.e. O(N_layers / ratio)."""
        return self.kv_layers / self.n_layers


class SchemeFamily:
    """A family of sharing layouts: its names, its label and which layer's K/V each layer attends to.

    A parametrised family (CLA) takes a group size K and names its schemes ``name + K`` (cla2, cla3, …);
    ``label`` names the family, ``label_of(k)`` one of its schemes.
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    parametrised: ClassVar[bool] = False
    offered: ClassVar[tuple[str, ...]] = ()  # the schemes the page and the command line offer by default
    names_hint: ClassVar[str] = ""  # how the family's names read, for error messages

    def label_of(self, k: int | None) -> str:
        raise NotImplementedError

    def layout(self, n_layers: int, k: int | None) -> tuple[tuple[int, ...], int | None]:
        """(producer of each layer, first layer that runs for the last positions only, or None)."""
        raise NotImplementedError

    def build(self, n_layers: int, k: int | None = None) -> Scheme:
        producers, upper_start = self.layout(n_layers, k)
        return Scheme(self.name if k is None else f"{self.name}{k}", self.label_of(k), producers, upper_start)


class FullFamily(SchemeFamily):
    name, label, summary, names_hint = "full", "Full", "every layer makes and keeps its own K/V", "full"

    def label_of(self, k: int | None) -> str:
        return "Full"

    def layout(self, n_layers: int, k: int | None) -> tuple[tuple[int, ...], int | None]:
        return tuple(range(n_layers)), None


class CLAFamily(SchemeFamily):
    name, label, summary = "cla", "CLA-K", "groups of K adjacent layers share the first one's K/V"
    names_hint = "cla1, cla2, …"
    parametrised = True
    offered = ("cla2", "cla3", "cla4")

    def label_of(self, k: int | None) -> str:
        return f"CLA-{k}"

    def layout(self, n_layers: int, k: int | None) -> tuple[tuple[int, ...], int | None]:
        if k > n_layers:
            raise KvlabError(f"CLA-{k} needs at least {k} layers; the model has {n_layers}")
        return tuple((layer // k) * k for layer in range(n_layers)), None


class YOCOFamily(SchemeFamily):
    name, label, summary = "yoco", "YOCO", "the upper half attends to one K/V made from the lower half's output"
    names_hint = "yoco"
    offered = ("yoco",)

    def label_of(self, k: int | None) -> str:
        return "YOCO"

    def layout(self, n_layers: int, k: int | None) -> tuple[tuple[int, ...], int | None]:
        if n_layers < 2:
            raise KvlabError("YOCO needs at least two layers")
        mid = n_layers // 2
        return tuple(layer if layer < mid else mid for layer in range(n_layers)), mid


SCHEME_FAMILIES: Registry[SchemeFamily] = Registry("sharing scheme family", (FullFamily(), CLAFamily(), YOCOFamily()))
OFFERED_SCHEMES: tuple[str, ...] = tuple(n for f in SCHEME_FAMILIES.values() for n in f.offered)


def _family(name: str) -> tuple[SchemeFamily, int | None]:
    """The family a scheme name belongs to and its group size (None unless parametrised)."""
    key = name.strip().lower().replace("-", "")
    match = re.fullmatch(r"([a-z]+)(\d*)", key)
    family = SCHEME_FAMILIES.get(match.group(1)) if match else None
    if family is not None and family.parametrised == bool(match.group(2)):
        k = int(match.group(2)) if family.parametrised else None
        if k is None or k >= 1:
            return family, k
    hints = [f.names_hint for f in SCHEME_FAMILIES.values()]
    raise KvlabError(f"unknown sharing scheme {name!r}; use {', '.join(hints[:-1])} or {hints[-1]}")


def scheme_label(name: str) -> str:
    """The label of a scheme name (``cla2`` → ``CLA-2``) without building its layout."""
    family, k = _family(name)
    return family.label_of(k)


def make_scheme(name: str, n_layers: int) -> Scheme:
    """Build a scheme from a registered family's name: ``full``, ``claK`` (K ≥ 1) or ``yoco``."""
    family, k = _family(name)
    return family.build(n_layers, k)


def parse_schemes(spec: str, n_layers: int) -> list[Scheme]:
    """Comma-separated scheme names (``cla2,cla3,yoco``), duplicates dropped, order kept."""
    names = split_items(spec, "sharing schemes")
    if not names:
        raise KvlabError("no sharing scheme given; use e.g. cla2,cla3,yoco")
    schemes: dict[str, Scheme] = {}
    for part in names:
        scheme = make_scheme(part, n_layers)
        schemes.setdefault(scheme.name, scheme)
    return list(schemes.values())
