"""The package layout keeps its import directions (docs/architecture.md): lower layers never import higher ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KVLAB = ROOT / "kvlab"
BASE = {"errors", "paths", "export", "registry", "saved", "stats", "files", "lists"}  # leaf modules every layer may use
MAX_MODULE_LINES = 400  # a longer module has more than one job

# What each package may import from kvlab (besides itself): the layers of docs/architecture.md, bottom up.
ALLOWED: dict[str, set[str]] = {
    "engine": BASE,
    "policies": BASE | {"engine"},
    "sharing": BASE | {"engine"},
    "workloads": BASE | {"engine", "policies", "sharing"},
    "viz": BASE | {"engine", "policies", "sharing", "workloads"},
    "experiments": BASE | {"engine", "policies", "sharing", "workloads", "viz"},
    "lessons": BASE | {"engine", "policies", "sharing", "workloads", "viz"},
    "cli": BASE | {"engine", "policies", "sharing", "workloads", "viz", "experiments"},
}
PACKAGES = sorted(ALLOWED)


def kvlab_imports(path: Path) -> set[str]:
    """Dotted kvlab modules a file imports, at any depth of the file (lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {n for n in names if n == "kvlab" or n.startswith("kvlab.")}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvlab")}
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module under ``root`` (a folder named kvlab) → the modules of that tree it imports, lazily too.

    ``from kvlab.a import b`` is an edge to ``kvlab.a.b`` when that is a module, else to ``kvlab.a``.
    """
    paths = {module_name_in(p, root): p for p in sorted(root.rglob("*.py"))}

    def owner(dotted: str) -> str:
        while dotted not in paths and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else owner(node.module)
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def module_name_in(path: Path, root: Path) -> str:
    """A file's dotted module name, its package path starting at ``root``'s name."""
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle a depth-first walk meets, each as the modules along it (first one repeated)."""
    found: list[list[str]] = []
    state: dict[str, str] = {}  # "open" while on the walk's path, "done" after
    path: list[str] = []

    def walk(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module)
    return found


def top_level_imports(path: Path) -> set[str]:
    """Every module name a file imports (first component)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
    return found


def files_of(package: str) -> list[Path]:
    return sorted((KVLAB / package).rglob("*.py"))


def test_every_package_has_a_layer_and_a_docstring() -> None:
    packages = {p.name for p in KVLAB.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(PACKAGES), "a new package needs its place in ALLOWED and docs/architecture.md"
    for name in PACKAGES:
        init = ast.parse((KVLAB / name / "__init__.py").read_text(encoding="utf-8"))
        assert ast.get_docstring(init), f"kvlab/{name}/__init__.py says what the package owns"


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_go_down_the_layers(package: str) -> None:
    wrong = []
    for path in files_of(package):
        for module in kvlab_imports(path):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else "kvlab"
            if target == package or target in ALLOWED[package]:
                continue
            wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_others() -> None:
    found = cycles(import_graph(KVLAB))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path: Path) -> None:
    root = tmp_path / "kvlab"
    (root / "a").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("from kvlab.a.one import f\n")
    (root / "a" / "one.py").write_text("def f():\n    from kvlab.a.two import g\n")
    (root / "a" / "two.py").write_text("from kvlab.a import one\n")
    (root / "a" / "three.py").write_text("from kvlab.a.two import g\n")
    assert cycles(import_graph(root)) == [["kvlab.a.one", "kvlab.a.two", "kvlab.a.one"]]


def test_no_module_is_over_400_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sorted(KVLAB.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not long, f"split these by job: {long}"


def test_the_workloads_do_not_import_each_other() -> None:
    wrong = []
    for workload in ("chat", "rag", "code"):
        for path in files_of(f"workloads/{workload}"):
            for module in kvlab_imports(path):
                parts = module.split(".")
                if parts[:2] == ["kvlab", "workloads"] and len(parts) > 2 and parts[2] != workload:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_core_never_imports_streamlit_or_the_pages() -> None:
    wrong = [f"{p.relative_to(ROOT)}: {sorted(m)}" for p in sorted(KVLAB.rglob("*.py"))
             if (m := top_level_imports(p) & {"streamlit", "app_pages", "ui"})]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvlab.workloads.chat.session import ChatSession\n    import streamlit as st\n")
    assert "kvlab.workloads.chat.session" in kvlab_imports(bad)
    assert "streamlit" in top_level_imports(bad)


def test_the_docs_name_every_package() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name in PACKAGES + ["workloads/chat", "workloads/rag", "workloads/code"]:
        assert f"{name.split('/')[-1]}/" in readme, f"README's layout tree names kvlab/{name}/"
        assert f"{name}/" in architecture, f"docs/architecture.md names kvlab/{name}/"


def test_docs_list_every_module() -> None:
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [str(p.relative_to(KVLAB)) for p in sorted(KVLAB.rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(KVLAB)}`" not in architecture]
    assert not missing, f"docs/architecture.md's module table lacks {missing}"


def test_each_modules_row_is_its_docstrings_first_paragraph() -> None:
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for path in sorted(KVLAB.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        first = " ".join(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))).split("\n\n")[0].split())
        row = f"| `{path.relative_to(KVLAB)}` | {first.replace('``', '`')} |"
        assert row in architecture, f"docs/architecture.md's row for {path.relative_to(KVLAB)} should read: {row}"


def test_every_page_table_shows_a_missing_value_as_a_dash() -> None:
    """st.dataframe writes "None" where a value is missing (a failed policy, a turn with nothing to score): a word a
    user reads as a result. Every table of the pages passes a placeholder."""
    tables, bare = 0, []
    for path in sorted((ROOT / "app_pages").glob("*.py")) + sorted((ROOT / "ui").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "dataframe":
                tables += 1
                if "placeholder" not in {k.arg for k in node.keywords}:
                    bare.append(f"{path.name}:{node.lineno}")
    assert tables >= 10 and bare == []  # the pages' tables were found, and none is bare


def test_every_name_the_scripts_import_from_kvlab_exists() -> None:
    """benchmarks/ and examples/ are run by hand, not by a test: a name removed from kvlab must not break them
    unseen (ruff does not check that an imported name exists)."""
    import importlib

    missing = [f"{path.relative_to(ROOT)}: {node.module}.{alias.name}"
               for folder in ("benchmarks", "examples") for path in sorted((ROOT / folder).rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlab")
               for alias in node.names if not hasattr(importlib.import_module(node.module), alias.name)]
    assert missing == []
