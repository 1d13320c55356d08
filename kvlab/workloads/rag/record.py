"""A RAG run as a saved record: the questions' results with their stamp, opened again without the model."""

from __future__ import annotations

from dataclasses import fields

from kvlab.errors import KvlabError
from kvlab.saved import Stamp, stamp_of
from kvlab.workloads.rag.corpus import Question
from kvlab.workloads.rag.run import QuestionResult, StrategyResult

RAG_FORMAT = 1  # the "kvlab_rag" field of a saved run
_STRATEGY_FIELDS = {f.name for f in fields(StrategyResult)}
# measures that are NaN when not measured: JSON writes NaN as null, so null reads back as NaN
_MEASURES = {f.name for f in fields(StrategyResult) if isinstance(f.default, float)}


def rag_record(results: list[QuestionResult], made: Stamp) -> dict:
    """The questions' results as one JSON record, stamped with when, on which model and kvlab version."""
    return {"kvlab_rag": RAG_FORMAT, **made.as_dict(), "questions": [r.as_dict() for r in results]}


def _question_result(d: dict) -> QuestionResult:
    q = d["question"]
    question = Question(**{**q, "docs": tuple(q.get("docs", ()))})
    unknown = [k for r in d["results"] for k in r if k not in _STRATEGY_FIELDS]
    if unknown:
        raise TypeError(f"unknown fields {sorted(set(unknown))}")
    return QuestionResult(question=question, retrieved=[(str(doc), float(s)) for doc, s in d["retrieved"]],
                          prompt_tokens=int(d["prompt_tokens"]), reference_answer=str(d["reference_answer"]),
                          results=[_strategy_result(r) for r in d["results"]])


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
