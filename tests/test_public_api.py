"""``conformance.api`` is the one module a subject imports, and it is complete.

* No module of ``omni_runtime`` or ``conformance/adapters`` imports a ``conformance`` module
  other than ``conformance.api`` (an AST scan of every import statement, nested ones included,
  and of ``importlib.import_module`` / ``__import__`` calls on literal names); a planted file
  proves the scan reports each form.
* Every name in ``conformance.api.__all__`` resolves, and the package's lazy names are exactly
  those, resolving to the same objects; importing the package alone imports no API module.
* The ``Subject`` protocol declares the optional hooks and capability hooks, ``BaseSubject``
  implements all of them, the gate's ``require`` reaches each capability hook through it, and
  loading an object that lacks members names them.
* The entry points of this repository's subjects resolve in the ``conformance_subject`` package.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import conformance
import conformance.api as api
from conformance._core.subjects import _instantiate

ROOT = Path(__file__).resolve().parent.parent
ADOPTERS = (ROOT / "omni_runtime", ROOT / "conformance" / "adapters")
PUBLIC = "conformance.api"


def _imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every module the tree imports, statically or by a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "conformance":
                # ``from conformance import api`` is the public module; any other name is not.
                for alias in node.names:
                    yield node.lineno, f"conformance.{alias.name}"
            else:
                yield node.lineno, node.module
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            arg = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
            ):
                yield node.lineno, arg.value


def private_imports(roots: tuple[Path, ...]) -> list[str]:
    """``path:line: module`` for every import of a ``conformance`` module but the API."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, module in _imported_modules(tree):
                top = module.split(".")[0]
                if top == "conformance" and module != PUBLIC:
                    found.append(f"{path.relative_to(root.parent)}:{line}: {module}")
    return found


def test_adopters_import_only_the_public_api():
    assert private_imports(ADOPTERS) == []


def test_the_scan_reports_every_form_of_private_import(tmp_path):
    pkg = tmp_path / "runtime"
    pkg.mkdir()
    (pkg / "planted.py").write_text(
        "import importlib\n"
        "from conformance.api import BaseSubject\n"  # 2: allowed
        "from conformance import api\n"  # 3: allowed
        "import conformance.api as gate\n"  # 4: allowed
        "from conformance._core.machine import TIGHT\n"  # 5
        "import conformance._core.subjects\n"  # 6
        "from conformance import cli\n"  # 7
        "import conformance\n"  # 8: the package, not the API
        "def f():\n"
        "    from conformance._core.vllm_compat.state import block_pool\n"  # 10
        '    importlib.import_module("conformance._core.config")\n'  # 11
        '    __import__("conformance.plugin")\n'  # 12
    )
    assert private_imports((pkg,)) == [
        "runtime/planted.py:5: conformance._core.machine",
        "runtime/planted.py:6: conformance._core.subjects",
        "runtime/planted.py:7: conformance.cli",
        "runtime/planted.py:8: conformance",
        "runtime/planted.py:10: conformance._core.vllm_compat.state",
        "runtime/planted.py:11: conformance._core.config",
        "runtime/planted.py:12: conformance.plugin",
    ]


def test_every_public_name_resolves():
    assert len(set(api.__all__)) == len(api.__all__), "a name is listed twice"
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert missing == []
    for name in ("BaseSubject", "Subject", "TIGHT", "release", "scheduler_holdings"):
        assert name in api.__all__


def test_the_package_names_are_the_api_names():
    """Every API name is reachable from the package, but a name that is also a subpackage of
    ``conformance`` (``release``, the release tooling) stays the subpackage there."""
    # Read from the folder: ``conformance.release`` is a namespace package, which
    # ``pkgutil.iter_modules`` does not list.
    folder = Path(conformance.__file__).parent
    subpackages = {p.stem for p in folder.iterdir() if p.is_dir() or p.suffix == ".py"}
    assert subpackages & set(api.__all__) == {"release"}
    assert conformance.__all__ == sorted(set(api.__all__) - subpackages)
    # Fresh handles: another test may have re-imported the package's modules.
    package = importlib.import_module("conformance")
    public = importlib.import_module(PUBLIC)
    for name in package.__all__:
        assert getattr(package, name) is getattr(public, name), name
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = conformance.not_a_name


def test_importing_the_package_stays_light():
    """The pytest plugin imports ``conformance`` in every pytest run: it must not pull in the
    API (and, through it, the core) until a name is asked for."""

    def loaded_after(statement: str) -> str:
        code = (
            f"import sys, conformance\n{statement}\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('conformance.', 'vllm', "
            "'torch', 'hypothesis')))\n"
            "print(loaded)\n"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert loaded_after("pass") == "[]"
    # The control: asking for a name loads the API, and the probe sees it.
    assert "'conformance.api'" in loaded_after("conformance.TIGHT")


def test_the_subject_protocol_declares_every_hook():
    members = set(api.Subject.__annotations__) | {
        n for n, v in vars(api.Subject).items() if callable(v) and not n.startswith("_")
    }
    optional = {"admit", "receive_outputs", "single_engine_client"}
    assert optional | set(api.CAPABILITY_HOOKS) <= members
    base = api.BaseSubject()
    assert isinstance(base, api.Subject)
    assert all(hasattr(base, m) for m in members)
    assert base.single_engine_client is False
    assert all(getattr(base, hook)() is None for hook in api.CAPABILITY_HOOKS)


def test_require_calls_each_capability_hook():
    from conformance._core.needs import require

    marker = {hook: object() for hook in api.CAPABILITY_HOOKS}

    class Declares(api.BaseSubject):
        name = "declares"

    for hook in api.CAPABILITY_HOOKS:
        setattr(Declares, hook, lambda self, h=hook: marker[h])
    subject = Declares()
    for hook in api.CAPABILITY_HOOKS:
        assert require(subject, hook, hook) is marker[hook]  # type: ignore[call-overload]
    for hook in api.CAPABILITY_HOOKS:
        with pytest.raises(api.NotApplicable, match=f"'base' provides no {hook}"):
            require(api.BaseSubject(), hook, hook)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="not a capability hook"):
        require(subject, "no_such_hook", "x")  # type: ignore[call-overload]


def test_loading_an_incomplete_subject_names_what_is_missing():
    class Partial:
        name = "partial"

        def scheduler_class(self, cfg: object) -> type:
            return object

    with pytest.raises(TypeError) as info:
        _instantiate(Partial, "mod:Partial")
    message = str(info.value)
    assert "conformance.api.Subject" in message and "BaseSubject" in message
    for member in ("admit", "receive_outputs", "chunk_delivery", "single_engine_client"):
        assert member in message
    assert "scheduler_class" not in message


def test_the_entry_points_resolve_in_the_subject_package():
    from omni_runtime import conformance_subject

    wanted = {
        "omni": "omni_subject",
        "omni-scheduler": "omni_scheduler_subject",
        "omni-process-stage": "process_stage_subject",
    }
    found = {ep.name: ep for ep in entry_points(group="omni_conformance.subjects")}
    for name, attr in wanted.items():
        assert found[name].value == f"omni_runtime.conformance_subject:{attr}"
        assert found[name].load() is getattr(conformance_subject, attr)
