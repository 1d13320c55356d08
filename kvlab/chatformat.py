"""Splitting a model's chat template into the text pieces a turn-by-turn cache needs.

The multi-turn engine appends each turn's tokens to caches that carry over, so it needs the
template as increments: the opening (system block), a user block ending in the assistant's
generation prompt, and the text that closes an assistant reply. They are read off the model's
own template by rendering sentinel messages, so any incremental template works.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kvlab.errors import KvlabError

_U1, _A1, _U2 = "\x00user-one\x00", "\x00assistant-one\x00", "\x00user-two\x00"


@dataclass(frozen=True)
class ChatFormat:
    """``opening`` + ``user_prefix``+msg+``user_suffix`` + reply + ``assistant_end`` + next user block…"""

    opening: str
    user_prefix: str
    user_suffix: str
    assistant_end: str

    def user_block(self, text: str) -> str:
        return f"{self.user_prefix}{text}{self.user_suffix}"


def chat_format(tokenizer: PreTrainedTokenizerBase, system: str | None) -> ChatFormat:
    """The increments of ``tokenizer``'s chat template (a plain User:/Assistant: format if it has none)."""
    if not getattr(tokenizer, "chat_template", None):
        return ChatFormat(opening=f"{system}\n\n" if system else "", user_prefix="User: ",
                          user_suffix="\nAssistant:", assistant_end="\n")
    head = [{"role": "system", "content": system}] if system else []

    def render(messages: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(head + messages, add_generation_prompt=gen, tokenize=False)

    r1 = render([{"role": "user", "content": _U1}], True)
    r2 = render([{"role": "user", "content": _U1}, {"role": "assistant", "content": _A1}], False)
    r3 = render([{"role": "user", "content": _U1}, {"role": "assistant", "content": _A1},
                 {"role": "user", "content": _U2}], True)
    if not (r2.startswith(r1 + _A1) and r3.startswith(r2)):
        raise KvlabError("this model's chat template is not incremental; kvlab cannot carry its cache across turns")
    block = r3[len(r2):]
    prefix, _, suffix = block.partition(_U2)
    opening, _, _ = r1.rpartition(prefix + _U1)
    return ChatFormat(opening=opening, user_prefix=prefix, user_suffix=suffix, assistant_end=r2[len(r1 + _A1):])
