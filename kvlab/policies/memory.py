"""Byte budgets: for each policy, the most tokens it may keep so that its cache never holds more bytes.

A token budget means different memory for different policies: KIVI at 4 bits stores a token in about
a fifth of the bytes, PyramidKV's integer floors keep slightly more than the budget. A byte budget
gives every policy the largest token budget whose *worst case* after compression fits, computed with
the same byte formulas that count what a cache holds (``ModelFacts.kv_bytes``, ``Kivi.layer_bytes``),
so the bytes measured after a turn never exceed it. Policies that keep every token are not bounded by
it: Full and KIVI without eviction hold what the conversation holds (their measured bytes say so), and
Quest, which keeps everything, reads at most that many tokens' keys and values per query in its
sparse layers (its page metadata and dense layers come on top, measured as bytes read).

A budget of a % of Full's K/V bytes is converted the same way before every compression (``share_tokens``), from
the bytes Full holds then, so it grows with the conversation.
"""

from __future__ import annotations

import functools

from kvlab.engine.facts import ModelFacts
from kvlab.engine.quantization import Kivi
from kvlab.errors import KvlabError
from kvlab.policies.base import Policy

MIB = 1 << 20


@functools.lru_cache(maxsize=1 << 16)
def kivi_worst_bytes(quant: Kivi, slots: int, facts: ModelFacts, seen: int | None = None) -> int:
    """The most bytes one layer of ``slots`` slots per KV head can hold under ``quant`` after an append.

    After quantizing, fewer than one key chunk (``residual``, or ``group`` when 0) and at most
    ``residual`` values per head stay in full precision; every split of the full-precision keys over
    the heads is tried, as the scales' count (``⌊quantized keys / group⌋``) is not linear. Without ``seen``
    quantized keys are counted in whole groups; a group an eviction cuts keeps its min and max while one of its
    keys stays (``engine/packed.py``), so a cache evicting out of quantized groups may hold a few more
    (measured). With ``seen``, the tokens the conversation has had, cut groups are bounded too: each key is
    quantized once, in a group of ``group`` keys, so a head holds keys of at most ``⌊seen / group⌋`` groups.
    """
    heads, d, e = facts.n_kv_heads, facts.head_dim, facts.bytes_per_element
    unit = quant.residual or quant.group
    v_full = heads * min(slots, quant.residual)
    v_q = heads * slots - v_full
    worst = 0
    for k_full in range(heads * min(slots, unit - 1) + 1):
        k_q = heads * slots - k_full
        groups = k_q // quant.group
        if seen is not None:  # cut groups: as many as a key each, up to those the conversation could fill
            groups = max(groups, min(k_q, heads * (seen // quant.group)))
        held = quant.held_bytes(k_full + v_full, k_q + v_q, groups, v_q, d, quant.group, quant.bits, e)
        worst = max(worst, held)
    return worst


def held_bound(policy: Policy, budget: int, facts: ModelFacts, seen: int | None = None) -> int | None:
    """The most bytes ``policy`` holds after compressing to ``budget`` tokens per layer and KV head (None: it
    keeps every token, so no budget bounds what it holds); ``seen``, the conversation's tokens so far, bounds the
    quantized groups an eviction may have cut (``kivi_worst_bytes``)."""
    if policy.keeps_growing():
        return None
    per_layer = policy.layer_budgets(budget, facts.n_layers)
    quant = policy.quantizer()
    if quant is None or not quant.active:
        return facts.kv_bytes(sum(per_layer), layers=1)
    return sum(kivi_worst_bytes(quant, b, facts, seen) for b in per_layer)


def whole_bytes(policy: Policy, tokens: int, facts: ModelFacts) -> int:
    """The most bytes ``policy`` holds keeping ``tokens`` tokens in every layer and KV head, the whole conversation
    (nothing evicted now; KIVI's groups an earlier eviction cut are counted as ``kivi_worst_bytes`` does)."""
    quant = policy.quantizer()
    if quant is None or not quant.active:
        return facts.kv_bytes(tokens)
    return facts.n_layers * kivi_worst_bytes(quant, tokens, facts, tokens)


def tokens_within(policy: Policy, nbytes: int, facts: ModelFacts, context_length: int,
                  said: str | None = None) -> int:
    """The token budget ``policy`` runs with under a byte budget of ``nbytes`` (capped at the model's context,
    where every budget keeps everything); refused in words when even the policy's minimum does not fit.
    ``said`` is the budget as the user gave it, for that message."""
    tokens = _fitting(policy, nbytes, facts, context_length)
    if tokens < policy.min_budget():
        said = said or f"{nbytes / MIB:.3g} MiB"
        least = policy.min_budget()
        raise KvlabError(f"{policy.name}: {said} of K/V does not hold its minimum budget of {least} "
                         f"token{'s' * (least != 1)} per layer and KV head")
    return tokens


def share_tokens(policy: Policy, percent: float, full_bytes: int, full_tokens: int, facts: ModelFacts) -> int:
    """The token budget ``policy`` compresses to under a budget of ``percent`` % of the ``full_bytes`` Full holds
    now, over ``full_tokens`` tokens (a budget past them keeps everything, so none is larger). Where that share
    does not hold the policy's minimum it keeps its minimum: it then holds more than its budget, which the rows
    show (bytes held against ``budget_kib``), rather than stopping the conversation."""
    tokens = _fitting(policy, int(full_bytes * percent / 100), facts, max(full_tokens, 1), full_tokens)
    return max(tokens, policy.min_budget())


def _fitting(policy: Policy, nbytes: int, facts: ModelFacts, cap: int, seen: int | None = None) -> int:
    """The largest token budget up to ``cap`` whose worst case (after ``seen`` tokens, where known) fits in
    ``nbytes``; below the policy's minimum when even that does not fit."""
    least = policy.min_budget()
    if policy.keeps_growing():  # keeps everything (or some heads do): at most that many tokens' K/V read per query
        tokens = min(nbytes // facts.kv_bytes(1), cap)
        return max(tokens, least) if policy.reads(least) is None else tokens  # None: no budget shapes it
    return _largest_fitting(policy, nbytes, facts, least, max(least, cap), seen)


def _largest_fitting(policy: Policy, nbytes: int, facts: ModelFacts, low: int, high: int,
                     seen: int | None = None) -> int:
    """The largest budget in [low, high] whose worst case fits in ``nbytes`` (``low − 1`` when none does)."""
    def fits(budget: int) -> bool:
        return held_bound(policy, budget, facts, seen) <= nbytes

    if len(set(policy.layer_budgets(high, facts.n_layers))) > 1:
        # PyramidKV's integer pyramid can hold less at a larger budget (30 layers: 1800 slots at 46, 1425 at
        # 47), so a bisection could stop below the largest fit: every budget is tried, largest first
        return next((b for b in range(high, low - 1, -1) if fits(b)), low - 1)
    if not fits(low):  # a uniform allocation holds more with every token of budget: bisect
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
