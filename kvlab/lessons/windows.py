"""Trained vs imposed sliding windows: a windowed model's own window against a window imposed on every layer."""

from __future__ import annotations

from kvlab.engine.facts import LoadedModel
from kvlab.lessons.base import CHAT_SYSTEM, Figure, Lesson, Progress, Result, Verdict, pct, span_text
from kvlab.lessons.chat import SINK_TEXT
from kvlab.lessons.planted import (
    FACT,
    PLANTS,
    PREFILL,
    QUESTION,
    find_span,
    kept_share,
    label,
    policy_case,
    policy_table,
    retention_figures,
    token_texts,
)
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

STORY_MORE = (
    " In spring the supply boat came every second Tuesday with flour, lamp oil, letters and the newspapers of the "
    "past fortnight, which he read in order, one each morning, so that the news reached him exactly two weeks late. "
    "He did not mind. The gulls nested on the ledges below the gallery and screamed at him whenever he went out to "
    "clean the glass, and in June the chicks fell about on the rocks like grey cotton balls. His daughter wrote "
    "from the city that he should retire, that the light would soon be automatic and that nobody would thank him "
    "for another winter on the rock. He wrote back about the weather, the ships and the gulls, and never answered "
    "the question. In August a young engineer came out to measure the tower for the new machinery. She stayed three "
    "days, slept in the spare room under the stairs and asked him about every noise the building made. On the last "
    "evening they climbed to the lamp together and he showed her how to trim the wick, although she said the new "
    "lamp would never need it. The machinery arrived in October on a grey barge: a small diesel generator, a rotating "
    "electric lamp no bigger than a bucket, a box of spare bulbs and a radio that would report to the harbour office "
    "if anything failed. Two men bolted it all into place in a week while he made them soup and told them which "
    "steps were loose. When they switched it on for the first time the new beam was whiter and sharper than the old "
    "one, and it turned by itself without a sound. He stood on the gallery until midnight watching it, then went down "
    "to his room and wrote the last entry in the logbook: the date, the weather, a westerly wind, no ships. In the "
    "morning he packed his books, his mugs and the logbooks into three crates and waited on the jetty for the boat, "
    "and when it came he did not look back at the tower until the island was a dark line on the water."
)
FILLER = SINK_TEXT.removesuffix(" What do you think of the story so far?") + STORY_MORE + " Do you like how it goes on?"
REPLY_TOKENS = 6


def unavailable(lm: LoadedModel) -> str | None:
    """Why the window lesson cannot run on ``lm`` (no sliding-window layers to compare), or None."""
    if any(lm.facts.layer_windows):
        return None
    return (f"{lm.facts.name} has no sliding-window layers: every layer attends to the whole context, so there is no "
            "trained window to compare with an imposed one. The embedded Gemma-3-270M has one: 15 of its 18 layers "
            "slide over 512 tokens, 3 attend globally.")


def run_windows(lm: LoadedModel, progress: Progress) -> Result:
    """A fact, a story longer than the window, the question: Full (the trained windows) vs a window on every layer."""
    windows = [w for w in lm.facts.layer_windows if w]
    window = max(windows)
    settings = ChatSettings(policies=("full", "window", "streamingllm"), budget=window, max_new_tokens=REPLY_TOKENS)
    session = ChatSession(lm, settings, CHAT_SYSTEM)
    progress(0.0, "turn 1 of 3: the locker code")
    session.run_turn(PLANTS[0].told, golden=PLANTS[0].golden)
    progress(0.2, f"turn 2 of 3: a story longer than the {window}-token window")
    session.run_turn(FILLER, golden="Yes, it is a quiet and moving story.")
    progress(0.6, "turn 3 of 3: the question")
    last = session.run_turn(QUESTION, prefill=PREFILL, answer=FACT)
    progress(1.0, "done")
    before = session.turns[-2]
    tokens = session.states["full"].tokens[: before.total_tokens]
    fact = find_span(lm, tokens, FACT)
    sliding = [i for i, w in enumerate(lm.facts.layer_windows) if w]
    return {
        "model": lm.facts.name, "budget": window, "window": window, "sliding_layers": sliding,
        "global_layers": [i for i in range(lm.facts.n_layers) if i not in sliding],
        "fact": FACT, "fact_positions": fact, "question": QUESTION, "question_start": before.total_tokens,
        "total_tokens": last.total_tokens, "segments": before.segments, "token_texts": token_texts(lm, tokens),
        "policies": {
            name: policy_case(p, before.policies[name], fact) | {
                "global_kept": kept_share([layer for i, layer in enumerate(before.policies[name].retained)
                                           if i not in sliding], fact),
                "retained": before.policies[name].retained, "kl": [t.policies[name].kl for t in session.turns]}
            for name, p in last.policies.items()
        },
    }


def windows_verdict(result: Result) -> Verdict:
    """The notes: a sliding window (SWA) suits multi-turn chat."""
    pols, fact = result["policies"], result["fact_positions"]
    if pols["full"]["error"] or pols["full"]["kept_share"] is None:  # the reference failed: nothing to compare
        return Verdict("inconclusive", f"Full, the trained model the windows are judged against, failed "
                                       f"({pols['full']['error'] or 'nothing recorded'}): no verdict.")
    text = (f"The locker code sits at positions {span_text(fact)}, {result['question_start'] - fact[-1]} tokens before "
            f"the question: beyond the {result['window']}-token window of {len(result['sliding_layers'])} sliding "
            "layers. "
            f"Trained (Full): its {len(result['global_layers'])} global layers held {pct(pols['full']['global_kept'])} "
            f"of the code's keys ({pct(pols['full']['kept_share'])} over all "
            f"{len(result['global_layers']) + len(result['sliding_layers'])} layers, as the table counts them) and it "
            "answered "
            f"{pols['full']['reply'].removeprefix(PREFILL).strip()!r}")
    imposed = [n for n in pols if n != "full" and pols[n]["error"] is None]
    text += "".join(f"; {label(n)} imposed on every layer at {result['budget']}: {pct(pols[n]['kept_share'])} of the "
                    f"keys, answered {pols[n]['reply'].removeprefix(PREFILL).strip()!r}" for n in imposed) + "."
    change = (" Sample: one planted fact (n = 1), but what decides it is not a rate: a window holds none of the keys "
              "of a fact that lies beyond it, so it can answer only by guessing. What would change it: a fact within "
              f"the last {result['window']} tokens, or an imposed window that recalls the fact without holding it.")
    if not pols["full"]["correct"]:
        return Verdict("inconclusive", text + " The model with its trained windows did not recall the code either: no "
                                              "verdict." + change)
    if all(pols[n]["correct"] for n in imposed):
        return Verdict("supports", text + " A window on every layer recalled the code too: the run supports the "
                                          "claim." + change)
    if not any(pols[n]["correct"] for n in imposed):
        return Verdict("contradicts", text + " The trained model recalls the code through its global layers; a window "
                                             "alone loses it: the run contradicts the claim that a sliding window "
                                             "suits multi-turn chat." + change)
    return Verdict("mixed", text + " Only some imposed windows recalled the code." + change)


def windows_figures(result: Result) -> list[Figure]:
    """The planted-fact lesson's figures: the fact's keys each policy held, and what it held."""
    return retention_figures(result)


LESSONS = (
    Lesson("windows", "Trained vs imposed sliding windows",
           "Sliding-window attention suits multi-turn chat: temporal locality matches how a conversation's old turns "
           "lose relevance (the notes' StreamingLLM / SWA row).",
           "On a model with trained sliding windows (the embedded Gemma-3-270M): a locker code, a story longer than "
           "the window, then the question; Full (the model's own windows, global layers intact) vs Window and "
           "StreamingLLM imposed on every layer at the window's size.",
           run_windows, windows_verdict, windows_figures, unavailable, policy_table),
)
