"""Each policy's budget at a compression, whatever unit it was given in: the tokens it compresses to and the bytes
they allow.

One path for every unit. Tokens: the settings' number (a policy's own where ``policy_budgets`` holds one: the
tokens a MiB budget gave it). A % of Full's K/V bytes: before every compression, that share of the bytes Full's
cache holds then (a sliding layer holds only its window) becomes the policy's token budget through the same
worst-case byte bound as a MiB budget (``memory.share_tokens``), so the budget grows with the conversation and no
measured turn holds more than the share, except a policy whose minimum the share cannot hold yet: it keeps its
minimum and its rows show it over its budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvlab.engine.facts import ModelFacts
from kvlab.engine.kvstate import KVState
from kvlab.errors import KvlabError
from kvlab.policies import Policy, make_policy
from kvlab.policies.memory import MIB, share_tokens, tokens_within, whole_bytes
from kvlab.registry import Registry
from kvlab.workloads.chat.settings import ChatSettings


@dataclass(frozen=True)
class BudgetUnit:
    """A unit budgets are given in: its short name (an axis title's), what a budget of it counts, in words, what its
    numbers are, one of them, and an example list of them (for refusals)."""

    name: str
    label: str
    summary: str
    numbers: str
    one: str  # one such number, for a refusal of one budget
    example: str


# tokens: every policy keeps that many tokens per layer and KV head. mib: MiB of K/V the whole cache may hold; each
# policy gets the most tokens whose worst case fits (kvlab.policies.memory), so a 4-bit cache keeps more tokens than a
# full-precision one at the same memory. percent: at every compression, each policy may hold that % of the K/V bytes
# Full holds at that point of the conversation, converted to tokens as MiB are: a budget that grows with it
BUDGET_UNITS: Registry[BudgetUnit] = Registry("budget unit", (
    BudgetUnit("tokens", "tokens", "tokens per layer per KV head", "whole numbers of tokens",
               "a whole number of tokens", "64,128,256,512"),
    BudgetUnit("mib", "MiB", "MiB of K/V held at most", "numbers of MiB", "a number of MiB", "2.5,5,10 (MiB)"),
    BudgetUnit("percent", "% of Full's K/V bytes", "% of Full's K/V bytes at each turn",
               "numbers (% of Full's K/V bytes)", "a number (% of Full's K/V bytes)",
               "12.5,25,50 (% of Full's K/V bytes)"),
))
# what a % budget means, for help texts (pages and CLI)
PERCENT_HELP = ("percent: each policy may hold at most that % of the K/V bytes Full holds at the same point of the "
                "conversation, so the budget grows with it: before every compression the share of what Full holds "
                "then becomes the most tokens whose worst case fits (4 bits keep more). A policy whose minimum the "
                "share cannot hold keeps its minimum and is marked over its budget; Full, Quest and KIVI without "
                "eviction keep every token, and DuoAttention's heads keep sizes of their own. Nothing is evicted "
                "while the whole conversation fits.")


# the token budget of settings whose MiB budget ``mib_settings`` has yet to convert: no policy's minimum refuses it
UNCONVERTED = 1 << 30


def check_mib(mib: float) -> None:
    """Refuse a MiB budget no model can hold, before any model work."""
    if not math.isfinite(mib) or mib <= 0:
        raise KvlabError(f"a budget must be more than 0 MiB, not {mib:g}")


def mib_settings(settings: ChatSettings, mib: float, facts: ModelFacts) -> ChatSettings:
    """``settings`` (made with ``UNCONVERTED`` tokens) at a budget of ``mib`` MiB of K/V: each policy the most tokens
    whose worst case fits (``memory.tokens_within``, capped at the context), refused in words where a policy's
    minimum does not."""
    check_mib(mib)
    whole = facts.kv_bytes(facts.context_length) / MIB  # Full's K/V over the whole context: every budget past it is one
    if mib > whole:
        raise KvlabError(f"budget {mib:g} MiB exceeds the K/V the model holds over its whole context ({whole:.3g} MiB "
                         f"for {facts.context_length} tokens)")
    tokens = {name: tokens_within(make_policy(name, **settings.params[name]), int(mib * MIB), facts,
                                  facts.context_length, f"{mib:g} MiB") for name in settings.policies}
    base = tokens["full"]  # Full keeps everything at any budget: its number is what the bytes hold unquantized
    return replace(settings, budget=base, policy_budgets={n: t for n, t in tokens.items() if t != base},
                   budget_mib=mib, budget_percent=None)


def budget_free(policies: tuple[str, ...], params: dict[str, dict]) -> list[str]:
    """The policies besides Full that no budget reaches (``Policy.budget_free``: KIVI without eviction, DuoAttention's
    retrieval heads), with ``params`` their parameters."""
    return [n for n in policies if n != "full" and make_policy(n, **params.get(n, {})).budget_free()]


def budget_words(settings: ChatSettings) -> str:
    """The budget in words: its unit, each policy's tokens where a MiB budget gave them their own ("113 (h2o,
    snapkv), 928 (kivi)"), and the policies no budget bounds (KIVI without eviction, DuoAttention's retrieval heads),
    so that a MiB or token cap is not read as holding them too."""
    others = [n for n in settings.policies if n != "full"]
    free = budget_free(settings.policies, settings.params)
    unbounded = f"; {', '.join(free)}: no budget bounds what {'it keeps' if len(free) == 1 else 'they keep'}" \
        if free else ""
    if settings.budget_percent is not None:
        return f"{settings.budget_percent:g} % of Full's K/V bytes at each turn{unbounded}"
    tokens: dict[int, list[str]] = {}
    for name in others:
        if name not in free:
            tokens.setdefault(settings.budget_of(name), []).append(name)
    each = ", ".join(f"{t} ({', '.join(names)})" for t, names in tokens.items()) if len(tokens) > 1 else \
        str(next(iter(tokens), settings.budget))
    held = f"{settings.budget_mib:g} MiB of K/V: " if settings.budget_mib is not None else ""
    return f"{held}{each} tokens per layer per KV head{unbounded}"


@dataclass(frozen=True)
class Budget:
    """One policy's budget at one compression."""

    tokens: int  # per layer and KV head
    layers: list[int]  # its split over the layers (PyramidKV's pyramid; Full's and Quest's unbounded)
    allowed: int | None  # K/V bytes it may hold; None: it keeps every token, no budget bounds what it holds
    by_bytes: bool  # given in bytes (MiB, a % of Full's): the conversation fits when its bytes do
    shown: int | None  # ``tokens`` as its rows show them; None where no budget shapes the policy (Full, KIVI
    # without eviction, DuoAttention: it keeps every token, or every token in some heads, whatever the budget)

    def fits(self, policy: Policy, tokens: int, facts: ModelFacts) -> bool:
        """Whether a conversation of ``tokens`` tokens fits the budget whole: then nothing is evicted (PyramidKV's
        pyramid would otherwise cut its top layers of a conversation shorter than its budget)."""
        if self.allowed is None:
            return False
        return whole_bytes(policy, tokens, facts) <= self.allowed if self.by_bytes else tokens <= self.tokens


def budget_now(settings: ChatSettings, name: str, policy: Policy, full: KVState) -> Budget:
    """The budget ``policy`` (named ``name`` in ``settings``) compresses to now, with Full's cache ``full`` as it
    is now."""
    facts, percent = full.lm.facts, settings.budget_percent
    if percent is None:
        tokens = settings.budget_of(name)
    else:
        tokens = share_tokens(policy, percent, full.kv_bytes(), full.seen, facts)
    if policy.keeps_growing():
        allowed = None
    elif percent is not None:
        allowed = int(full.kv_bytes() * percent / 100)
    elif settings.budget_mib is not None:
        allowed = int(settings.budget_mib * MIB)
    else:  # those tokens at the model's precision
        allowed = facts.kv_bytes(tokens)
    by_bytes = percent is not None or settings.budget_mib is not None
    shown = None if policy.keeps_growing() and policy.reads(tokens) is None else tokens  # Quest: what a query reads
    return Budget(tokens, policy.layer_budgets(tokens, facts.n_layers), allowed, by_bytes, shown)
