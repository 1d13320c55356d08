"""The README and docs/results.md stay true: the two commands exist, the files and sections they name exist,
nothing is pasted twice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")


def test_the_two_commands_exist_and_ci_runs_the_test_command() -> None:
    assert "make run" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def named_paths(text: str) -> set[str]:
    """Repository paths a document names in code spans and links (a link's #section dropped)."""
    named = set(re.findall(r"`((?:kvlab|data|tests|benchmarks|app_pages|ui|docs|\.ci)/[^`\s]*|app\.py)`", text))
    named |= {link.split("#")[0] for link in re.findall(r"\]\(((?:docs|data)/[^)\s]+)\)", text)}
    return named


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("name,text", [("README.md", README), ("docs/results.md", RESULTS)])
def test_named_repository_paths_exist(name: str, text: str) -> None:
    named = named_paths(text)
    assert len(named) >= 2
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{name} names paths that do not exist: {missing}"


def test_readme_links_to_sections_of_the_results_that_exist() -> None:
    sections = {anchor(h) for h in re.findall(r"^#+ (.+)$", RESULTS, re.M)}
    linked = re.findall(r"\(docs/results\.md#([^)]+)\)", README)
    assert linked, "the README points to its results"
    assert not [a for a in linked if a not in sections], (linked, sections)
    assert "code at" not in README, "history belongs in docs/results.md"


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
