"""Splitting a model's chat template into the text pieces a turn-by-turn cache needs.

The multi-turn engine appends each turn's tokens to caches that carry over, so it needs the
template as increments: the opening (system block), a user block ending in the assistant's
generation prompt, and the text that closes an assistant reply. They are read off the model's
own template by rendering sentinel messages, so any incremental template works. A model without
a template (a base model) gets a plain-text format, started the way ``tokenizer(text)`` starts
a text: with its BOS where it adds one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kvlab.errors import KvlabError

_U1, _A1, _U2 = "\x00user-one\x00", "\x00assistant-one\x00", "\x00user-two\x00"

# Without a system message SmolLM2-135M-Instruct drifts into canned refusals that poison later turns;
# with this one it answers briefly and recalls what it was told. A base model in the plain format
# reads it as the transcript's first line, and Gemma-3-270M then recalls the facts as well.
DEFAULT_SYSTEM = "You are a helpful assistant. Keep answers short and use the facts the user told you."

PLAIN_DESCRIPTION = (
    "This model has no chat template, so turns are plain text — `User: …` then `Assistant: …`, "
    "one line each — and a reply ends at its first line break."
)


@dataclass(frozen=True)
class ChatFormat:
    """``opening`` + ``user_prefix``+msg+``user_suffix`` + reply + ``assistant_end`` + next user block…"""

    opening: str
    user_prefix: str
    user_suffix: str
    assistant_end: str
    start_ids: tuple[int, ...]  # token ids before the opening text (BOS), from the tokenizer itself
    stop_ids: frozenset[int]  # a reply ends before any of these
    plain: bool = False  # no chat template: the plain format PLAIN_DESCRIPTION describes

    def user_block(self, text: str) -> str:
        return f"{self.user_prefix}{text}{self.user_suffix}"


def start_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens ``tokenizer(text)`` puts before a text (its BOS); [] if it adds none.

    Read off an encoding rather than ``add_bos_token``: Gemma's tokenizer adds <bos> from its
    post-processor while reporting add_bos_token False.
    """
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i]
    return []


@functools.lru_cache(maxsize=4)
def line_break_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token whose text holds a line break (cached: a 262k vocabulary takes half a second)."""
    # vocabularies spell a newline literally, as byte-level BPE's "Ċ" or as the byte token <0x0A>
    candidates = [i for t, i in tokenizer.get_vocab().items() if "\n" in t or "Ċ" in t or "<0x0A>" in t]
    return frozenset(i for i in candidates if "\n" in tokenizer.decode([i]))


def uses_plain_format(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether this tokenizer has no chat template, so chats use the plain format (PLAIN_DESCRIPTION)."""
    return not getattr(tokenizer, "chat_template", None)


def chat_format(tokenizer: PreTrainedTokenizerBase, system: str | None) -> ChatFormat:
    """The increments of ``tokenizer``'s chat template (the plain format if it has none)."""
    eos = {tokenizer.eos_token_id} - {None}
    if uses_plain_format(tokenizer):
        # a base model continues the transcript with the next "User:" line, so a reply is one line
        return ChatFormat(opening=f"{system}\n\n" if system else "", user_prefix="User: ",
                          user_suffix="\nAssistant:", assistant_end="\n", start_ids=tuple(start_ids(tokenizer)),
                          stop_ids=frozenset(eos | line_break_ids(tokenizer)), plain=True)
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
    end = r2[len(r1 + _A1):]
    stop = eos | set(tokenizer(end.strip() or "\n", add_special_tokens=False)["input_ids"][:1])
    # a template writes its own BOS into the text (transformers tokenizes it without adding one)
    return ChatFormat(opening=opening, user_prefix=prefix, user_suffix=suffix, assistant_end=end, start_ids=(),
                      stop_ids=frozenset(stop))


@functools.lru_cache(maxsize=4)
def implicit_system(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The system message the chat template writes into a conversation that has none (SmolLM2's names the model
    and its maker), None where it writes none."""
    if uses_plain_format(tokenizer):
        return None
    bare = chat_format(tokenizer, None).opening
    sentinel = "\x00system\x00"
    before, _, after = chat_format(tokenizer, sentinel).opening.partition(sentinel)
    if len(bare) > len(before) + len(after) and bare.startswith(before) and bare.endswith(after):
        return bare[len(before): len(bare) - len(after)]
    return None
