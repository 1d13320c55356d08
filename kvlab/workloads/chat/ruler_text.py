"""RULER's haystacks and questions: what each family draws at a haystack size (needles, variable chains, word
lists, coded words) and how it asks, after NVIDIA/RULER ``scripts/data/synthetic/`` (see ``ruler.py``)."""

from __future__ import annotations

import functools
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass

from kvlab.errors import KvlabError
from kvlab.paths import RAG_CORPUS

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
class Query:
    """One question's query and the references its answer must hold."""

    text: str  # the question's query part ({query})
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Draft:
    """What a family builds at one haystack size: the context, the queries and the needle texts."""

    context: str
    queries: tuple[Query, ...]
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


def niah_draft(rng: random.Random, n: int, a: dict, n_q: int) -> Draft:
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
    return Draft(context, tuple(Query(keys[i], tuple(values[i])) for i in asked), tuple(needles))


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


def vt_draft(rng: random.Random, n: int, a: dict, n_q: int) -> Draft:
    """variable_tracking.py with its noise haystack and its one in-context example before the task."""
    hops = a["num_hops"]
    icl_groups, icl_chains = _chains(rng, 1, hops)
    icl_value = icl_chains[0][0].split("=")[-1].strip()
    example = (VT.format(context=_vt_context(rng, 5, icl_chains), query=icl_value)
               + VT_PREFIX.format(num_v=hops + 1, query=icl_value) + " ".join(icl_groups[0]))
    groups, chains = _chains(rng, max(a["num_chains"], n_q), hops)
    context = _vt_context(rng, n, chains)
    queries = tuple(Query(chains[c][0].split("=")[-1].strip(), tuple(groups[c])) for c in range(n_q))
    return Draft(f"{example}\n\x00{context}", queries, tuple(s.strip() for c in chains for s in c))


@functools.cache
def _word_list() -> list[str]:
    """cwe's vocabulary: the distinct lower-case words of kvlab's corpus (RULER: wonderwords' lists)."""
    return sorted(set(re.findall(r"\b[a-z]{3,}\b", corpus_text())))


def _cwe_example(rng: random.Random, words: list[str], n: int, common: int, uncommon: int,
                 num_cw: int) -> tuple[str, list[str]]:
    """A numbered list of ``n`` distinct words, the first ``num_cw`` repeated ``common`` times and the others
    ``uncommon`` times, and the common words (the answer)."""
    if n < num_cw:  # a list of fewer words than the question asks for: too small a haystack (ValueError), not a task
        raise ValueError(f"{n} words hold no {num_cw} most common ones")
    if n > len(words):
        raise KvlabError(f"cwe needs {n} distinct words but kvlab's corpus has {len(words)}; ask for a shorter length")
    chosen = rng.sample(words, n)
    listed = chosen[:num_cw] * common + chosen[num_cw:] * uncommon
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), chosen[:num_cw]


def cwe_draft(rng: random.Random, n: int, a: dict, length: int) -> Draft:
    """common_words_extraction.py: one worked example, then the list (fewer repeats below 4k tokens)."""
    words = _word_list()
    short = length < 4096
    ex_args, args = ((20, 3, 1), (n, 6, 1)) if short else ((40, 10, 3), (n, a["freq_cw"], a["freq_ucw"]))
    ex_context, ex_answer = _cwe_example(rng, words, *ex_args, a["num_cw"])
    context, answer = _cwe_example(rng, words, *args, a["num_cw"])
    example = CWE.format(context=ex_context) + CWE_PREFIX + " " + " ".join(f"{i + 1}. {w}"
                                                                          for i, w in enumerate(ex_answer))
    return Draft(f"{example}\n\x00{context}", (Query("", tuple(answer)),), ())


def fwe_draft(rng: random.Random, n: int, a: dict, length: int) -> Draft:
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
    return Draft(" ".join(words), (Query("", tuple(vocab[1:4])),), ())


def niah_question(a: dict, queries: tuple[Query, ...], context: str | None) -> tuple[str, str]:
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


def vt_question(a: dict, queries: tuple[Query, ...], draft: Draft, first: bool) -> tuple[str, str]:
    """vt's question (with its worked example and the context for turn 1) and its answer prefix."""
    example, haystack = draft.context.split("\x00")
    q = queries[0].text
    body = VT.format(context=haystack, query=q)
    return example + body if first else body[body.index("Question:"):], \
        VT_PREFIX.format(num_v=a["num_hops"] + 1, query=q).strip()


def cwe_question(a: dict, queries: tuple[Query, ...], draft: Draft, first: bool) -> tuple[str, str]:
    """cwe's one question, after its worked example and the list, and its answer prefix."""
    example, haystack = draft.context.split("\x00")
    return example + CWE.format(context=haystack), CWE_PREFIX.strip()


def fwe_question(a: dict, queries: tuple[Query, ...], draft: Draft, first: bool) -> tuple[str, str]:
    """fwe's one question, after the coded text, and its answer prefix."""
    return FWE.format(context=draft.context), FWE_PREFIX.strip()
