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

from kvlab.errors import KvlabError


@dataclass(frozen=True)
class Scheme:
    """A sharing layout for ``n_layers`` layers.

    ``producers[l]`` is the layer whose K/V layer ``l`` attends to (``l`` itself when it makes its
    own). Layers from ``upper_start`` on (YOCO only) run at prefill for the last positions only.
    """

    name: str
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

    @property
    def label(self) -> str:
        if self.name == "full":
            return "Full"
        if self.name == "yoco":
            return "YOCO"
        return f"CLA-{self.name[3:]}"


def make_scheme(name: str, n_layers: int) -> Scheme:
    """Build a scheme from ``full``, ``claK`` (K ≥ 1) or ``yoco``."""
    key = name.strip().lower().replace("-", "")
    if key == "full":
        return Scheme("full", tuple(range(n_layers)))
    if key == "yoco":
        if n_layers < 2:
            raise KvlabError("YOCO needs at least two layers")
        mid = n_layers // 2
        return Scheme("yoco", tuple(l if l < mid else mid for l in range(n_layers)), upper_start=mid)
    match = re.fullmatch(r"cla(\d+)", key)
    if not match or int(match.group(1)) < 1:
        raise KvlabError(f"unknown sharing scheme {name!r}; use full, cla1, cla2, … or yoco")
    k = int(match.group(1))
    if k > n_layers:
        raise KvlabError(f"CLA-{k} needs at least {k} layers; the model has {n_layers}")
    return Scheme(f"cla{k}", tuple((l // k) * k for l in range(n_layers)))


def parse_schemes(spec: str, n_layers: int) -> list[Scheme]:
    """Comma-separated scheme names (``cla2,cla3,yoco``), duplicates dropped, order kept."""
    names = [part for part in (p.strip() for p in spec.split(",")) if part]
    if not names:
        raise KvlabError("no sharing scheme given; use e.g. cla2,cla3,yoco")
    schemes: dict[str, Scheme] = {}
    for part in names:
        scheme = make_scheme(part, n_layers)
        schemes.setdefault(scheme.name, scheme)
    return list(schemes.values())
