"""The planted-fact conversation lessons 2, 3 and the window lesson share: a fact told in turn 1, a long turn
about something else, the question; where the fact's keys are held, and the tables and figures of the run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.lessons.base import CHAT_SYSTEM, Figure, Progress, Result, pct, rate, span_text
from kvlab.policies import POLICIES
from kvlab.stats import Interval
from kvlab.viz.lessons import fact_kept_figure, outcome, retained_with_span
from kvlab.workloads.chat.records import PolicyTurn, TurnResult
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings


@dataclass(frozen=True)
class Plant:
    """A fact told in turn 1, a long turn about something else, then the question that asks for it."""

    fact: str
    told: str  # the user's message planting the fact
    golden: str  # the reply every cache is fed after it
    question: str
    prefill: str  # the answer started for the model


OTHER_TURN = (
    ("I'm planning a trip to Lisbon next month to see my sister. What should I pack, and which neighbourhoods "
     "are nice for a long walk?"),
    ("Pack light layers, a rain jacket, comfortable walking shoes and sunglasses; spring in Lisbon is mild but "
     "showers are common. Alfama and Baixa are lovely for a stroll, and the riverside path from Cais do Sodré to "
     "Belém is flat and scenic."),
)
# distinct labels: the model tells same-kind labels (five coloured doors) apart far less well (docs/DESIGN facts)
PLANTS = (
    Plant("4127", "My locker code at the gym is 4127. Please remember it.", "Got it: your locker code is 4127.",
          "What is my locker code?", "Your locker code is"),
    Plant("8350", "The wifi password at my flat is 8350. Please remember it.", "Got it: your wifi password is 8350.",
          "What is my wifi password?", "Your wifi password is"),
    Plant("2961", "My bike lock combination is 2961. Please remember it.",
          "Got it: your bike lock combination is 2961.", "What is my bike lock combination?",
          "Your bike lock combination is"),
)
FACT, QUESTION, PREFILL = PLANTS[0].fact, PLANTS[0].question, PLANTS[0].prefill
REPLY_TOKENS = 6  # enough for " 4127." and short enough to keep every policy's own reply cheap


def label(policy: str) -> str:
    """How the lessons name a policy: its registered label."""
    return POLICIES.label(policy)


def token_texts(lm: LoadedModel, tokens: list[int]) -> list[str]:
    """Each token as text, one by one, for the retained maps' hovers."""
    return [lm.tokenizer.decode([t]) for t in tokens]  # special tokens too: they are often the sinks


def find_span(lm: LoadedModel, tokens: list[int], text: str) -> list[int]:
    """Positions of the tokens that spell the first occurrence of ``text`` in the decoded ``tokens``."""
    whole = lm.decode(tokens)
    start = whole.find(text)
    if start < 0:
        return []
    end = start + len(text)

    def first_reaching(chars: int) -> int:  # the first position whose decoded prefix is longer than ``chars``
        lo, hi = 0, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(lm.decode(tokens[: mid + 1])) > chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    return list(range(first_reaching(start), first_reaching(end - 1) + 1))


def kept_share(retained: list[list[list[int]]], positions: list[int]) -> float | None:
    """Share of the keys of ``positions`` still cached, over every layer and KV head; None where there is nothing to
    count (a policy that failed holds no record of its cache, and a fact not found has no keys)."""
    cells = [p in set(heads) for layer in retained for heads in layer for p in positions]
    return sum(cells) / len(cells) if cells else None


def policy_case(answer: PolicyTurn, held: PolicyTurn, fact: list[int]) -> dict:
    """A lesson's record of one policy at a question: whether ``answer`` recalled the fact (None where the policy
    failed: a failure is no miss), its reply and error, and the share of the fact's keys ``held`` (the policy as the
    question arrived) still cached."""
    return {"correct": None if answer.error else bool(answer.correct), "reply": answer.reply, "error": answer.error,
            "kept_share": kept_share(held.retained, fact)}


def ranges(positions: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted positions as (first, last)."""
    out: list[tuple[int, int]] = []
    for p in sorted(positions):
        if out and p == out[-1][1] + 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


def planted_run(lm: LoadedModel, policies: tuple[str, ...], budget: int, progress: Progress,
                plant: Plant = PLANTS[0]) -> tuple[ChatSession, Result]:
    """The planted-fact conversation through ``policies``; the session and the shared part of the record."""
    session = ChatSession(lm, ChatSettings(policies=policies, budget=budget, max_new_tokens=REPLY_TOKENS), CHAT_SYSTEM)
    turns = ((plant.told, plant.golden), OTHER_TURN)
    steps = len(turns) + 1
    for i, (user, golden) in enumerate(turns):
        progress(i / steps, f"turn {i + 1} of {steps}: {user[:40]}…")
        session.run_turn(user, golden=golden)
    progress(len(turns) / steps, f"turn {steps} of {steps}: the question")
    last = session.run_turn(plant.question, prefill=plant.prefill, answer=plant.fact)
    progress(1.0, "done")
    tokens = session.states["full"].tokens
    before: TurnResult = session.turns[-2]  # the caches as the question arrived
    fact = find_span(lm, tokens[: before.total_tokens], plant.fact)
    return session, {
        "model": lm.facts.name, "budget": budget, "fact": plant.fact, "fact_positions": fact,
        "question": plant.question, "prefill": plant.prefill, "question_start": before.total_tokens,
        "total_tokens": last.total_tokens,
        "segments": before.segments, "token_texts": token_texts(lm, tokens[: before.total_tokens]),
        "policies": {
            name: policy_case(p, before.policies[name], fact) | {
                "retained": before.policies[name].retained, "kl": [t.policies[name].kl for t in session.turns]}
            for name, p in last.policies.items()
        },
    }


def retention_figures(result: Result) -> list[Figure]:
    """A recall bar and one retained map per policy with the fact's span marked."""
    fact, n = result["fact_positions"], result["question_start"]
    pols = result["policies"]
    said = {k: f"{label(k)} {'answered ' + result['fact'] if v['correct'] else outcome(v)}"
               + ("" if v["kept_share"] is None else f" (holding {pct(v['kept_share'])} of the code's keys)")
            for k, v in pols.items()}
    out = [Figure(fact_kept_figure(result, POLICIES.labels()), "; ".join(said.values()) + ".")]
    layer = result.get("global_layers", [0])[0]  # a windowed model's sliding layers drop keys whatever the policy
    for name, p in pols.items():
        if name == "full" or not p["retained"]:
            continue
        runs = ranges(p["retained"][layer][0])
        keep = ", ".join(span_text([a, b]) if a != b else str(a) for a, b in runs[:4])
        more = " …" if len(runs) > 4 else ""
        out.append(Figure(
            retained_with_span(p["retained"], n, result["segments"], result["token_texts"], fact,
                               f"{label(name)}: what it held when the question arrived (budget {result['budget']})"),
            f"Layer {layer}, KV head 0 of {label(name)} held positions {keep}{more}; over all layers and KV heads it "
            "held "
            f"{pct(p['kept_share'])} of the keys of the code at {span_text(fact)}."))
    return out


def policy_table(result: Result) -> pd.DataFrame:
    """One row per policy: recall, reply, the fact's keys held, KL to Full."""
    rows = []
    for name, p in result["policies"].items():
        kl = [k for k in p["kl"] if k is not None]
        rows.append({"policy": label(name), f"recalled {result['fact']}": p["correct"], "reply": p["reply"],
                     "fact's keys held": None if p["kept_share"] is None else f"{100 * p['kept_share']:.0f} %",
                     "mean KL to Full (nats)": round(statistics.fmean(kl), 3) if kl else None, "error": p["error"]})
    return pd.DataFrame(rows)


def counted_cases(result: Result) -> list[dict]:
    """The cases (a plant at a budget) Full recalled: elsewhere the model, not the cache, failed."""
    return [c for c in result["cases"] if c["policies"]["full"]["correct"]]


def case_recall(counted: list[dict], names: list[str]) -> tuple[str, Interval]:
    """How often ``names`` (pooled) recalled the fact over ``counted`` cases, as ``rate`` gives it; a policy's
    failed runs are left out, not counted as misses."""
    runs = [c["policies"][n] for c in counted for n in names if c["policies"][n]["error"] is None]
    return rate(sum(bool(p["correct"]) for p in runs), len(runs))


def planted_table(result: Result) -> pd.DataFrame:
    """``policy_table`` of the first case, with each policy's recall over every case Full recalled."""
    counted = counted_cases(result)
    column = f"recalled over {len(counted)} cases Full recalled"
    recalled = {label(name): case_recall(counted, [name])[0] for name in result["policies"]}
    table = policy_table(result)
    return table.assign(**{column: table["policy"].map(recalled)})
