"""RoPE drift of a cached chunk moved to another offset: the rotation each frequency pair is off by, and the q·k
score error of naive reuse, measured on a document for one layer and query head (the RAG page, CLI and report)."""

from __future__ import annotations

import numpy as np
import torch

from kvlab.engine.facts import LoadedModel
from kvlab.engine.rope import capture_qk, inverse_frequencies, qk_drift, rotation_angles
from kvlab.errors import KvlabError


def check_drift(lm: LoadedModel, layer: int, head: int) -> None:
    """Refuse a drift layer or query head that ``lm`` does not have."""
    if not 0 <= layer < lm.facts.n_layers:
        raise KvlabError(f"drift layer {layer} is out of range: {lm.facts.name} has layers 0–{lm.facts.n_layers - 1}")
    if not 0 <= head < lm.facts.n_heads:
        raise KvlabError(f"drift head {head} is out of range: {lm.facts.name} has query heads 0–{lm.facts.n_heads - 1}")


def drift_angles(lm: LoadedModel, layer: int, deltas: list[int]) -> np.ndarray:
    """[len(deltas), head_dim / 2] the rotation (radians) each frequency pair of ``layer`` is off by at each offset
    Δp: a model's layers may rotate at different frequencies (Gemma's local and global ones)."""
    return rotation_angles(inverse_frequencies(lm, layer), torch.tensor(deltas)).numpy()


def measure_drift(lm: LoadedModel, text: str, layer: int, head: int, deltas: list[int]) -> dict[str, list[float]]:
    """``qk_drift`` of ``text``'s queries and keys at ``layer`` for query ``head``, at each offset of ``deltas``."""
    check_drift(lm, layer, head)
    q, k = capture_qk(lm, lm.encode(text), layer)
    return qk_drift(lm, q, k, head, deltas, layer=layer)
