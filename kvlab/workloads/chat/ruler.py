"""RULER's synthetic tasks (Hsieh et al., 2024), generated locally as kvlab conversations, seeded.

Task names, arguments, templates and answer prefixes follow NVIDIA/RULER ``scripts/synthetic.yaml`` and
``scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,freq_words_extraction}.py`` and
``constants.py``: the needle-in-a-haystack family (``niah_single_1..3``, ``niah_multikey_1..3``,
``niah_multivalue``, ``niah_multiquery``), variable tracking (``vt``), common- and frequent-words extraction
(``cwe``, ``fwe``). RULER's essays (Paul Graham's, downloaded) are replaced by the RAG corpus that ships
with kvlab, and wonderwords' word lists by the short lists below and the corpus's own words; the rules
(needle sentences, depths, chains, repeat counts, Zipf counts) are RULER's. A sample is as long as the
haystack can be with ``length`` tokens or fewer, counted as RULER counts them (every question with its
answer prefix, plus the task's tokens to generate) with the caller's tokenizer.

Two variants: RULER's own (one turn: the context and every query, the answer prefix given to the model)
and multi-turn (SCBench-style: turn 1 is the context with the first query, each later query one turn).
Every turn is scored by RULER's ``string_match_all`` (the ``contains`` metric: every reference occurs).
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Callable

from kvlab.errors import KvlabError
from kvlab.paths import RAG_CORPUS
from kvlab.workloads.chat.conversation import MAX_TURNS, Conversation, Turn

MAX_LENGTH = 131_072  # RULER's longest configuration (128k); a haystack past it only takes time to build

Encode = Callable[[str], list[int]]

# scripts/synthetic.yaml: each task's family and arguments
TASKS: dict[str, tuple[str, dict]] = {
    "niah_single_1": ("niah", dict(haystack="noise", k="words", v="numbers", n_k=1, n_v=1, n_q=1)),
    "niah_single_2": ("niah", dict(haystack="essay", k="words", v="numbers", n_k=1, n_v=1, n_q=1)),
    "niah_single_3": ("niah", dict(haystack="essay", k="words", v="uuids", n_k=1, n_v=1, n_q=1)),
    "niah_multikey_1": ("niah", dict(haystack="essay", k="words", v="numbers", n_k=4, n_v=1, n_q=1)),
    "niah_multikey_2": ("niah", dict(haystack="needle", k="words", v="numbers", n_k=1, n_v=1, n_q=1)),
    "niah_multikey_3": ("niah", dict(haystack="needle", k="uuids", v="uuids", n_k=1, n_v=1, n_q=1)),
    "niah_multivalue": ("niah", dict(haystack="essay", k="words", v="numbers", n_k=1, n_v=4, n_q=1)),
    "niah_multiquery": ("niah", dict(haystack="essay", k="words", v="numbers", n_k=1, n_v=1, n_q=4)),
    "vt": ("vt", dict(num_chains=1, num_hops=4)),
    "cwe": ("cwe", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("fwe", dict(alpha=2.0)),
}
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # constants.py
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {v} for {key} is: {value}."
NIAH = ("Some special magic {v} are hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the {v} afterwards.\n{context}\nWhat are all the special magic {v} for {query} mentioned in the "
        "provided text?")
NIAH_PREFIX = " The special magic {v} for {query} mentioned in the provided text are"
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
      "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
       "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
       "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
       "What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 insertion depths, 0..100 %
# RULER draws keys as adjective-noun pairs from wonderwords; these short lists keep the rule
ADJECTIVES = ("amber", "ancient", "bitter", "brave", "brisk", "calm", "clever", "cold", "curious", "damp", "eager",
              "early", "fancy", "fierce", "gentle", "glossy", "grand", "hollow", "humble", "icy", "jolly", "keen",
              "lazy", "little", "lucky", "mellow", "misty", "noisy", "odd", "pale", "plain", "proud", "quiet",
              "rapid", "rough", "rusty", "shiny", "silent", "sleepy", "smooth", "sour", "spicy", "steady", "sturdy",
              "swift", "tame", "tidy", "vast", "warm", "wild")
NOUNS = ("anchor", "apple", "badge", "barrel", "basket", "beacon", "bridge", "button", "candle", "canyon", "castle",
         "cellar", "comet", "cottage", "crystal", "desert", "dragon", "engine", "falcon", "feather", "forest",
         "garden", "glacier", "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern", "meadow",
         "mirror", "mountain", "needle", "orchard", "pebble", "pillow", "planet", "puzzle", "river", "saddle",
         "shadow", "spider", "statue", "teapot", "thunder", "tunnel", "violin", "wagon", "window")


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


@dataclass(frozen=True)
class _Query:
    text: str  # the question's query part ({query})
    answers: tuple[str, ...]


@dataclass(frozen=True)
class _Draft:
    """What a family builds at one haystack size: the context, the queries and the needle texts."""

    context: str
    queries: tuple[_Query, ...]
    needles: tuple[str, ...]


@functools.cache
def corpus_text() -> str:
    """The essay haystack: the text of every document of kvlab's RAG corpus, whitespace collapsed."""
    docs = json.loads(RAG_CORPUS.read_text(encoding="utf-8"))["documents"]
    return re.sub(r"\s+", " ", " ".join(d["text"] for d in docs)).strip()


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def _random(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(rng: random.Random, n: int, a: dict, n_q: int) -> _Draft:
    """niah.py's generate_input_output: needles, a haystack of ``n`` units, needles inserted."""
    n_k = max(a["n_k"], n_q)
    keys, values, needles = [], [], []
    for _ in range(n_k):
        keys.append(_random(rng, a["k"]))
        values.append([_random(rng, a["v"]) for _ in range(a["n_v"])])
        needles += [NEEDLE.format(v=a["v"], key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if a["haystack"] == "essay":
        words = corpus_text().split(" ")
        words = (words * (n // len(words) + 1))[:n]
        sents = _sentences(" ".join(words))
        cuts = [0, *sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))), len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(p for p in parts if p)
    else:
        if a["haystack"] == "noise":
            lines = [NOISE] * n
        else:  # "needle": the haystack is made of other needles
            lines = [NEEDLE.format(v=a["v"], key=_random(rng, a["k"]), value=_random(rng, a["v"])) for _ in range(n)]
        for at, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            lines.insert(at, needle)
        context = "\n".join(lines)
    asked = rng.sample(range(n_k), n_q)
    return _Draft(context, tuple(_Query(keys[i], tuple(values[i])) for i in asked), tuple(needles))


def _chains(rng: random.Random, n_chains: int, hops: int) -> tuple[list[list[str]], list[list[str]]]:
    """variable_tracking.py's generate_chains: distinct 5-letter names, each chain a value then hops."""
    names: list[str] = []
    while len(set(names)) < n_chains * (hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=5)))
    names = list(dict.fromkeys(names))
    chains, groups = [], []
    for c in range(n_chains):
        group = names[c * (hops + 1):(c + 1) * (hops + 1)]
        chain = [f"VAR {group[0]} = {rng.randint(10000, 99999)}"]
        chain += [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(hops)]
        groups.append(group)
        chains.append(chain)
    return groups, chains


def _vt_context(rng: random.Random, n: int, chains: list[list[str]]) -> str:
    lines = [NOISE] * n
    for chain in chains:
        for j, at in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(at + j, chain[j])
    return "\n".join(lines).replace(". \n", ".\n")


def _vt(rng: random.Random, n: int, a: dict, n_q: int) -> _Draft:
    """variable_tracking.py with its noise haystack and its one in-context example before the task."""
    hops = a["num_hops"]
    icl_groups, icl_chains = _chains(rng, 1, hops)
    icl_value = icl_chains[0][0].split("=")[-1].strip()
    example = (VT.format(context=_vt_context(rng, 5, icl_chains), query=icl_value)
               + VT_PREFIX.format(num_v=hops + 1, query=icl_value) + " ".join(icl_groups[0]))
    groups, chains = _chains(rng, max(a["num_chains"], n_q), hops)
    context = _vt_context(rng, n, chains)
    queries = tuple(_Query(chains[c][0].split("=")[-1].strip(), tuple(groups[c])) for c in range(n_q))
    return _Draft(f"{example}\n\x00{context}", queries, tuple(s.strip() for c in chains for s in c))


@functools.cache
def _word_list() -> list[str]:
    """cwe's vocabulary: the distinct lower-case words of kvlab's corpus (RULER: wonderwords' lists)."""
    return sorted(set(re.findall(r"\b[a-z]{3,}\b", corpus_text())))


def _cwe_example(rng: random.Random, words: list[str], n: int, common: int, uncommon: int,
                 num_cw: int) -> tuple[str, list[str]]:
    if n > len(words):
        raise KvlabError(f"cwe needs {n} distinct words but kvlab's corpus has {len(words)}; ask for a shorter length")
    chosen = rng.sample(words, n)
    listed = chosen[:num_cw] * common + chosen[num_cw:] * uncommon
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), chosen[:num_cw]


def _cwe(rng: random.Random, n: int, a: dict, length: int) -> _Draft:
    """common_words_extraction.py: one worked example, then the list (fewer repeats below 4k tokens)."""
    words = _word_list()
    short = length < 4096
    ex_args, args = ((20, 3, 1), (n, 6, 1)) if short else ((40, 10, 3), (n, a["freq_cw"], a["freq_ucw"]))
    ex_context, ex_answer = _cwe_example(rng, words, *ex_args, a["num_cw"])
    context, answer = _cwe_example(rng, words, *args, a["num_cw"])
    example = CWE.format(context=ex_context) + CWE_PREFIX + " " + " ".join(f"{i + 1}. {w}"
                                                                          for i, w in enumerate(ex_answer))
    return _Draft(f"{example}\n\x00{context}", (_Query("", tuple(answer)),), ())


def _fwe(rng: random.Random, n: int, a: dict, length: int) -> _Draft:
    """freq_words_extraction.py: coded 6-letter words with Zipf counts; the most frequent is the '...' noise."""
    size = max(length // 50, 8)
    vocab: list[str] = []
    while len(set(vocab)) < size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(set(vocab))
    rng.shuffle(vocab)
    vocab[0] = "..."
    zeta = math.pi ** 2 / 6 if a["alpha"] == 2.0 else sum(k ** -a["alpha"] for k in range(1, 100_000))
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -a["alpha"] / zeta))]
    rng.shuffle(words)
    return _Draft(" ".join(words), (_Query("", tuple(vocab[1:4])),), ())


def _niah_question(a: dict, queries: tuple[_Query, ...], context: str | None) -> tuple[str, str]:
    """The question (with the context for turn 1) and its answer prefix; singular when one value is asked."""
    keys = [q.text for q in queries]
    query = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
    template = NIAH + NIAH_PREFIX
    v = a["v"]
    if sum(len(q.answers) for q in queries) == 1:  # niah.py's singular rewrite of the whole template
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(old, new)
        v = v[:-1]
    text = template.format(v=v, context="\x00", query=query)
    head, question = text.split("\x00")
    question, prefix = question.rsplit(" The special magic", 1)
    first = head + (context or "") + question if context is not None else question.lstrip("\n")
    return first, "The special magic" + prefix


def _questions(family: str, a: dict, draft: _Draft, multi_turn: bool) -> list[tuple[str, str, tuple[str, ...]]]:
    """(message, answer prefix, answers) per turn: one turn with every query, or one query per turn."""
    groups = [draft.queries] if not multi_turn else [(q,) for q in draft.queries]
    out = []
    for i, group in enumerate(groups):
        answers = tuple(a for q in group for a in q.answers)
        context = draft.context if i == 0 else None
        if family == "niah":
            message, prefix = _niah_question(a, group, context)
        elif family == "vt":
            example, haystack = draft.context.split("\x00")
            q = group[0].text
            body = VT.format(context=haystack, query=q)
            message = example + body if i == 0 else body[body.index("Question:"):]
            prefix = VT_PREFIX.format(num_v=a["num_hops"] + 1, query=q).strip()
        elif family == "cwe":
            example, haystack = draft.context.split("\x00")
            message, prefix = example + CWE.format(context=haystack), CWE_PREFIX.strip()
        else:
            message, prefix = FWE.format(context=draft.context), FWE_PREFIX.strip()
        out.append((message, prefix, answers))
    return out


def _build(task: str, rng_seed: str, n: int, length: int, multi_turn: bool, n_q: int):
    family, a = TASKS[task]
    rng = random.Random(rng_seed)
    if family == "niah":
        draft = _niah(rng, n, a, n_q)
    elif family == "vt":
        draft = _vt(rng, n, a, n_q)
    elif family == "cwe":
        draft = _cwe(rng, n, a, length)
    else:
        draft = _fwe(rng, n, a, length)
    return draft, _questions(family, a, draft, multi_turn)


def _count(encode: Encode, family: str, questions: list[tuple[str, str, tuple[str, ...]]]) -> int:
    return sum(len(encode(m)) + len(encode(" " + p)) + TOKENS_TO_GENERATE[family] for m, p, _ in questions)


def generate(task: str, length: int, samples: int, seed: int, encode: Encode, multi_turn: bool = False,
             questions: int | None = None, tokenizer_name: str = "") -> list[RulerSample]:
    """``samples`` samples of ``task``, each as long as its haystack can be within ``length`` tokens.

    ``questions`` raises the number of queries (niah: keys asked; vt: chains tracked); ``multi_turn`` asks
    them one per turn. The same arguments and tokenizer give the same samples.
    """
    if task not in TASKS:
        raise KvlabError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    family, a = TASKS[task]
    n_q = questions if questions is not None else a.get("n_q", 1)
    if n_q < 1 or n_q > MAX_TURNS:
        raise KvlabError(f"questions must be between 1 and {MAX_TURNS}")
    if family in ("cwe", "fwe") and n_q != 1:
        raise KvlabError(f"{task} asks one question; it has no more queries to ask")
    if multi_turn and n_q == 1:  # one turn, named "mt": a multi-turn run that is not one
        raise KvlabError(f"{task} asks one question, so it has no multi-turn variant" if family in ("cwe", "fwe") else
                         f"{task} asks one question here, so its multi-turn variant would be one turn: ask 2 or more")
    if family == "vt" and n_q != 1 and not multi_turn:
        raise KvlabError("vt asks about one chain per question; use the multi-turn variant to ask about more")
    if family == "niah" and max(a["n_k"], n_q) * a["n_v"] > len(DEPTHS):
        raise KvlabError(f"{task} plants at most {len(DEPTHS)} needles (RULER's depths); ask fewer questions")
    if not 256 <= length <= MAX_LENGTH:
        raise KvlabError(f"length {length} is outside what kvlab generates for a RULER task: 256 to {MAX_LENGTH:,} "
                         "tokens (RULER's own lengths reach 128k)")
    if not 1 <= samples <= 1000:
        raise KvlabError(f"samples must be between 1 and 1000, not {samples}")
    out = []
    for index in range(samples):
        rng_seed = f"ruler:{task}:{seed}:{index}:{n_q}"

        def size(n: int) -> int | None:
            """Tokens at haystack size ``n``; None when ``n`` is too small to hold the needles."""
            try:
                return _count(encode, family, _build(task, rng_seed, n, length, multi_turn, n_q)[1])
            except KvlabError:  # cwe ran out of distinct words: as good as too long (caught first: a ValueError)
                return length + 1
            except ValueError:  # random.sample: fewer places than needles
                return None

        lo = next(n for n in (2 ** i for i in range(12)) if size(n) is not None)
        if size(lo) > length:
            raise KvlabError(f"{task} with its questions needs more than {length} tokens; ask for a longer length")
        hi = 2 * lo
        while size(hi) <= length:  # grow until too long, then bisect for the largest haystack that fits
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if size(mid) <= length else (lo, mid)
        draft, questions_ = _build(task, rng_seed, lo, length, multi_turn, n_q)
        out.append(_sample(task, index, seed, length, draft, questions_, encode, family, multi_turn, tokenizer_name))
    return out


def _sample(task: str, index: int, seed: int, length: int, draft: _Draft, questions: list, encode: Encode,
            family: str, multi_turn: bool, tokenizer_name: str) -> RulerSample:
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
                   f"{len(turns)} turn(s), {len(needles)} planted needle(s)")
    conv = Conversation(name=name, description=description, system=None, turns=turns)
    return RulerSample(task=task, index=index, seed=seed, tokens=tokens, conversation=conv,
                       needles=tuple(sorted(needles, key=lambda n: n.char)))
