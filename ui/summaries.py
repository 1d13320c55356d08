"""Settings in words, for the pages."""

from __future__ import annotations

from kvlab.policies import make_policy
from kvlab.workloads.chat.settings import ChatSettings


def budget_words(settings: ChatSettings) -> str:
    """The budget in words: its unit, each policy's tokens where a MiB budget gave them their own ("113 (h2o,
    snapkv), 928 (kivi)"), and the policies no budget bounds (KIVI without eviction, DuoAttention's retrieval heads),
    so that a MiB or token cap is not read as holding them too."""
    others = [n for n in settings.policies if n != "full"]
    free = [n for n in others if make_policy(n, **settings.params.get(n, {})).budget_free()]
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


def settings_summary(settings: ChatSettings, system: str | None, implicit: str | None = None) -> str:
    """The settings a conversation runs with, in one line of Markdown; ``implicit``: the system message the model's
    chat template writes where the conversation gives none (``chatformat.implicit_system``)."""
    def params(values: dict) -> str:
        return f" ({', '.join(f'{k}={v}' for k, v in values.items())})" if values else ""

    policies = ", ".join(f"{name}{params(settings.params.get(name, {}))}" for name in settings.policies)
    said = (f"“{system}”" if system else f"none given, so the chat template writes its own: “{implicit}”" if implicit
            else "none")
    budget = budget_words(settings)
    return (f"**Policies** {policies} · **budget** {budget} · **blocks** of "
            f"{settings.block_size} · **positions** {settings.position_mode} · **replies** up to "
            f"{settings.max_new_tokens} tokens · **system message** {said}")
