"""The README stays true: the two commands exist, the files it names exist, nothing is pasted twice."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_two_commands_exist_and_ci_runs_the_test_command() -> None:
    assert "make run" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_named_repository_paths_exist() -> None:
    named = set(re.findall(r"`((?:kvlab|data|tests|benchmarks|app_pages|ui|docs|\.ci)/[^`\s]*|app\.py)`", README))
    named |= set(re.findall(r"\]\(((?:docs|data)/[^)\s]+)\)", README))  # images and links
    assert len(named) >= 8
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"README names paths that do not exist: {missing}"


def test_no_paragraph_is_repeated_and_the_size_is_sane() -> None:
    paragraphs = [p.strip() for p in README.split("\n\n") if len(p.strip()) > 80]
    repeated = {p[:60] for p in paragraphs if paragraphs.count(p) > 1}
    assert not repeated, f"paragraphs pasted more than once: {repeated}"
    assert len(README.splitlines()) < 600


def test_the_lesson_list_matches_the_lessons() -> None:
    from kvlab.lessons import LESSONS

    listed = re.findall(r"^\d+\. \*\*(.+?)\*\*", README.split("**Lessons**", 1)[1], re.M)
    titles = [lesson.title for lesson in LESSONS.values()]
    assert len(listed) == len(titles)
    wrong = [(a, b) for a, b in zip(listed, titles) if not b.startswith(a)]
    assert not wrong, f"README's lesson list differs from kvlab/lessons (README, lesson): {wrong}"
