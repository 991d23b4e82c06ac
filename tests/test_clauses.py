"""The repository explains itself: one clause table, docs that define what the code cites, and no
reference to a document the repository does not hold.

* Every clause id (``C-xx``) cited in the code, the tests and the docs is defined in
  ``conformance/_core/clauses.py``, and every clause defined there is cited somewhere.
* ``docs/contracts.md`` defines exactly those clauses, each under a heading
  ``### C-xx · <title>`` with the table's title and a line naming its invariant or group.
* The compat report counts exactly the table's clauses and invariants.
* A ``clauses(...)`` marker with an id the table lacks fails collection, naming the test and id.
* No file references a document that is not in the repository: a ``*.md`` path that does not
  exist, an issue-tracker number, a folder beside the checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance._core import clauses
from conformance._core.report import CLAUSES as REPORT_CLAUSES
from conformance._core.report import INVARIANTS as REPORT_INVARIANTS
from conformance.cli.check import _plugin_installed

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "docs" / "contracts.md"
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yml", ".yaml", ".cfg", ".ini", ".txt"}
SKIP_DIRS = {
    "build",
    "dist",
    "compat-report",
    "conformance-failures",
    "mutation-work",
    "__pycache__",
}
# Files the tools write (the compat, matrix, release-diff and mutation reports' Markdown): named,
# never shipped.
WRITTEN_BY_TOOLS = {
    "compat-report.md",
    "matrix-report.md",
    "release-diff.md",
    "score.md",
    "reach.md",
}
# The table itself, its documentation and this test define or name ids rather than cite them.
DEFINERS = {
    Path("conformance/_core/clauses.py"),
    Path("docs/contracts.md"),
    Path("tests/test_clauses.py"),
}


def _repository_files() -> list[Path]:
    """Tracked and new (not ignored) files, relative to the root; a plain walk without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        names = [Path(line) for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [
                d
                for d in dirs
                if d in (".ci", ".github")
                or not (d.startswith(".") or d in SKIP_DIRS or d.endswith(".egg-info"))
            ]
            names += [Path(folder, f).relative_to(ROOT) for f in files]
    return sorted(
        p
        for p in names
        if (p.suffix in TEXT_SUFFIXES or p.parts[0] == ".ci")
        and not any(part.endswith(".egg-info") or part in SKIP_DIRS for part in p.parts)
        and (ROOT / p).is_file()
    )


FILES = _repository_files()


def _text(path: Path) -> str:
    return (ROOT / path).read_text(encoding="utf-8", errors="replace")


def _cited() -> dict[str, set[Path]]:
    where: dict[str, set[Path]] = {}
    for path in FILES:
        if path in DEFINERS:
            continue
        for cid in clauses.cited(_text(path)):
            where.setdefault(cid, set()).add(path)
    return where


def test_every_cited_clause_is_defined_and_every_defined_clause_is_cited():
    cited = _cited()
    undefined = {cid: sorted(map(str, paths)) for cid, paths in cited.items()}
    undefined = {cid: where for cid, where in undefined.items() if cid not in clauses.CLAUSES}
    assert not undefined, f"cited but not defined in conformance/_core/clauses.py: {undefined}"
    never_cited = sorted(set(clauses.CLAUSES) - set(cited))
    assert not never_cited, f"defined but cited nowhere: {never_cited}"


def test_the_table_is_well_formed():
    known = set(clauses.INVARIANTS) | set(clauses.GROUPS)
    for cid, clause in clauses.CLAUSES.items():
        assert clause.id == cid and re.fullmatch(r"C-\d{2}", cid), clause
        assert clause.invariant in known, clause
        assert clause.title and "\n" not in clause.title and len(clause.title) <= 80, clause
    # Every invariant and group has clauses.
    assert {c.invariant for c in clauses.CLAUSES.values()} == known


def _documented() -> dict[str, tuple[str, str]]:
    """``C-xx -> (title, invariant)`` from the clause sections of docs/contracts.md."""
    text = CONTRACTS.read_text(encoding="utf-8")
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    found: dict[str, tuple[str, str]] = {}
    for section in sections:
        heading, _, body = section.partition("\n")
        m = re.fullmatch(r"(C-\d{2}) · (.+)", heading.strip())
        assert m, f"docs/contracts.md: a clause heading is '### C-xx · title', not {heading!r}"
        owner = re.search(r"^(?:Invariant|Group): ([\w-]+)\.$", body, flags=re.M)
        assert owner, f"docs/contracts.md: {m.group(1)} names no invariant or group"
        assert m.group(1) not in found, f"docs/contracts.md defines {m.group(1)} twice"
        found[m.group(1)] = (m.group(2).strip(), owner.group(1))
    return found


def test_contracts_doc_defines_exactly_the_table():
    documented = _documented()
    assert sorted(documented) == sorted(clauses.CLAUSES)
    for cid, (title, owner) in documented.items():
        clause = clauses.CLAUSES[cid]
        assert (title, owner) == (clause.title, clause.invariant), cid
    text = CONTRACTS.read_text(encoding="utf-8")
    for inv_id, title in {**clauses.INVARIANTS, **clauses.GROUPS}.items():
        assert f"| {inv_id} | {title} |" in text, f"docs/contracts.md's table lacks {inv_id}"


def test_the_report_counts_the_tables_clauses():
    assert REPORT_CLAUSES == {cid: c.invariant for cid, c in clauses.CLAUSES.items()}
    assert REPORT_INVARIANTS == clauses.INVARIANTS


def test_an_unknown_clause_in_a_marker_fails_collection(tmp_path):
    (tmp_path / "test_unknown_clause.py").write_text(
        "import pytest\n\n\n"
        "@pytest.mark.clauses('C-01', 'C-99')\n"
        "def test_cites_a_clause_nobody_defined():\n"
        "    pass\n"
    )
    plugin = [] if _plugin_installed() else ["-p", "conformance.plugin"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *plugin, "-o", "addopts=", "-q", "-p", "no:cacheprovider"]
        + [str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "test_cites_a_clause_nobody_defined: C-99" in out, out[-3000:]
    assert "conformance/_core/clauses.py" in out, out[-3000:]


# ---- references to documents ----------------------------------------------------------------

_MD_PATH = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)*[\w-][\w./-]*\.md)\b")
_MD_LINK = re.compile(r"\]\(([^)#\s]+)")
_ISSUE = re.compile(r"\bissues?\s*#?\d+", re.I)
_BESIDE = re.compile(r"\.\./shared\b")


def _exists(path: Path) -> bool:
    """``path`` exists with exactly this spelling (``DESIGN.md`` is not ``design.md``, even on a
    file system that ignores case)."""
    path = path.resolve()
    return path.exists() and path.name in os.listdir(path.parent)


def _missing_documents(path: Path, text: str) -> list[str]:
    problems = []
    here = (ROOT / path).parent
    for ref in _MD_PATH.findall(text):
        if Path(ref).name in WRITTEN_BY_TOOLS:
            continue
        # Relative to the file, to the root, or a name in docs/ (the README's layout lists them).
        if not any(_exists(base / ref) for base in (here, ROOT, ROOT / "docs")):
            problems.append(f"{path}: refers to {ref}, which is not in the repository")
    for ref in _MD_LINK.findall(text) if path.suffix == ".md" else ():
        if "://" in ref or ref.startswith("mailto:"):
            continue
        target = (here / ref).resolve()
        if not target.is_relative_to(ROOT) or not _exists(target):
            problems.append(f"{path}: links to {ref}, which is not in the repository")
    for m in _ISSUE.finditer(text):
        problems.append(f"{path}: cites {m.group(0)!r}; say what it asks for instead")
    for m in _BESIDE.finditer(text):
        problems.append(f"{path}: refers to {m.group(0)}, outside the repository")
    return problems


def test_no_reference_to_a_document_the_repository_does_not_hold():
    problems = []
    for path in FILES:
        if path == Path("tests/test_clauses.py"):
            continue
        problems += _missing_documents(path, _text(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "text",
    # Assembled at run time, so this file itself holds no reference to a missing document.
    [
        "see " + "DESIGN" + ".md",
        "as " + "STYLE" + ".md says",
        "clauses in " + "CONTRACTS" + ".md",
        "issue" + " 6 item 8",
        ".." + "/shared",
    ],
)
def test_the_reference_check_sees_a_missing_document(text):
    assert _missing_documents(Path("conformance/example.py"), text)
