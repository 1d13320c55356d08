"""RULER's synthetic tasks (Hsieh et al., 2024), generated locally as kvlab conversations, seeded.

Task names, arguments, templates and answer prefixes follow NVIDIA/RULER ``scripts/synthetic.yaml`` and
``scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,freq_words_extraction}.py`` and
``constants.py``: the needle-in-a-haystack family (``niah_single_1..3``, ``niah_multikey_1..3``,
``niah_multivalue``, ``niah_multiquery``), variable tracking (``vt``), common- and frequent-words extraction
(``cwe``, ``fwe``). RULER's essays (Paul Graham's, downloaded) are replaced by the RAG corpus that ships
with kvlab, and wonderwords' word lists by the short lists of ``ruler_text.py`` and the corpus's own words; the rules
(needle sentences, depths, chains, repeat counts, Zipf counts) are RULER's. A sample is as long as the
haystack can be with ``length`` tokens or fewer, counted as RULER counts them (every question with its
answer prefix, plus the task's tokens to generate) with the caller's tokenizer.

Two variants: RULER's own (one turn: the context and every query, the answer prefix given to the model)
and multi-turn (SCBench-style: turn 1 is the context with the first query, each later query one turn).
Every turn is scored by RULER's ``string_match_all`` (the ``contains`` metric: every reference occurs).

Each family (how it drafts and asks, ``ruler_text.py``; its tokens to generate) is a ``RulerFamily`` and each task
(its family and arguments) a ``RulerTask``, in the two registries ``FAMILIES`` and ``TASKS``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from kvlab.errors import KvlabError
from kvlab.registry import Registry
from kvlab.workloads.chat.conversation import MAX_TURNS, Conversation, Turn
from kvlab.workloads.chat.ruler_text import (
    DEPTHS,
    Draft,
    Query,
    cwe_draft,
    cwe_question,
    fwe_draft,
    fwe_question,
    niah_draft,
    niah_question,
    vt_draft,
    vt_question,
)

MAX_LENGTH = 131_072  # RULER's longest configuration (128k); a haystack past it only takes time to build

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Needle:
    """A planted sentence: its text, its character offset in turn 1's message and its first token's position."""

    text: str
    char: int
    token: int


@dataclass(frozen=True)
class RulerSample:
    """One generated sample: the conversation, where its needles are, and its length in tokens."""

    task: str
    index: int
    seed: int
    tokens: int  # as RULER counts: every turn's message and answer prefix, plus tokens to generate per turn
    conversation: Conversation
    needles: tuple[Needle, ...]

    def manifest(self) -> dict:
        """The sample's record for ``manifest.jsonl``: what the generator planted and where."""
        return {"name": self.conversation.name, "task": self.task, "index": self.index, "seed": self.seed,
                "tokens": self.tokens, "answers": [t.answer.split("\n") for t in self.conversation.turns],
                "needles": [vars(n) for n in self.needles]}


Drafts = Callable[[random.Random, int, dict, int, int], Draft]  # (rng, haystack size, args, queries, length)
Asks = Callable[[dict, tuple[Query, ...], Draft, bool], tuple[str, str]]  # (args, queries, draft, turn 1?)


@dataclass(frozen=True)
class RulerFamily:
    """A family of RULER tasks: how it drafts a sample at a haystack size and asks its queries (its script under
    ``scripts/data/synthetic/``), and the tokens to generate that its length counts (``constants.py``)."""

    name: str
    label: str
    summary: str
    tokens_to_generate: int
    draft: Drafts
    ask: Asks
    one_question: bool = False  # asks one question, whatever the arguments: no more queries, no multi-turn variant


FAMILIES: Registry[RulerFamily] = Registry("RULER family", (
    RulerFamily("niah", "Needle in a haystack", "the values planted under keys in a haystack", 128,
                lambda rng, n, a, n_q, length: niah_draft(rng, n, a, n_q),
                lambda a, queries, draft, first: niah_question(a, queries, draft.context if first else None)),
    RulerFamily("vt", "Variable tracking", "the variables a chain of assignments gives one value", 30,
                lambda rng, n, a, n_q, length: vt_draft(rng, n, a, n_q), vt_question),
    RulerFamily("cwe", "Common words", "the 10 most common words of a numbered list", 120,
                lambda rng, n, a, n_q, length: cwe_draft(rng, n, a, length), cwe_question, one_question=True),
    RulerFamily("fwe", "Frequent words", "the 3 most frequent coded words of a Zipf-distributed text", 50,
                lambda rng, n, a, n_q, length: fwe_draft(rng, n, a, length), fwe_question, one_question=True),
))


@dataclass(frozen=True)
class RulerTask:
    """One of RULER's tasks: its family and that family's arguments (``scripts/synthetic.yaml``)."""

    name: str
    family: str
    args: dict
    summary: str

    def __post_init__(self) -> None:
        FAMILIES.key(self.family)  # a family misspelt here is refused when kvlab loads, not when a task is drawn

    @property
    def label(self) -> str:
        return self.name


def _niah_task(name: str, summary: str, haystack: str, k: str, v: str, n_k: int = 1, n_v: int = 1,
               n_q: int = 1) -> RulerTask:
    return RulerTask(name, "niah", dict(haystack=haystack, k=k, v=v, n_k=n_k, n_v=n_v, n_q=n_q), summary)


TASKS: Registry[RulerTask] = Registry("RULER task", (
    _niah_task("niah_single_1", "a word key's number in repeated noise", "noise", "words", "numbers"),
    _niah_task("niah_single_2", "a word key's number in essays", "essay", "words", "numbers"),
    _niah_task("niah_single_3", "a word key's UUID in essays", "essay", "words", "uuids"),
    _niah_task("niah_multikey_1", "one of four word keys' numbers in essays", "essay", "words", "numbers", n_k=4),
    _niah_task("niah_multikey_2", "a word key's number among other needles", "needle", "words", "numbers"),
    _niah_task("niah_multikey_3", "a UUID key's UUID among other needles", "needle", "uuids", "uuids"),
    _niah_task("niah_multivalue", "the four numbers of a word key in essays", "essay", "words", "numbers", n_v=4),
    _niah_task("niah_multiquery", "the numbers of four word keys in essays", "essay", "words", "numbers", n_q=4),
    RulerTask("vt", "vt", dict(num_chains=1, num_hops=4), "the five variables of a chain of four hops"),
    RulerTask("cwe", "cwe", dict(freq_cw=30, freq_ucw=3, num_cw=10), "the 10 words of a list repeated 30 times"),
    RulerTask("fwe", "fwe", dict(alpha=2.0), "the 3 most frequent coded words (Zipf, alpha 2)"),
))


def one_question(task: str) -> bool:
    """Whether ``task`` asks one question whatever its arguments (cwe, fwe): it has no multi-turn variant."""
    return FAMILIES[TASKS[task].family].one_question


def _questions(family: RulerFamily, a: dict, draft: Draft, multi_turn: bool
               ) -> list[tuple[str, str, tuple[str, ...]]]:
    """(message, answer prefix, answers) per turn: one turn with every query, or one query per turn."""
    groups = [draft.queries] if not multi_turn else [(q,) for q in draft.queries]
    return [(*family.ask(a, group, draft, i == 0), tuple(a for q in group for a in q.answers))
            for i, group in enumerate(groups)]


def _build(task: RulerTask, rng_seed: str, n: int, length: int, multi_turn: bool, n_q: int
           ) -> tuple[Draft, list[tuple[str, str, tuple[str, ...]]]]:
    """The sample ``task`` drafts at haystack size ``n``, and its turns' questions."""
    family = FAMILIES[task.family]
    draft = family.draft(random.Random(rng_seed), n, task.args, n_q, length)
    return draft, _questions(family, task.args, draft, multi_turn)


def _count(encode: Encode, family: RulerFamily, questions: list[tuple[str, str, tuple[str, ...]]]) -> int:
    return sum(len(encode(m)) + len(encode(" " + p)) + family.tokens_to_generate for m, p, _ in questions)


def generate(task: str, length: int, samples: int, seed: int, encode: Encode, multi_turn: bool = False,
             questions: int | None = None, tokenizer_name: str = "") -> list[RulerSample]:
    """``samples`` samples of ``task``, each as long as its haystack can be within ``length`` tokens.

    ``questions`` raises the number of queries (niah: keys asked; vt: chains tracked); ``multi_turn`` asks
    them one per turn. The same arguments and tokenizer give the same samples.
    """
    spec = TASKS[task]
    family, a = FAMILIES[spec.family], spec.args
    n_q = questions if questions is not None else a.get("n_q", 1)
    if n_q < 1 or n_q > MAX_TURNS:
        raise KvlabError(f"questions must be between 1 and {MAX_TURNS}, not {n_q}")
    if family.one_question and n_q != 1:
        raise KvlabError(f"{task} asks one question; it has no more queries to ask")
    if multi_turn and n_q == 1:  # one turn, named "mt": a multi-turn run that is not one
        raise KvlabError(f"{task} asks one question, so it has no multi-turn variant" if family.one_question else
                         f"{task} asks one question here, so its multi-turn variant would be one turn: ask 2 or more")
    if family.name == "vt" and n_q != 1 and not multi_turn:
        raise KvlabError("vt asks about one chain per question; use the multi-turn variant to ask about more")
    if family.name == "niah" and max(a["n_k"], n_q) * a["n_v"] > len(DEPTHS):
        raise KvlabError(f"{task} plants at most {len(DEPTHS)} needles (RULER's depths); ask fewer questions")
    if not 256 <= length <= MAX_LENGTH:
        raise KvlabError(f"length {length} is outside what kvlab generates for a RULER task: 256 to {MAX_LENGTH:,} "
                         "tokens (RULER's own lengths reach 128k)")
    if seed < 0:  # a sample's name carries it: "s-1" reads as a typo
        raise KvlabError(f"the seed must be 0 or more, not {seed}")
    if not 1 <= samples <= 1000:
        raise KvlabError(f"samples must be between 1 and 1000, not {samples}")
    out = []
    for index in range(samples):
        rng_seed = f"ruler:{task}:{seed}:{index}:{n_q}"

        def size(n: int) -> int | None:
            """Tokens at haystack size ``n``; None when ``n`` is too small to hold the needles."""
            try:
                return _count(encode, family, _build(spec, rng_seed, n, length, multi_turn, n_q)[1])
            except KvlabError:  # cwe ran out of distinct words: as good as too long (caught first: a ValueError)
                return length + 1
            except ValueError:  # random.sample: fewer places than needles
                return None

        lo = next(n for n in (2 ** i for i in range(12)) if size(n) is not None)
        if (least := size(lo)) > length:
            raise KvlabError(f"{task} with its questions needs more than {length:,} tokens (its smallest sample here "
                             f"takes {least:,}); ask for {least:,} or more")
        hi = 2 * lo
        while size(hi) <= length:  # grow until too long, then bisect for the largest haystack that fits
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if size(mid) <= length else (lo, mid)
        draft, questions_ = _build(spec, rng_seed, lo, length, multi_turn, n_q)
        out.append(_sample(task, index, seed, length, draft, questions_, encode, family, multi_turn, tokenizer_name))
    return out


def _sample(task: str, index: int, seed: int, length: int, draft: Draft, questions: list, encode: Encode,
            family: RulerFamily, multi_turn: bool, tokenizer_name: str) -> RulerSample:
    turns = tuple(Turn(user=m, golden=f"{p} {', '.join(ans)}", prefill=p, answer="\n".join(ans))
                  for m, p, ans in questions)
    first = turns[0].user
    needles = []
    for text in draft.needles:
        char = first.index(text)
        needles.append(Needle(text=text, char=char, token=len(encode(first[:char]))))
    tokens = _count(encode, family, questions)
    variant = "multi-turn" if multi_turn else "single"
    name = f"{task}-{length}-{'mt-' if multi_turn else ''}s{seed}-{index}"
    description = (f"RULER {task} ({variant}), {tokens} tokens of {length} requested"
                   f"{' (' + tokenizer_name + ')' if tokenizer_name else ''}, seed {seed}, sample {index}: "
                   f"{len(turns)} turn{'s' * (len(turns) != 1)}, {len(needles)} planted "
                   f"needle{'s' * (len(needles) != 1)}")
    conv = Conversation(name=name, description=description, system=None, turns=turns)
    return RulerSample(task=task, index=index, seed=seed, tokens=tokens, conversation=conv,
                       needles=tuple(sorted(needles, key=lambda n: n.char)))
