"""Chat lessons: attention sinks, sink + window vs importance scoring over turns, PyramidKV's layer budgets."""

from __future__ import annotations

import statistics

import pandas as pd

from kvlab.engine.facts import LoadedModel
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
    span_text,
)
from kvlab.lessons.planted import (
    PLANTS,
    PREFILL,
    case_recall,
    counted_cases,
    label,
    planted_run,
    planted_table,
    policy_table,
    ranges,
    retention_figures,
    token_texts,
)
from kvlab.policies import POLICIES
from kvlab.viz.chat import sink_heatmap
from kvlab.viz.lessons import sink_layers_figure, spread_budget_figure
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings


def sink_table(result: Result) -> pd.DataFrame:
    """One row per layer: attention on the first tokens and the most attended other token."""
    return pd.DataFrame([{"layer": i, f"on first {result['sink_tokens']} tokens": f"{100 * s:.1f} %",
                          "most attended other token": repr(o["token"]), "at position": o["position"],
                          "its share": f"{100 * o['share']:.1f} %"}
                         for i, (s, o) in enumerate(zip(result["first_share"], result["other"]))])


# --- lesson 1: attention sinks ---------------------------------------------------------------------

SINK_TOKENS = 4
SINK_SHARE = 0.2  # a layer "has a sink" when the first tokens draw at least this share (uniform: ~1%)
SINK_MARGIN = 0.05  # a layer this close to SINK_SHARE could fall on either side with another text
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
    near = sum(abs(s - SINK_SHARE) < SINK_MARGIN for s in share)
    margin = f"within {100 * SINK_MARGIN:.0f} points of the {pct(SINK_SHARE)} line"
    close = (f"{near} layers lie {margin}: another text could move them across it" if near else
             f"no layer lies {margin}, so only a text that moved attention a lot would change the count")
    change = (f" Sample: one {result['tokens']}-token message, n = {n} layers. What would change it: {close}; the "
              f"verdict needs 90% of the {len(claimed)} named layers to support the claim and half to be mixed.")
    if not sinks:
        return Verdict("contradicts", f"No layer puts {pct(SINK_SHARE)} of its attention on the first {k} tokens "
                                      f"(at most {pct(max(share))}): this model shows no attention sink at the start: "
                                      "the run contradicts the claim." + change)
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
        return Verdict("supports", text + ". Sinks are where StreamingLLM says: the run supports the claim." + change)
    held = sum(layer in sinks for layer in claimed)
    if covered >= 0.5:  # one statement: where the claim holds, from the same count the outcome comes from
        return Verdict("mixed", text + f". StreamingLLM's 'every layer but the first two' holds in {held} of the "
                                       f"{len(claimed)} layers it names ({pct(covered)}): the sinks are real here, "
                                       f"but only in layers {where}." + change)
    return Verdict("contradicts", text + f". StreamingLLM's 'every layer but the first two' holds in only {held} of "
                                         f"the {len(claimed)} layers it names ({pct(covered)}): the run contradicts "
                                         "the claim." + change)


def sink_figures(result: Result) -> list[Figure]:
    """The attention on the first tokens per layer, and per layer and head, with their readings."""
    share, k = result["first_share"], result["sink_tokens"]
    strong = sum(s >= SINK_SHARE for heads in result["sink_mass"] for s in heads)
    top = max(range(len(share)), key=share.__getitem__)
    low = min(range(len(share)), key=share.__getitem__)
    return [
        Figure(sink_layers_figure(result),
               f"Layer {top} puts {pct(share[top])} of its attention on the first {k} tokens "
               f"({''.join(result['first_tokens'])!r}); layer {low} only {pct(share[low])}. A uniform spread "
               f"over {result['tokens']} keys would give the first {k} {k / result['tokens']:.1%} (the dotted line) "
               f"and any one token {1 / result['tokens']:.2%}."),
        Figure(sink_heatmap(result["sink_mass"], k, f"Attention on the first {k} tokens, layer × head"),
               f"Each cell is one query head; {strong} of "
               f"{sum(len(h) for h in result['sink_mass'])} heads put at least {pct(SINK_SHARE)} there."),
    ]


# --- lesson 2: sink + window vs importance scoring over turns ---------------------------------------

FACT_POLICIES = ("full", "streamingllm", "h2o", "snapkv")
FACT_BUDGETS = (48, 96)  # each plant at each budget is one case; the first case's caches are drawn
WINDOW_FAMILY = ("streamingllm", "window")  # sink + window; every other policy scores importance


def run_planted(lm: LoadedModel, progress: Progress) -> Result:
    """Every plant at every budget: the first case's full record (for the figures), every case's recall."""
    cases = [(plant, budget) for budget in FACT_BUDGETS for plant in PLANTS]
    result: Result = {}
    records = []
    for i, (plant, budget) in enumerate(cases):
        def step(frac: float, text: str, i: int = i, budget: int = budget) -> None:
            progress((i + frac) / len(cases), f"case {i + 1} of {len(cases)} (budget {budget}): {text}")

        record = planted_run(lm, FACT_POLICIES, budget, step, plant)[1]
        result = result or record
        records.append({"fact": record["fact"], "budget": budget, "question": record["question"],
                        "policies": {n: {k: p[k] for k in ("correct", "reply", "error", "kept_share")}
                                     for n, p in record["policies"].items()}})
    progress(1.0, "done")
    return result | {"cases": records}


def _answers(result: Result, names: list[str]) -> str:
    pols = result["policies"]
    prefill = result.get("prefill", PREFILL)
    said = {n: result["fact"] if pols[n]["correct"] else repr(pols[n]["reply"].removeprefix(prefill).strip())
            for n in names}
    return "; ".join(f"{label(n)} held {pct(pols[n]['kept_share'])} of its keys and answered {said[n]}" for n in names)


def planted_verdict(result: Result) -> Verdict:
    """The notes: StreamingLLM suits multi-turn chat; H2O and SnapKV degrade across turns.

    A case (a plant at a budget) counts where Full recalled the fact: elsewhere the model, not the cache, failed.
    The claim is about rates, so it is judged on 95 % Wilson intervals of each family's recall over the cases:
    supported when sink + window's interval lies wholly above importance scoring's, contradicted when below.
    """
    pols, fact = result["policies"], result["fact_positions"]
    cases = result["cases"]
    counted = counted_cases(result)
    others = [n for n in pols if n != "full"]
    window = [n for n in others if n in WINDOW_FAMILY]
    scored = [n for n in others if n not in WINDOW_FAMILY]
    budgets = sorted({c["budget"] for c in cases})
    first = (f"In the first case the planted code {result['fact']} sits at positions {span_text(fact)} of the "
             f"{result['question_start']} tokens before the question (budget {result['budget']} per layer and KV "
             + (f"head); Full answered {result['fact']}; "
                f"{_answers(result, [n for n in others if pols[n]['error'] is None])}." if pols["full"]["correct"] else
                f"head); Full answered {pols['full']['reply']!r}."))

    sample = (f"{len(cases)} cases ({len({c['fact'] for c in cases})} planted facts × budgets "
              f"{', '.join(map(str, budgets))}), {len(counted)} of them recalled by Full")
    per_policy = "; ".join(f"{label(n)} {case_recall(counted, [n])[0]}" for n in others)
    text = f"{first} Over {sample}: {per_policy}."
    if len(counted) < MIN_CASES:
        return inconclusive(len(counted), "cases Full recalled", MIN_CASES, text,
                            "More plants or budgets that Full recalls would decide it.")
    win_text, win = case_recall(counted, window)
    per = {n: case_recall(counted, [n])[1] for n in scored}
    worse = [n for n in scored if win.low > per[n].high]  # scoring policies sink + window clearly beats
    better = [n for n in scored if per[n].low > win.high]  # and those that clearly beat it
    if len(window) > 1:
        text += f" Sink + window together recalled {win_text}."
    reach = result["question_start"] - (fact[0] if fact else 0)  # recent tokens a window needs to hold the fact
    if scored and len(worse) == len(scored):
        return Verdict("supports", text + " Sink + window's interval lies above every importance-scoring policy's: "
                                          "sink + window "
                                          "kept the facts and importance scoring lost them: the run supports the "
                                          "claim. What would change it: cases where a scoring policy recalls as "
                                          "often.")
    if better and not worse:
        return Verdict("contradicts", text + f" {' and '.join(map(label, better))}'s interval lies above sink + "
                                             "window's: the window "
                                             "slid past the facts while importance scoring kept enough of them to "
                                             "answer: the run contradicts the claim that sink + window suits "
                                             "multi-turn chat better. What would change it: a window of at least "
                                             f"{reach} recent tokens (back to the fact), or cases where scoring loses "
                                             "the fact.")
    told = [f"{label(n)} clearly below it" for n in worse] + [f"{label(n)} clearly above" for n in better]
    some = f" for some policies ({'; '.join(told)})" if told else ""
    # some scoring policies clearly apart (not all below, or some above and some below) is a mixed result; none
    # apart decides nothing
    return Verdict("mixed" if told else "inconclusive",
                   text + " The intervals overlap" + some + ": at these budgets the run does not separate the two "
                          "families. What would change it: more cases, or budgets where one family clearly fails.")


# --- lesson 3: PyramidKV's layer budgets ---------------------------------------------------------------

PYRAMID_POLICIES = ("full", "snapkv", "pyramidkv")
PYRAMID_BUDGET = 64
SPREAD_MASS = 0.9
FUNNEL = -0.3  # attention "narrows with depth" when the keys it needs correlate with depth below this
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
    result["layer_budgets"] = {n: session.budget[n].layers for n in PYRAMID_POLICIES if n != "full"}
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
    funnel, better = r < FUNNEL, kl["pyramidkv"] < (1 - CLOSER) * kl["snapkv"]
    turns = len(pols["snapkv"]["kl"])
    change = (f" Sample: one conversation of {turns} turns, n = {len(spread)} layers for the trend; a narrowing needs "
              f"a correlation below {FUNNEL:+.1f}, and closer means a mean KL at least {pct(CLOSER)} below SnapKV's, "
              "so a KL gap that small or a trend near the line could turn with another conversation.")
    if funnel and better:
        return Verdict("supports", text + " Attention narrows with depth and the pyramid is closer to Full: the run "
                                          "supports the claim." + change)
    if not funnel and not better:
        return Verdict("contradicts", text + " Attention does not narrow with depth here and the pyramid is not "
                                             "clearly closer to Full: the run contradicts the claim." + change)
    why = "attention narrows with depth but the pyramid is not clearly closer to Full" if funnel else \
        "the pyramid is closer to Full although attention does not narrow with depth"
    return Verdict("mixed", text + f" Here {why}." + change)


def pyramid_figures(result: Result) -> list[Figure]:
    """Full's attention spread per layer against each policy's layer budgets, with its reading."""
    spread, budgets = result["spread"], result["layer_budgets"]["pyramidkv"]
    widest = max(range(len(spread)), key=spread.__getitem__)
    short = {name: sum(b < s for b, s in zip(per_layer, spread)) for name, per_layer in result["layer_budgets"].items()}
    return [
        Figure(spread_budget_figure(result, POLICIES.labels()),
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
           f"{len(PLANTS)} facts (a locker code, a wifi password, a bike lock combination), each planted in turn 1 "
           f"of its own conversation, a long turn about something else, then the question; Full, StreamingLLM, H2O "
           f"and SnapKV at {' and '.join(map(str, FACT_BUDGETS))} tokens per layer and KV head "
           f"({len(PLANTS) * len(FACT_BUDGETS)} cases), chat system message on; the figures show the first case.",
           run_planted, planted_verdict, retention_figures, table=planted_table),
    Lesson("pyramid", "PyramidKV's layer budgets",
           "Attention narrows from lower to upper layers (pyramidal funnelling), so PyramidKV gives lower layers "
           "more cache than upper ones and beats SnapKV's uniform budget at the same total; the notes warn that its "
           "fixed layer budgets do not adapt to a conversation.",
           f"The planted-fact conversation through SnapKV and PyramidKV at {PYRAMID_BUDGET} tokens per layer on "
           "average; Full's attention spread per layer at the question.",
           run_pyramid, pyramid_verdict, pyramid_figures, table=policy_table),
)
