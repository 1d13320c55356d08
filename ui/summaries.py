"""Settings in words, for the pages."""

from __future__ import annotations

from kvlab.workloads.chat.budgets import budget_words
from kvlab.workloads.chat.settings import ChatSettings


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
