"""A lesson's run as a saved record: written with its stamp and verdict, opened again without a run."""

from __future__ import annotations

from kvlab.errors import KvlabError
from kvlab.lessons.base import Lesson, Result, Verdict
from kvlab.saved import Stamp, stamp_of

LESSON_FORMAT = 1  # the "kvlab_lesson" field of a saved lesson run


def lesson_record(lesson: Lesson, result: Result, verdict: Verdict, made: Stamp) -> dict:
    """A lesson's run as one JSON record: its stamp, the claim and preset, the verdict and the run's result."""
    return {"kvlab_lesson": LESSON_FORMAT, **made.as_dict(), "lesson": lesson.key, "claim": lesson.claim,
            "preset": lesson.preset, "verdict": {"outcome": verdict.outcome, "text": verdict.text}, "result": result}


def lesson_from_json(data: object, lessons: dict[str, Lesson]) -> tuple[Lesson, Result, Stamp]:
    """A saved lesson run's lesson, result and stamp, checked by drawing its verdict and figures (no model).

    Files saved before the stamp (no ``kvlab_lesson`` field, but a lesson and a result) open too, stamped
    unknown; the verdict is computed again from the result, as the page computes it after a run.
    """
    if not isinstance(data, dict) or data.get("kvlab_lesson", LESSON_FORMAT) != LESSON_FORMAT \
            or not {"lesson", "result"} <= set(data):
        raise KvlabError(f"this is not a kvlab lesson run (no 'lesson' and 'result', or 'kvlab_lesson' is not "
                         f"{LESSON_FORMAT})")
    lesson = lessons.get(data["lesson"]) if isinstance(data["lesson"], str) else None
    if lesson is None:
        raise KvlabError(f"the file's lesson {data['lesson']!r} is not one of this kvlab's: {', '.join(lessons)}")
    result = data["result"]
    try:
        lesson.verdict(result)
        lesson.figures(result)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise KvlabError(f"the file's result does not fit the lesson “{lesson.title}” ({type(exc).__name__}: "
                         f"{exc})") from exc
    return lesson, result, stamp_of(data)
