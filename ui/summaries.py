"""Settings in words, for the pages."""

from __future__ import annotations

from kvlab.workloads.chat.settings import ChatSettings


def settings_summary(settings: ChatSettings, system: str | None, implicit: str | None = None) -> str:
    """The settings a conversation runs with, in one line of Markdown; ``implicit``: the system message the model's
    chat template writes where the conversation gives none (``chatformat.implicit_system``)."""
    def params(values: dict) -> str:
        return f" ({', '.join(f'{k}={v}' for k, v in values.items())})" if values else ""

    policies = ", ".join(f"{name}{params(settings.params.get(name, {}))}" for name in settings.policies)
    said = (f"“{system}”" if system else f"none given, so the chat template writes its own: “{implicit}”" if implicit
            else "none")
    own = "".join(f", {name} {b}" for name, b in settings.policy_budgets.items())
    budget = (f"{settings.budget_percent:g} % of Full's K/V bytes at each turn" if settings.budget_percent is not None
              else f"{settings.budget_mib:g} MiB of K/V: {settings.budget}{own} tokens per layer per KV head"
              if settings.budget_mib is not None else f"{settings.budget}{own} tokens per layer per KV head")
    return (f"**Policies** {policies} · **budget** {budget} · **blocks** of "
            f"{settings.block_size} · **positions** {settings.position_mode} · **replies** up to "
            f"{settings.max_new_tokens} tokens · **system message** {said}")
