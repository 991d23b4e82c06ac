"""The gate imports no runtime: ``conformance`` and ``invariants`` never reach into ``omni_runtime``.

The harness and the suite check any runtime through the ``Subject`` protocol; the only part of
this repository's runtime they may load is ``omni_runtime.platform`` (vLLM's platform plugin,
which vLLM loads by itself). Two independent guards, both static and fast:

* an AST scan of every ``.py`` file under ``conformance/`` and ``invariants/`` for ``import``
  and ``from ... import`` statements, ``importlib.import_module`` / ``__import__`` calls and any
  string literal that is a dotted path into ``omni_runtime`` (a ``"pkg.mod:attr"`` spec resolved
  at run time is an import too); a planted file proves the scan reports each form;
* the import-linter contract in ``pyproject.toml`` that says the same, checked to exist, to
  cover both packages, and to forbid every module ``omni_runtime`` has on disk except the
  platform plugin (a contract listing yesterday's modules would let a new one through).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GATE_PACKAGES = ("conformance", "invariants")
RUNTIME = "omni_runtime"
ALLOWED = "omni_runtime.platform"
CONTRACT_PREFIX = "The gate checks subjects it does not know"
# A literal that reads as a dotted path (optionally ``module:attr``): no spaces, no sentence.
DOTTED = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*\.?(:[\w.]*)?")


def _allowed(module: str) -> bool:
    """``omni_runtime.platform`` itself or anything inside it."""
    return module == ALLOWED or module.startswith(ALLOWED + ".") or module.startswith(ALLOWED + ":")


def _is_runtime(module: str) -> bool:
    return module == RUNTIME or module.startswith((RUNTIME + ".", RUNTIME + ":"))


def _import_call_target(node: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("...")`` / ``import_module`` /
    ``__import__("...")`` when it is a string literal."""
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def runtime_references(path: Path, label: str) -> list[str]:
    """``label:line: what`` for every way ``path`` imports or names a runtime module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    call_literals: set[int] = set()

    def hit(node: ast.AST, what: str) -> None:
        found.append((getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_runtime(alias.name) and not _allowed(alias.name):
                    hit(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_runtime(node.module) and not _allowed(node.module):
                if node.module == RUNTIME:
                    names = [a.name for a in node.names if f"{RUNTIME}.{a.name}" != ALLOWED]
                    if names:
                        hit(node, f"from {RUNTIME} import {', '.join(names)}")
                else:
                    hit(node, f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            target = _import_call_target(node)
            if target is not None:
                call_literals.add(id(node.args[0]))
                if _is_runtime(target) and not _allowed(target):
                    hit(node, f"dynamic import of {target!r}")
    for node in ast.walk(tree):
        if id(node) in call_literals:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()
            if text.startswith(RUNTIME + ".") and DOTTED.fullmatch(text) and not _allowed(text):
                hit(node, f"dotted path {text!r}")
    return [f"{label}:{line}: {what}" for line, what in sorted(found)]


def scan(roots: Iterable[Path], base: Path) -> list[str]:
    found: list[str] = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            found.extend(runtime_references(path, path.relative_to(base).as_posix()))
    return found


def test_gate_imports_no_runtime():
    roots = [ROOT / name for name in GATE_PACKAGES]
    files = [p for r in roots for p in r.rglob("*.py")]
    assert len(files) > 20, f"scan sees only {len(files)} files: wrong root {ROOT}?"
    found = scan(roots, ROOT)
    assert not found, "the gate reaches into the runtime:\n" + "\n".join(found)


def test_scan_reports_every_planted_form(tmp_path):
    """Positive control: each way of loading a runtime module is reported, with its line;
    the platform plugin and prose that merely mentions a module are not."""
    pkg = tmp_path / "conformance"
    pkg.mkdir()
    (pkg / "planted.py").write_text(
        '"""Docs may mention ``omni_runtime.sched.OmniARScheduler`` in a sentence."""\n'
        "import importlib\n"
        "import omni_runtime.platform\n"
        "from omni_runtime.platform import register\n"
        "from omni_runtime import platform\n"
        "import omni_runtime\n"  # 6
        "import omni_runtime.sched as s\n"  # 7
        "from omni_runtime.payload import StagePayload\n"  # 8
        "from omni_runtime import differences, platform as p\n"  # 9
        "\n"
        "def load():\n"
        '    importlib.import_module("omni_runtime.worker")\n'  # 12
        '    __import__("omni_runtime")\n'  # 13
        '    importlib.import_module("omni_runtime.platform")\n'
        '    return "omni_runtime.sched:OmniARScheduler"\n'  # 15
        "\n"
        'WORKER = "omni_runtime.worker.OmniARWorker"\n'  # 17
        'PREFIX = f"omni_runtime.{load}"\n'  # 18
        'PLATFORM = "omni_runtime.platform:register"\n'
    )
    (pkg / "clean.py").write_text("import vllm\nNAME = 'omni_runtime is the runtime here'\n")
    found = scan([pkg], tmp_path)
    assert found == [
        "conformance/planted.py:6: import omni_runtime",
        "conformance/planted.py:7: import omni_runtime.sched",
        "conformance/planted.py:8: from omni_runtime.payload import ...",
        "conformance/planted.py:9: from omni_runtime import differences",
        "conformance/planted.py:12: dynamic import of 'omni_runtime.worker'",
        "conformance/planted.py:13: dynamic import of 'omni_runtime'",
        "conformance/planted.py:15: dotted path 'omni_runtime.sched:OmniARScheduler'",
        "conformance/planted.py:17: dotted path 'omni_runtime.worker.OmniARWorker'",
        "conformance/planted.py:18: dotted path 'omni_runtime.'",
    ]


def _gate_contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    named = [c for c in contracts if str(c.get("name", "")).startswith(CONTRACT_PREFIX)]
    assert len(named) == 1, (
        f"expected one import-linter contract named {CONTRACT_PREFIX!r}..., found "
        f"{[c.get('name') for c in contracts]}"
    )
    return named[0]


def test_import_linter_contract_declares_the_boundary():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    linter = config["tool"]["importlinter"]
    assert {"conformance", "invariants", RUNTIME} <= set(linter["root_packages"])
    contract = _gate_contract()
    assert contract["type"] == "forbidden"
    assert set(contract["source_modules"]) == set(GATE_PACKAGES)
    forbidden = set(contract["forbidden_modules"])
    assert ALLOWED not in forbidden, "the platform plugin is the one module the gate may load"
    # Every module of the runtime on disk except the platform plugin, so a new one is covered.
    on_disk = {
        f"{RUNTIME}.{p.stem}"
        for p in (ROOT / RUNTIME).iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    missing = sorted(on_disk - {ALLOWED} - forbidden)
    assert not missing, f"the gate contract does not forbid {missing}"


def test_import_linter_contract_holds(tmp_path):
    """The boundary contract itself, run by import-linter (its Python API, this interpreter)."""
    from invariants.test_ar_inv_003_workers import import_linter_config, run_import_linter

    config = import_linter_config(ROOT / "pyproject.toml", tmp_path)
    proc = run_import_linter(config, tmp_path)
    kept = config.read_text().count("[[tool.importlinter.contracts]]")
    assert proc.returncode == 0 and f"{kept} kept, 0 broken" in proc.stdout, proc.stdout[-3000:]
