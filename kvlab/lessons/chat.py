"""Chat lessons: attention sinks, sink + window vs importance scoring over turns, PyramidKV's layer budgets."""

from __future__ import annotations

import statistics

import pandas as pd

from kvlab.lessons.base import CHAT_SYSTEM, Figure, Lesson, Progress, Result, Verdict, pct, span_text
from kvlab.engine.facts import LoadedModel
from kvlab.workloads.chat.records import TurnResult
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings
from kvlab.viz.lessons import fact_kept_figure, retained_with_span, sink_layers_figure, spread_budget_figure

POLICY_LABELS = {"full": "Full", "streamingllm": "StreamingLLM", "window": "Window", "h2o": "H2O", "snapkv": "SnapKV",
                 "pyramidkv": "PyramidKV", "tova": "TOVA", "knorm": "Knorm"}

# --- shared: a conversation with a fact planted in its first turn ---------------------------------

FACT = "4127"
PLANTED = (
    ("My locker code at the gym is 4127. Please remember it.", "Got it: your locker code is 4127."),
    ("I'm planning a trip to Lisbon next month to see my sister. What should I pack, and which neighbourhoods "
     "are nice for a long walk?",
     "Pack light layers, a rain jacket, comfortable walking shoes and sunglasses; spring in Lisbon is mild but "
     "showers are common. Alfama and Baixa are lovely for a stroll, and the riverside path from Cais do Sodré to "
     "Belém is flat and scenic."),
)
QUESTION, PREFILL = "What is my locker code?", "Your locker code is"
REPLY_TOKENS = 6  # enough for " 4127." and short enough to keep every policy's own reply cheap


def label(policy: str) -> str:
    return POLICY_LABELS.get(policy, policy)


def token_texts(lm: LoadedModel, tokens: list[int]) -> list[str]:
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


def kept_share(retained: list[list[list[int]]], positions: list[int]) -> float:
    """Share of the keys of ``positions`` still cached, over every layer and KV head."""
    cells = [p in set(heads) for layer in retained for heads in layer for p in positions]
    return sum(cells) / len(cells) if cells else 0.0


def ranges(positions: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted positions as (first, last)."""
    out: list[tuple[int, int]] = []
    for p in sorted(positions):
        if out and p == out[-1][1] + 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


def planted_run(lm: LoadedModel, policies: tuple[str, ...], budget: int,
                progress: Progress) -> tuple[ChatSession, Result]:
    """The planted-fact conversation through ``policies``; the session and the shared part of the record."""
    session = ChatSession(lm, ChatSettings(policies=policies, budget=budget, max_new_tokens=REPLY_TOKENS), CHAT_SYSTEM)
    steps = len(PLANTED) + 1
    for i, (user, golden) in enumerate(PLANTED):
        progress(i / steps, f"turn {i + 1} of {steps}: {user[:40]}…")
        session.run_turn(user, golden=golden)
    progress(len(PLANTED) / steps, f"turn {steps} of {steps}: the question")
    last = session.run_turn(QUESTION, prefill=PREFILL, answer=FACT)
    progress(1.0, "done")
    tokens = session.states["full"].tokens
    before: TurnResult = session.turns[-2]  # the caches as the question arrived
    fact = find_span(lm, tokens[: before.total_tokens], FACT)
    return session, {
        "model": lm.facts.name, "budget": budget, "fact": FACT, "fact_positions": fact,
        "question": QUESTION, "question_start": before.total_tokens, "total_tokens": last.total_tokens,
        "segments": before.segments, "token_texts": token_texts(lm, tokens[: before.total_tokens]),
        "policies": {
            name: {
                "correct": bool(p.correct), "reply": p.reply, "error": p.error,
                "kept_share": kept_share(before.policies[name].retained, fact),
                "retained": before.policies[name].retained,
                "kl": [t.policies[name].kl for t in session.turns],
            }
            for name, p in last.policies.items()
        },
    }


def retention_figures(result: Result) -> list[Figure]:
    """A recall bar and one retained map per policy with the fact's span marked."""
    fact, n = result["fact_positions"], result["question_start"]
    pols = result["policies"]
    out = [Figure(fact_kept_figure(result, POLICY_LABELS),
                  "; ".join(f"{label(k)} {'answered ' + result['fact'] if v['correct'] else 'missed'} "
                            f"(holding {pct(v['kept_share'])} of the code's keys)" for k, v in pols.items()) + ".")]
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
            f"Layer {layer}, KV head 0 of {label(name)} held positions {keep}{more}; over all layers and KV heads it held "
            f"{pct(p['kept_share'])} of the keys of the code at {span_text(fact)}."))
    return out


def policy_table(result: Result) -> pd.DataFrame:
    """One row per policy: recall, reply, the fact's keys held, KL to Full."""
    rows = []
    for name, p in result["policies"].items():
        kl = [k for k in p["kl"] if k is not None]
        rows.append({"policy": label(name), f"recalled {result['fact']}": p["correct"], "reply": p["reply"],
                     "fact's keys held": f"{100 * p['kept_share']:.0f} %",
                     "mean KL to Full (nats)": round(statistics.fmean(kl), 3) if kl else None, "error": p["error"]})
    return pd.DataFrame(rows)


def sink_table(result: Result) -> pd.DataFrame:
    """One row per layer: attention on the first tokens and the most attended other token."""
    return pd.DataFrame([{"layer": i, f"on first {result['sink_tokens']} tokens": f"{100 * s:.1f} %",
                          "most attended other token": repr(o["token"]), "at position": o["position"],
                          "its share": f"{100 * o['share']:.1f} %"}
                         for i, (s, o) in enumerate(zip(result["first_share"], result["other"]))])


# --- lesson 1: attention sinks ---------------------------------------------------------------------

SINK_TOKENS = 4
SINK_SHARE = 0.2  # a layer "has a sink" when the first tokens draw at least this share (uniform: ~1%)
SINK_TEXT = (
    "Here is a short story I wrote for my writing class. The old lighthouse keeper climbed the stairs every "
    "evening at dusk, counting the steps as he went: one hundred and twelve of them, worn smooth by forty years "
    "of his boots. At the top he wiped the salt from the great lens, trimmed the wick and lit the lamp, and then "
    "he sat by the window with a mug of tea to watch the beam sweep across the water. Ships passed far out, their "
    "lights small as stars. Some nights a fishing boat came close enough that he could hear the engine and the "
    "voices of the crew. He kept a logbook of every vessel he saw, with the time, the weather and the direction "
    "of the wind, although nobody had asked to read it for years. In the winter the storms came in from the west "
    "and the whole tower hummed with the wind. What do you think of the story so far?"
)


def run_sinks(lm: LoadedModel, progress: Progress) -> Result:
    """One long user message through Full: where the last queries' attention goes, per layer."""
    progress(0.0, "prefilling one long message (Full)")
    session = ChatSession(lm, ChatSettings(policies=("full",), max_new_tokens=1, sink_tokens=SINK_TOKENS), CHAT_SYSTEM)
    turn = session.run_turn(SINK_TEXT, golden="I like it.")
    progress(1.0, "done")
    rec = turn.policies["full"]
    n_user = turn.segments[0]["end"]  # the statistic is of the user message's last queries, over its keys
    texts = token_texts(lm, session.states["full"].tokens[:n_user])
    other = []
    for layer in turn.profile:
        rest = layer[SINK_TOKENS:n_user]
        top = max(range(len(rest)), key=rest.__getitem__)
        other.append({"position": top + SINK_TOKENS, "token": texts[top + SINK_TOKENS], "share": rest[top]})
    return {
        "model": lm.facts.name, "tokens": n_user, "sink_tokens": SINK_TOKENS, "queries": session.settings.stat_queries,
        "first_tokens": texts[:SINK_TOKENS], "sink_mass": rec.sink_mass,
        "first_share": [statistics.fmean(heads) for heads in rec.sink_mass], "other": other,
    }


def sink_verdict(result: Result) -> Verdict:
    """StreamingLLM's claim: sinks in (nearly) every layer but the first two."""
    share = result["first_share"]
    k, n = result["sink_tokens"], len(share)
    sinks = [layer for layer, s in enumerate(share) if s >= SINK_SHARE]
    claimed = list(range(2, n))
    covered = sum(layer in sinks for layer in claimed) / len(claimed) if claimed else 0.0
    if not sinks:
        return Verdict("contradicts", f"No layer puts {pct(SINK_SHARE)} of its attention on the first {k} tokens "
                                      f"(at most {pct(max(share))}): this model shows no attention sink at the start: "
                                      "the run contradicts the claim.")
    strongest = max(sinks, key=share.__getitem__)
    where = ", ".join(span_text([a, b]) if a != b else str(a) for a, b in ranges(sinks))
    weak = [layer for layer in range(n) if layer not in sinks]
    text = (f"The last {result['queries']} queries put at least {pct(SINK_SHARE)} of their attention on the first "
            f"{k} tokens in {len(sinks)} of {n} layers (layers {where}; {pct(share[strongest])} in layer {strongest})")
    if weak:
        worst = max(weak, key=share.__getitem__)
        secondary = max(weak, key=lambda layer: result["other"][layer]["share"])
        o = result["other"][secondary]
        text += (f"; the other {len(weak)} layers put at most {pct(share[worst])} there, and layer {secondary} "
                 f"looks at {o['token']!r} (position {o['position']}) instead, with {pct(o['share'])}")
    if covered >= 0.9:
        return Verdict("supports", text + ". Sinks are where StreamingLLM says: the run supports the claim.")
    held = sum(layer in sinks for layer in claimed)
    if covered >= 0.5:  # one statement: where the claim holds, from the same count the outcome comes from
        return Verdict("mixed", text + f". StreamingLLM's 'every layer but the first two' holds in {held} of the "
                                       f"{len(claimed)} layers it names ({pct(covered)}): the sinks are real here, "
                                       f"but only in layers {where}.")
    return Verdict("contradicts", text + f". StreamingLLM's 'every layer but the first two' holds in only {held} of "
                                         f"the {len(claimed)} layers it names ({pct(covered)}): the run contradicts "
                                         "the claim.")


def sink_figures(result: Result) -> list[Figure]:
    from kvlab.viz.chat import sink_heatmap

    share, k = result["first_share"], result["sink_tokens"]
    strong = sum(s >= SINK_SHARE for heads in result["sink_mass"] for s in heads)
    top = max(range(len(share)), key=share.__getitem__)
    low = min(range(len(share)), key=share.__getitem__)
    return [
        Figure(sink_layers_figure(result),
               f"Layer {top} puts {pct(share[top])} of its attention on the first {k} tokens "
               f"({''.join(result['first_tokens'])!r}); layer {low} only {pct(share[low])}. A uniform spread "
               f"over {result['tokens']} keys would give {pct(k / result['tokens'])}."),
        Figure(sink_heatmap(result["sink_mass"], k, f"Attention on the first {k} tokens, layer × head"),
               f"Each cell is one query head; {strong} of "
               f"{sum(len(h) for h in result['sink_mass'])} heads put at least {pct(SINK_SHARE)} there."),
    ]


# --- lesson 2: sink + window vs importance scoring over turns ---------------------------------------

FACT_POLICIES = ("full", "streamingllm", "h2o", "snapkv")
FACT_BUDGET = 48


def run_planted(lm: LoadedModel, progress: Progress) -> Result:
    return planted_run(lm, FACT_POLICIES, FACT_BUDGET, progress)[1]


def _answers(result: Result, names: list[str]) -> str:
    pols = result["policies"]
    said = {n: result["fact"] if pols[n]["correct"] else repr(pols[n]["reply"].removeprefix(PREFILL).strip())
            for n in names}
    return "; ".join(f"{label(n)} held {pct(pols[n]['kept_share'])} of its keys and answered {said[n]}" for n in names)


def planted_verdict(result: Result) -> Verdict:
    """The notes: StreamingLLM suits multi-turn chat; H2O and SnapKV degrade across turns."""
    pols, fact = result["policies"], result["fact_positions"]
    where = (f"The locker code {result['fact']} sits at positions {span_text(fact)} of the {result['question_start']} "
             f"tokens before the question (budget {result['budget']} per layer and KV head)")
    if not pols["full"]["correct"]:
        return Verdict("inconclusive", f"{where}. Full itself answered {pols['full']['reply']!r}, so this model cannot "
                                       "recall the code even with every token kept: no verdict.")
    others = [n for n in pols if n != "full" and pols[n]["error"] is None]
    text = f"{where}. Full answered {result['fact']}; {_answers(result, others)}."
    window = [n for n in others if n in ("streamingllm", "window")]
    scored = [n for n in others if n not in window]
    win_ok = any(pols[n]["correct"] for n in window)
    scored_ok = [n for n in scored if pols[n]["correct"]]
    if win_ok and not scored_ok:
        return Verdict("supports", text + " Sink + window kept the fact and importance scoring lost it: the run "
                                          "supports the claim.")
    if not win_ok and scored_ok:
        return Verdict("contradicts", text + f" The window slid past the fact while {', '.join(map(label, scored_ok))} "
                                             "kept enough of it to answer: the run contradicts the claim that sink + "
                                             "window suits multi-turn chat better.")
    both = "all recalled it" if win_ok else "none recalled it"
    return Verdict("mixed", text + f" At this budget {both}: the run does not separate the two families.")


# --- lesson 3: PyramidKV's layer budgets ---------------------------------------------------------------

PYRAMID_POLICIES = ("full", "snapkv", "pyramidkv")
PYRAMID_BUDGET = 64
SPREAD_MASS = 0.9
CLOSER = 0.1  # PyramidKV counts as closer to Full when its KL is at least this much (relative) below SnapKV's


def keys_for_mass(attention: list[float], mass: float = SPREAD_MASS) -> int:
    """How many keys (largest first) hold ``mass`` of one attention row."""
    total, n = 0.0, 0
    whole = sum(attention)
    for a in sorted(attention, reverse=True):
        total += a
        n += 1
        if total >= mass * whole:
            break
    return n


def correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation (0 when either side is constant)."""
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return 0.0
    return statistics.correlation(xs, ys)


def run_pyramid(lm: LoadedModel, progress: Progress) -> Result:
    """The planted-fact conversation through SnapKV and PyramidKV at one total budget, with Full's attention spread."""
    session, result = planted_run(lm, PYRAMID_POLICIES, PYRAMID_BUDGET, progress)
    question = session.turns[-1]
    result["layer_budgets"] = {n: session.budgets[n] for n in PYRAMID_POLICIES if n != "full"}
    result["spread"] = [keys_for_mass(row[: question.segments[-2]["end"]]) for row in question.profile]
    return result


def pyramid_verdict(result: Result) -> Verdict:
    """PyramidKV: attention narrows with depth, so budgets declining bottom → top beat a uniform one."""
    spread = result["spread"]
    r = correlation(list(range(len(spread))), spread)
    pols = result["policies"]
    if not pols["full"]["correct"]:
        return Verdict("inconclusive", f"Full answered {pols['full']['reply']!r}: the preset fails on this model.")
    budgets = result["layer_budgets"]["pyramidkv"]
    kl = {n: statistics.fmean(k for k in pols[n]["kl"] if k is not None) for n in ("snapkv", "pyramidkv")}
    half = len(spread) // 2
    text = (f"Full's last queries need {statistics.fmean(spread[:half]):.0f} keys for {pct(SPREAD_MASS)} of their "
            f"attention in the lower {half} layers and {statistics.fmean(spread[half:]):.0f} in the upper ones "
            f"(correlation with depth {r:+.2f}); PyramidKV gives layer 0 {budgets[0]} slots and layer "
            f"{len(budgets) - 1} {budgets[-1]}, SnapKV {result['layer_budgets']['snapkv'][0]} everywhere. "
            "Mean KL to Full over the turns: "
            f"PyramidKV {kl['pyramidkv']:.3f}, SnapKV {kl['snapkv']:.3f}; the code: "
            f"PyramidKV {'recalled' if pols['pyramidkv']['correct'] else 'missed'}, "
            f"SnapKV {'recalled' if pols['snapkv']['correct'] else 'missed'}.")
    funnel, better = r < -0.3, kl["pyramidkv"] < (1 - CLOSER) * kl["snapkv"]
    if funnel and better:
        return Verdict("supports", text + " Attention narrows with depth and the pyramid is closer to Full: the run "
                                          "supports the claim.")
    if not funnel and not better:
        return Verdict("contradicts", text + " Attention does not narrow with depth here and the pyramid is not "
                                             "clearly closer to Full: the run contradicts the claim.")
    why = "attention narrows with depth but the pyramid is not clearly closer to Full" if funnel else \
        "the pyramid is closer to Full although attention does not narrow with depth"
    return Verdict("mixed", text + f" Here {why}.")


def pyramid_figures(result: Result) -> list[Figure]:
    spread, budgets = result["spread"], result["layer_budgets"]["pyramidkv"]
    widest = max(range(len(spread)), key=spread.__getitem__)
    short = {name: sum(b < s for b, s in zip(per_layer, spread)) for name, per_layer in result["layer_budgets"].items()}
    return [
        Figure(spread_budget_figure(result, POLICY_LABELS),
               f"Layer {widest} spreads most ({spread[widest]} keys for {pct(SPREAD_MASS)}); PyramidKV's budgets fall "
               f"from {budgets[0]} to {budgets[-1]} slots whatever the spread, and fall short of it in "
               f"{short['pyramidkv']} of {len(spread)} layers (SnapKV's in {short['snapkv']})."),
        *retention_figures(result),
    ]


LESSONS = (
    Lesson("sinks", "Attention sinks: do they exist, and in which layers?",
           "Initial tokens are attention sinks: recent queries put a large share of their attention on the first "
           "few tokens in every layer but the first two (StreamingLLM).",
           f"One ~230-token user message through Full; the share of the last 64 queries' attention on the first "
           f"{SINK_TOKENS} tokens, per layer and head, and the token each layer looks at most otherwise.",
           run_sinks, sink_verdict, sink_figures, table=sink_table),
    Lesson("planted_fact", "Sink + window vs importance scoring over turns",
           "Multi-turn chat suits StreamingLLM (sink tokens + the most recent window); importance scoring (H2O, "
           "SnapKV) degrades across turns because what one turn found important is not what the next asks.",
           f"A locker code planted in turn 1, a long turn about something else, then “{QUESTION}”; Full, "
           f"StreamingLLM, H2O and SnapKV at {FACT_BUDGET} tokens per layer and KV head, chat system message on.",
           run_planted, planted_verdict, retention_figures, table=policy_table),
    Lesson("pyramid", "PyramidKV's layer budgets",
           "Attention narrows from lower to upper layers (pyramidal funnelling), so PyramidKV gives lower layers "
           "more cache than upper ones and beats SnapKV's uniform budget at the same total; the notes warn that its "
           "fixed layer budgets do not adapt to a conversation.",
           f"The planted-fact conversation through SnapKV and PyramidKV at {PYRAMID_BUDGET} tokens per layer on "
           "average; Full's attention spread per layer at the question.",
           run_pyramid, pyramid_verdict, pyramid_figures, table=policy_table),
)
