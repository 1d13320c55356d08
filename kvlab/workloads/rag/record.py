"""A RAG run as a saved record: the questions' results with their stamp, opened again without the model, and
what a replay of it needs (each question's settings, the corpus's fingerprint) and where a replay differs."""

from __future__ import annotations

import json
from dataclasses import fields

from kvlab.errors import KvlabError
from kvlab.export import to_json
from kvlab.saved import Stamp, at_most, differences, stamp_of
from kvlab.workloads.rag.corpus import Corpus, Question
from kvlab.workloads.rag.run import QuestionResult, RagSettings, StrategyResult

RAG_FORMAT = 1  # the "kvlab_rag" field of a saved run
_STRATEGY_FIELDS = {f.name for f in fields(StrategyResult)}
# measures that are NaN when not measured: JSON writes NaN as null, so null reads back as NaN
_MEASURES = {f.name for f in fields(StrategyResult) if isinstance(f.default, float)}


def made_on(corpus: Corpus) -> dict:
    """The corpus a run was made on, as its record names it: name and fingerprint."""
    return {"name": corpus.name, "digest": corpus.digest()}


def rag_record(results: list[QuestionResult], made: Stamp, corpus: dict | None = None) -> dict:
    """The questions' results as one JSON record, stamped with when, on which model and kvlab version; with the
    corpus they ran on (``made_on``) when the list began on fresh caches, so that it can be replayed."""
    where = {} if corpus is None else {"corpus": corpus}
    return {"kvlab_rag": RAG_FORMAT, **made.as_dict(), **where, "questions": [r.as_dict() for r in results]}


def _question_result(d: dict) -> QuestionResult:
    q = d["question"]
    question = Question(**{**q, "docs": tuple(q.get("docs", ()))})
    unknown = [k for r in d["results"] for k in r if k not in _STRATEGY_FIELDS]
    if unknown:
        raise TypeError(f"unknown fields {sorted(set(unknown))}")
    settings = d.get("settings")
    return QuestionResult(question=question, retrieved=[(str(doc), float(s)) for doc, s in d["retrieved"]],
                          prompt_tokens=int(d["prompt_tokens"]), reference_answer=str(d["reference_answer"]),
                          results=[_strategy_result(r) for r in d["results"]],
                          settings=None if settings is None else RagSettings(
                              **{**settings, "strategies": tuple(settings["strategies"])}))


def _strategy_result(r: dict) -> StrategyResult:
    return StrategyResult(**{k: float("nan") if v is None and k in _MEASURES else v for k, v in r.items()})


def rag_from_json(data: object) -> tuple[list[QuestionResult], Stamp]:
    """A saved RAG run's results and stamp, checked, with no model; a bare list (files saved before the
    stamp) opens too, stamped unknown."""
    if isinstance(data, list):
        data = {"kvlab_rag": RAG_FORMAT, "questions": data}
    if not isinstance(data, dict) or data.get("kvlab_rag") != RAG_FORMAT:
        raise KvlabError(f"this is not a kvlab RAG run (no 'kvlab_rag': {RAG_FORMAT}, nor a list of questions)")
    try:
        results = [_question_result(d) for d in data["questions"]]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise KvlabError(f"the RAG run file is incomplete or malformed ({exc})") from exc
    if not results:
        raise KvlabError("the RAG run file holds no question")
    return results, stamp_of(data)


def replay_refusal(data: dict, results: list[QuestionResult], corpus: Corpus) -> str | None:
    """Why a saved RAG run cannot be replayed on ``corpus``, in one sentence; None when it can: every question
    kept its settings, and the run began on fresh caches of this very corpus (the fixed-ordering prefix cache's
    hits depend on every prompt run before)."""
    where = data.get("corpus") if isinstance(data, dict) else None
    if not isinstance(where, dict) or any(r.settings is None for r in results):
        return "this file was saved before RAG runs kept their corpus and settings, so it cannot be replayed"
    if where.get("digest") != corpus.digest():
        return (f"this run was made on the corpus {where.get('name')!r}; replay it on that corpus "
                f"(the one in use is {corpus.name!r})")
    return None


def rag_differences(saved: list[QuestionResult], again: list[QuestionResult]) -> list[str]:
    """Where a replay's questions differ from the saved ones, timings aside, each named by its question (its place
    in the list and its id) and strategy, as the arena's name their rows; empty: identical."""
    def plain(results: list[QuestionResult]) -> list[dict]:
        return json.loads(to_json([r.as_dict() for r in results]))

    def by_strategy(question: dict) -> dict[str, dict]:
        return {r["strategy"]: r for r in question["results"]}

    out = [] if len(saved) == len(again) else [f"questions saved {len(saved)}, replayed {len(again)}"]
    for n, (old, new) in enumerate(zip(plain(saved), plain(again)), 1):
        where = f"question {n} ({old['question'].get('id')})"
        rest = [{k: v for k, v in q.items() if k != "results"} for q in (old, new)]
        out += differences(*rest, where, most=None)
        file, rerun = by_strategy(old), by_strategy(new)
        out += [f"{where} · {s}: only in the {'file' if s in file else 're-run'}"
                for s in [*file, *rerun] if (s in file) != (s in rerun)]
        for s in (s for s in file if s in rerun):
            out += differences(file[s], rerun[s], f"{where} · {s}", most=None)
    return at_most(out)
