"""The RAG prompt as token segments: [prefix] [doc 1] … [doc k] [question + answer start].

Each segment is tokenised on its own, so a document's tokens are the same whether it is
prefilled alone (the chunk store) or inside the prompt (full prefill): strategies differ only
in how the KV of those tokens is obtained. The prefix is the chat template up to the user turn
with the system text; the question segment closes the user turn, opens the assistant turn and
starts the answer for the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.engine.chatformat import start_ids, uses_plain_format
from kvlab.engine.facts import LoadedModel
from kvlab.workloads.rag.corpus import Corpus, Question

_MARK = "\x00KVLAB_USER\x00"


@dataclass(frozen=True)
class Layout:
    """Token segments of one prompt and where each starts in the full sequence."""

    prefix: tuple[int, ...]
    doc_ids: tuple[str, ...]
    docs: tuple[tuple[int, ...], ...]
    question: tuple[int, ...]

    @property
    def doc_offsets(self) -> list[int]:
        offsets, pos = [], len(self.prefix)
        for doc in self.docs:
            offsets.append(pos)
            pos += len(doc)
        return offsets

    @property
    def context_len(self) -> int:
        """Tokens before the question (prefix + documents)."""
        return len(self.prefix) + sum(len(d) for d in self.docs)

    @property
    def doc_span(self) -> tuple[int, int]:
        return len(self.prefix), self.context_len

    @property
    def ids(self) -> list[int]:
        out = list(self.prefix)
        for doc in self.docs:
            out.extend(doc)
        return out + list(self.question)

    def __len__(self) -> int:
        return self.context_len + len(self.question)


def template_parts(lm: LoadedModel, system: str) -> tuple[str, str]:
    """Chat-template text before and after the user message (a plain layout without a template)."""
    if getattr(lm.tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": _MARK}]
        text = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if _MARK in text:
            head, _, tail = text.partition(_MARK)
            return head, tail
    return f"{system}\n\nUser: ", "\nAssistant: "


def doc_text(corpus: Corpus, doc_id: str) -> str:
    """A document as it appears in the prompt and in the chunk store."""
    doc = corpus.doc(doc_id)
    return f"Document {doc.id}: {doc.title}\n{doc.text}\n\n"


def build_layout(lm: LoadedModel, corpus: Corpus, doc_ids: list[str], question: Question) -> Layout:
    """Tokenise the prompt for ``question`` over ``doc_ids`` in the given order."""
    head, tail = template_parts(lm, corpus.system)
    q_text = f"Question: {question.question.strip()}{tail}"
    if question.answer_prefix:
        q_text += question.answer_prefix
    prefix = lm.encode(head)
    if uses_plain_format(lm.tokenizer):  # a template writes its own BOS into the text
        prefix = start_ids(lm.tokenizer) + prefix
    return Layout(
        prefix=tuple(prefix),
        doc_ids=tuple(doc_ids),
        docs=tuple(tuple(lm.encode(doc_text(corpus, d))) for d in doc_ids),
        question=tuple(lm.encode(q_text)),
    )
