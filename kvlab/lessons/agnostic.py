"""Lesson 10: do a query-agnostic (KVzip) and a head-hybrid (DuoAttention) policy survive the turns SnapKV loses?

Three facts are planted turn after turn, a turn about something else follows, then the three questions, one a
turn: SnapKV scores each turn by that turn's own queries; KVzip by a reconstruction of what was said, whatever is
asked next; DuoAttention keeps whole retrieval heads and cuts the others to sinks + recent tokens; the oracle
keeps what the later turns will attend to. All run at one byte budget, as the arena's MiB budgets do
(``policies.memory.tokens_within`` gives each policy the most tokens whose bytes fit); DuoAttention's retrieval
heads keep every key, so its share of streaming heads is chosen from the conversation's length to fit the same
bytes, and its bytes are measured.
"""

from __future__ import annotations

import math
import statistics

import pandas as pd

from kvlab.engine.chatformat import chat_format
from kvlab.engine.facts import LoadedModel
from kvlab.engine.head_patterns import METHOD_WORDS, HeadPattern
from kvlab.lessons.base import (
    CHAT_SYSTEM,
    MIN_CASES,
    Figure,
    Lesson,
    Progress,
    Result,
    Verdict,
    inconclusive,
    pct,
)
from kvlab.lessons.planted import (
    OTHER_TURN,
    PLANTS,
    REPLY_TOKENS,
    case_recall,
    counted_cases,
    find_span,
    label,
    policy_case,
)
from kvlab.policies import POLICIES, make_policy
from kvlab.policies.memory import MIB, tokens_within
from kvlab.viz.chat import duo_heads_figure
from kvlab.viz.lessons import bytes_per_turn_figure, case_grid_figure, recall_interval_figure
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

AGNOSTIC_POLICIES = ("full", "snapkv", "kvzip", "duoattention", "oracle")
CHALLENGERS = ("kvzip", "duoattention")  # the deployable policies the claim is about
BUDGETS_MIB = (3.0, 4.5)  # SmolLM2-135M: 45 KiB per token at float32, so 68 and 102 tokens per layer and KV head
# DuoAttention's streaming heads, scaled down from the authors' sink 128 + recent 256 to a conversation of ~400
# tokens; its head pattern is kvpress's on-the-fly estimate (seconds) rather than the authors' gate training (a
# minute on a 2-core CPU the first time), so the lesson's run stays short
DUO_SINK, DUO_RECENT, DUO_PATTERN = 4, 28, "on_the_fly"
LOSES = 0.5  # a challenger loses the turns too where its whole recall interval lies below this share


def script() -> Conversation:
    """The three plants told one a turn, the other turn, then the three questions one a turn."""
    turns = [Turn(p.told, golden=p.golden) for p in PLANTS] + [Turn(OTHER_TURN[0], golden=OTHER_TURN[1])]
    turns += [Turn(p.question, prefill=p.prefill, answer=p.fact) for p in PLANTS]
    return Conversation("planted facts, asked turn after turn", "three facts told, a turn about something else, "
                        "the three questions", CHAT_SYSTEM, tuple(turns))


def script_tokens(lm: LoadedModel, conv: Conversation) -> int:
    """About how many tokens the whole conversation holds (a question's reply counted as its prefill and answer)."""
    fmt = chat_format(lm.tokenizer, conv.system)
    text = fmt.opening + "".join(fmt.user_block(t.user) + (t.golden or f"{t.prefill} {t.answer}.")
                                 + fmt.assistant_end for t in conv.turns)
    return len(fmt.start_ids) + len(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


def duo_ratio(tokens: int, budget_tokens: int, heads: int, streaming_keeps: int = DUO_SINK + DUO_RECENT) -> float:
    """DuoAttention's share of streaming heads (of ``heads`` KV heads in all) whose cache fits ``budget_tokens``
    per KV head on average at ``tokens`` held: retrieval heads hold every token, streaming ones ``streaming_keeps``,
    so (1 − r)·tokens + r·keeps ≤ budget; rounded up to whole heads, as ``HeadPattern.retrieval`` counts them."""
    if tokens <= budget_tokens:
        return 0.0
    share = (tokens - budget_tokens) / max(tokens - streaming_keeps, 1)
    return min(1.0, math.ceil(share * heads - 1e-9) / heads)


def byte_settings(lm: LoadedModel, mib: float, ratio: float) -> ChatSettings:
    """The chat settings of one byte budget, as the arena's MiB budgets make them
    (``ArenaSettings.chat_settings``): each policy the most tokens whose worst case fits ``mib``."""
    params = {"duoattention": {"sink": DUO_SINK, "recent": DUO_RECENT, "head_compression_ratio": ratio,
                               "pattern": DUO_PATTERN}}
    tokens = {name: tokens_within(make_policy(name, **params.get(name, {})), int(mib * MIB), lm.facts,
                                  lm.facts.context_length, f"{mib:g} MiB") for name in AGNOSTIC_POLICIES}
    base = tokens["full"]  # what the bytes hold at the model's precision: Full keeps everything anyway
    return ChatSettings(policies=AGNOSTIC_POLICIES, budget=base, params=params, max_new_tokens=REPLY_TOKENS,
                        policy_budgets={n: t for n, t in tokens.items() if t != base})


def run_agnostic(lm: LoadedModel, progress: Progress) -> Result:
    """The conversation at each byte budget: every question is a case; bytes held after every turn."""
    conv = script()
    estimate = script_tokens(lm, conv)
    heads = lm.facts.n_layers * lm.facts.n_kv_heads
    cases, runs, pattern = [], [], None
    for b, mib in enumerate(BUDGETS_MIB):
        budget_tokens = int(mib * MIB) // lm.facts.kv_bytes(1)
        ratio = duo_ratio(estimate, budget_tokens, heads)
        chat = byte_settings(lm, mib, ratio)
        progress(b / len(BUDGETS_MIB), f"{mib:g} MiB: finding DuoAttention's heads, running Full over the script")
        session = ChatSession(lm, chat, conv.system, script=conv)
        held: dict[str, list[int | None]] = {n: [] for n in chat.policies}
        extra: dict[str, float] = dict.fromkeys(chat.policies, 0.0)
        for t, turn in enumerate(conv.turns):
            progress((b + t / len(conv.turns)) / len(BUDGETS_MIB),
                     f"{mib:g} MiB, turn {t + 1} of {len(conv.turns)}: {turn.user[:40]}…")
            done = session.run_turn(turn.user, golden=turn.golden, prefill=turn.prefill, answer=turn.answer)
            for name, p in done.policies.items():
                held[name].append(p.kv_bytes)
                extra[name] += p.extra_prefill_s
            if turn.answer is None:
                continue
            before = session.turns[-2]  # the caches as the question arrived
            fact = find_span(lm, session.states["full"].tokens[: before.total_tokens], turn.answer)
            cases.append({"fact": turn.answer, "question": turn.user, "budget_mib": mib, "turn": t + 1,
                          "fact_positions": fact, "question_start": before.total_tokens,
                          "policies": {n: policy_case(p, before.policies[n], fact) | {"kv_bytes": p.kv_bytes}
                                       for n, p in done.policies.items()}})
        duo = session.policies["duoattention"]
        pattern = pattern or (duo.found.to_json() if duo.found is not None else None)
        runs.append({"budget_mib": mib, "budget_bytes": int(mib * MIB), "tokens": chat.budget_of("snapkv"),
                     "duo_ratio": ratio, "held": held, "extra_prefill_s": extra,
                     "total_tokens": session.turns[-1].total_tokens})
    progress(1.0, "done")
    return {"model": lm.facts.name, "policies": list(AGNOSTIC_POLICIES), "estimate_tokens": estimate,
            "kv_heads": heads, "duo": {"sink": DUO_SINK, "recent": DUO_RECENT, "pattern": DUO_PATTERN},
            "duo_pattern": pattern, "runs": runs, "cases": cases}


def held_at_questions(result: Result, name: str, mib: float) -> float | None:
    """The mean K/V bytes ``name`` held after the questions at the budget of ``mib`` (None: never measured)."""
    at = [c["policies"][name]["kv_bytes"] for c in result["cases"]
          if c["budget_mib"] == mib and c["policies"][name]["kv_bytes"] is not None]
    return statistics.fmean(at) if at else None


def duo_memory(result: Result, run: dict) -> str:
    """DuoAttention's measured bytes at the questions of one budget's ``run``, against that budget, in words."""
    held = held_at_questions(result, "duoattention", run["budget_mib"])
    if held is None:
        return f"nothing measured at {run['budget_mib']:g} MiB (it failed)"
    return f"{held / MIB:.2f} MiB at {run['budget_mib']:g} MiB ({pct(run['duo_ratio'])} streaming heads)"


def agnostic_verdict(result: Result) -> Verdict:
    """Supported when KVzip's or DuoAttention's recall interval lies wholly above SnapKV's over the questions Full
    recalled; contradicted when every challenger's whole interval lies below half of them (they lose the turns
    too); mixed otherwise. Below ``MIN_CASES`` counted questions: inconclusive."""
    cases = counted_cases(result)
    others = [n for n in result["policies"] if n != "full"]
    budgets = ", ".join(f"{r['budget_mib']:g}" for r in result["runs"])
    tokens = ", ".join(str(r["tokens"]) for r in result["runs"])
    text = (f"{len(result['cases'])} questions ({len(result['cases']) // max(len(result['runs']), 1)} planted facts "
            f"asked turn after turn, at {budgets} MiB: {tokens} tokens per layer and KV head for SnapKV, KVzip and "
            f"the oracle), {len(cases)} of them recalled by Full. Recall over those: "
            + "; ".join(f"{label(n)} {case_recall(cases, [n])[0]}" for n in others)
            + ". DuoAttention's retrieval heads keep every key; measured at the questions it held "
            + "; ".join(duo_memory(result, r) for r in result["runs"]) + ".")
    if len(cases) < MIN_CASES:
        return inconclusive(len(cases), "questions Full recalled", MIN_CASES, text,
                            "More facts or budgets that Full recalls would decide it.")
    snap = case_recall(cases, ["snapkv"])[1]
    per = {n: case_recall(cases, [n])[1] for n in CHALLENGERS if n in others}
    above = [n for n, iv in per.items() if iv.n and iv.low > snap.high]
    lost = [n for n, iv in per.items() if iv.n and iv.high < LOSES]
    oracle = case_recall(cases, ["oracle"])[1] if "oracle" in others else None
    if oracle is not None and oracle.n:
        text += f" The oracle (not deployable) shows what eviction at this memory could keep: {oracle.estimate:.0%}."
    if above:
        return Verdict("supports", text + f" {' and '.join(map(label, above))}'s interval lies wholly above SnapKV's: "
                                          "it kept the facts SnapKV lost turn after turn: the run supports the claim. "
                                          "What would change it: more questions where SnapKV recalls as often.")
    if per and len(lost) == len(per):
        return Verdict("contradicts", text + f" Every challenger's interval lies below {pct(LOSES)}: they lose the "
                                             "planted facts over the turns as SnapKV does: the run contradicts the "
                                             "claim. What would change it: a larger budget, or more questions that "
                                             "a challenger recalls.")
    return Verdict("inconclusive", text + " No challenger's interval lies wholly above SnapKV's, nor all below "
                                   f"{pct(LOSES)}: the run does not separate them. What would change it: more "
                                   f"questions (n = {len(cases)} now), or a budget where SnapKV clearly fails.")


def _rates(result: Result) -> dict[str, tuple[int, int, float, float]]:
    cases = counted_cases(result)
    out = {}
    for name in result["policies"]:
        iv = case_recall(cases, [name])[1]
        out[name] = (round(iv.estimate * iv.n) if iv.n else 0, iv.n, iv.low, iv.high)  # n = 0: failed every time
    return out


def agnostic_figures(result: Result) -> list[Figure]:
    """Recall with intervals, the case grid, the bytes held per turn against the budget, DuoAttention's heads."""
    rates = _rates(result)
    rate = {k: rates[k][0] / max(rates[k][1], 1) for k in rates if k != "full"}
    most = max(rate.values())
    best = [k for k in rate if rate[k] == most]  # ties named together, each with its own n
    cases = result["cases"]
    grid_cells = [[c["policies"][n] for c in cases] for n in result["policies"]]
    columns = [f"{c['fact']} @ {c['budget_mib']:g} MiB" for c in cases]
    first = result["runs"][0]
    duo_held = held_at_questions(result, "duoattention", first["budget_mib"])
    out = [
        Figure(recall_interval_figure(rates, POLICIES.labels(), "Planted facts recalled, over the questions Full "
                                                                "recalled"),
               "No policy but Full recalled a fact." if not most else
               ", ".join(f"{label(k)} {rates[k][0]} of {rates[k][1]} ({100 * rates[k][2]:.0f}–"
                         f"{100 * rates[k][3]:.0f} %)" for k in best) + " recalled most (95 % Wilson intervals)."),
        Figure(case_grid_figure([label(n) for n in result["policies"]], columns, grid_cells),
               "Each cell is one question at one budget: recalled or missed, and the share of the fact's keys the "
               "policy still held when the question came."),
        Figure(bytes_per_turn_figure(first["held"], POLICIES.labels(), first["budget_bytes"],
                                     f"K/V bytes held after each turn at {first['budget_mib']:g} MiB"),
               f"At {first['budget_mib']:g} MiB SnapKV, KVzip and the oracle are held to the budget by their "
               f"{first['tokens']} tokens per layer and KV head; DuoAttention ({pct(first['duo_ratio'])} streaming "
               f"heads) is bounded by nothing but its split and "
               + (f"held {duo_held / MIB:.2f} MiB at the questions (measured)" if duo_held is not None else
                  "failed: nothing was measured") + "; "
               f"Full grew to {max(b for b in first['held']['full'] if b) / MIB:.2f} MiB."),
    ]
    if result.get("duo_pattern"):
        pattern = HeadPattern.from_json(result["duo_pattern"])
        out.append(Figure(duo_heads_figure(pattern, first["duo_ratio"]),
                          f"DuoAttention's head split ({METHOD_WORDS[pattern.method]}): "
                          f"{round(result['kv_heads'] * (1 - first['duo_ratio']))} retrieval heads of "
                          f"{result['kv_heads']} keep every key at {first['budget_mib']:g} MiB."))
    return out


def agnostic_table(result: Result) -> pd.DataFrame:
    """One row per policy: recall, fact's keys held, bytes at the questions, extra prefill."""
    cases, rows = counted_cases(result), []
    for name in result["policies"]:
        held = [c["policies"][name]["kv_bytes"] for c in result["cases"] if c["policies"][name]["kv_bytes"]]
        kept = [c["policies"][name]["kept_share"] for c in result["cases"]
                if c["policies"][name]["kept_share"] is not None]  # a failed run held nothing to count
        rows.append({"policy": label(name),
                     f"recalled over {len(cases)} questions Full recalled": case_recall(cases, [name])[0],
                     "fact's keys held (mean)": f"{100 * statistics.fmean(kept):.0f} %" if kept else None,
                     "MiB held at the questions (mean over the budgets)":
                         round(statistics.fmean(held) / MIB, 2) if held else None,
                     "extra prefill (s)": round(sum(r["extra_prefill_s"][name] for r in result["runs"]), 1)})
    return pd.DataFrame(rows)


LESSONS = (
    Lesson("agnostic", "Query-agnostic and head-hybrid caches over turns",
           "A query-agnostic policy (KVzip: what the model needs to repeat the context) or a head hybrid "
           "(DuoAttention: retrieval heads keep every key) survives the turns that query-aware SnapKV loses, "
           "because what it keeps does not depend on the question of the turn (issue 20, after KVzip's and "
           "DuoAttention's authors).",
           f"{len(PLANTS)} facts planted one a turn, a turn about something else, then the {len(PLANTS)} questions "
           f"one a turn; Full, SnapKV, KVzip, DuoAttention and the oracle (not deployable) at "
           f"{' and '.join(f'{b:g}' for b in BUDGETS_MIB)} MiB of K/V each ({len(PLANTS) * len(BUDGETS_MIB)} "
           f"questions). DuoAttention's streaming heads keep {DUO_SINK} sinks + {DUO_RECENT} recent tokens; its "
           "share of streaming heads is set from the conversation's length to fit the same bytes, and its head "
           "pattern is kvpress's on-the-fly estimate (seconds), not the authors' gate training (a minute on this "
           "CPU the first time).",
           run_agnostic, agnostic_verdict, agnostic_figures, table=agnostic_table),
)
