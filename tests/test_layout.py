"""The repository's shape holds: no import cycle between modules, no module over 900 lines, and
every module docstring in at most 15 lines (what the module owns; the docs hold the rest)."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("omni_runtime", "conformance", "invariants", "mutation")
MAX_LINES = 900
MAX_DOCSTRING_LINES = 15


def _sources() -> list[Path]:
    skip = {"tests", ".git", "mutation-work", "build", "mutants"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts[:-1]))


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path, monkeypatch):
    package = tmp_path / "planted_cycle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from planted_cycle import b\n")
    (package / "b.py").write_text("from planted_cycle import c\n")
    (package / "c.py").write_text("import planted_cycle.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("planted_cycle", cache_dir=None)
    assert _cycles(graph) == [["planted_cycle.a", "planted_cycle.b", "planted_cycle.c"]]


def test_no_import_cycle_between_modules():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert _cycles(graph) == []


def _shape_problems(text: str) -> list[str]:
    problems = []
    lines = text.count("\n")
    if lines > MAX_LINES:
        problems.append(f"{lines} lines: split it by concern")
    doc = ast.get_docstring(ast.parse(text), clean=False)
    doc_lines = doc.strip("\n").count("\n") + 1 if doc else 0
    if doc_lines > MAX_DOCSTRING_LINES:
        problems.append(f"module docstring of {doc_lines} lines")
    return problems


def test_the_shape_check_sees_a_long_module_and_a_long_docstring():
    fits = '"""' + "\n".join(["line"] * MAX_DOCSTRING_LINES) + '"""\n' + "x = 1\n" * 10
    assert _shape_problems(fits) == []
    long_doc = '"""' + "\n".join(["line"] * (MAX_DOCSTRING_LINES + 1)) + '"""\n'
    assert _shape_problems(long_doc) == [f"module docstring of {MAX_DOCSTRING_LINES + 1} lines"]
    assert _shape_problems("x = 1\n" * (MAX_LINES + 1)) == [
        f"{MAX_LINES + 1} lines: split it by concern"
    ]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size_and_docstring(path: Path):
    assert _shape_problems(path.read_text(encoding="utf-8")) == []
