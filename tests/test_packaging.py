"""The two published distributions and the development install.

``packaging/omni-conformance`` is the gate alone and must install beside any supported vLLM
without changing it; ``packaging/omni-runtime`` carries the exact vLLM pin and the CPU platform
plugin; the root ``pyproject.toml`` is the development install of both. See README.md,
"Installing".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GATE = ROOT / "packaging" / "omni-conformance"
RUNTIME = ROOT / "packaging" / "omni-runtime"
PLATFORM_GROUP = "vllm.platform_plugins"
# The release the install test puts beside the gate: any supported release but the one the
# runtime pins.
OTHER_VLLM = os.environ.get("OMNI_CONFORMANCE_OTHER_VLLM", "0.32.0")


def _project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.split(r"[\s\[=<>!~;]", requirement, maxsplit=1)[0].lower()


def _entry_points(project: dict) -> dict[str, dict[str, str]]:
    groups = {k: dict(v) for k, v in project.get("entry-points", {}).items()}
    groups["console_scripts"] = dict(project.get("scripts", {}))
    return groups


def _merged_entry_points(*projects: dict) -> dict[str, dict[str, str]]:
    """The entry points of ``projects`` together; AssertionError when two define one name."""
    merged: dict[str, dict[str, str]] = {}
    for project in projects:
        for group, entries in _entry_points(project).items():
            overlap = set(merged.get(group, {})) & set(entries)
            assert not overlap, f"{group}: both distributions define {sorted(overlap)}"
            merged.setdefault(group, {}).update(entries)
    return merged


def test_the_development_install_is_the_union_of_the_published_two():
    root, gate, runtime = _project(ROOT), _project(GATE), _project(RUNTIME)
    assert set(root["dependencies"]) == set(gate["dependencies"]) | set(runtime["dependencies"])
    assert {_name(r) for r in root["optional-dependencies"]["ray"]} == {"ray"}
    assert root["optional-dependencies"]["ray"] == runtime["optional-dependencies"]["ray"]
    assert root["optional-dependencies"]["ray"] == gate["optional-dependencies"]["ray"]
    assert root["optional-dependencies"]["matrix"] == gate["optional-dependencies"]["matrix"]
    assert _entry_points(root) == _merged_entry_points(gate, runtime)
    for dist in (gate, runtime):
        assert dist["version"] == root["version"]
    assert runtime["optional-dependencies"]["gate"] == [f"omni-conformance=={root['version']}"]


def test_the_union_check_sees_a_missing_or_doubled_entry_point():
    gate, runtime = _project(GATE), _project(RUNTIME)
    merged = _merged_entry_points(gate, runtime)
    # The platform plugin left out of the development install is a difference.
    pruned = {g: dict(e) for g, e in merged.items()}
    del pruned["vllm.platform_plugins"]["omni_cpu"]
    assert pruned != merged
    # The gate shipping the runtime's platform plugin as well is refused.
    doubled = {
        **gate,
        "entry-points": {**gate["entry-points"], "vllm.platform_plugins": {"omni_cpu": "x:y"}},
    }
    with pytest.raises(AssertionError, match="omni_cpu"):
        _merged_entry_points(doubled, runtime)


def _build_wheel(folder: Path, out: Path) -> zipfile.ZipFile:
    # Built from a copy: setuptools writes the build's .egg-info beside the sources (the
    # checkout's root), where it would shadow the development install's entry points.
    tree = out / "tree"
    for part in (folder.relative_to(ROOT), "conformance", "invariants", "omni_runtime"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    folder = tree / folder.relative_to(ROOT)
    # No build isolation: the development install already has setuptools and wheel, and an
    # isolated build would fetch them from the registry on every run.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(folder)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _metadata(wheel: zipfile.ZipFile) -> tuple[list[str], str, list[str]]:
    names = wheel.namelist()
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = Parser().parsestr(wheel.read(meta).decode()).get_all("Requires-Dist") or []
    eps = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
    return requires, wheel.read(eps).decode() if eps else "", names


@pytest.fixture(scope="module")
def gate_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gate-wheel")
    _build_wheel(GATE, out).close()
    (wheel,) = out.glob("*.whl")
    return wheel


def test_the_gate_wheel_requires_no_vllm_and_registers_no_platform(gate_wheel):
    with zipfile.ZipFile(gate_wheel) as wheel:
        requires, eps, names = _metadata(wheel)
    unconditional = {_name(r) for r in requires if "extra ==" not in r}
    assert not unconditional & {"vllm", "torch", "torchvision", "torchaudio"}, requires
    assert PLATFORM_GROUP not in eps
    assert "omni_conformance.subjects" in eps and "pytest11" in eps
    assert not [n for n in names if n.startswith("omni_runtime/")]
    for needed in (
        "conformance/plugin.py",
        "conformance/schemas/compat-report.schema.json",
        "conformance/assets/tiny-llama/config.json",
        "invariants/__init__.py",
    ):
        assert needed in names, f"{needed} missing from the gate wheel"
    assert [n for n in names if n.startswith("conformance/templates/")], "no report templates"


def test_the_runtime_wheel_pins_vllm_and_registers_its_platform(tmp_path):
    with _build_wheel(RUNTIME, tmp_path) as wheel:
        requires, eps, names = _metadata(wheel)
    assert "vllm==0.33.0" in requires
    assert PLATFORM_GROUP in eps and "omni_runtime.platform:register" in eps
    assert "omni_runtime/configs/default_pipeline.json" in names
    assert not [n for n in names if n.startswith(("conformance/", "invariants/"))]


def _freeze(python: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return {d["name"].lower(): d["version"] for d in json.loads(out)}


def _platform_plugins(python: Path) -> str:
    code = (
        "from importlib.metadata import entry_points; "
        f"print(sorted(e.value for e in entry_points(group={PLATFORM_GROUP!r})))"
    )
    return subprocess.run(
        [str(python), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.mark.slow
def test_installing_the_gate_beside_another_vllm_changes_nothing(gate_wheel, tmp_path):
    """A fresh environment holding another vLLM release (built with uv, whose cache makes the
    second run take seconds); pip then installs the gate wheel into it."""
    uv = shutil.which("uv")
    assert uv is not None, "the test extra installs uv, which builds the other vLLM's environment"
    env = tmp_path / f"vllm-{OTHER_VLLM}"
    subprocess.run([uv, "venv", "--quiet", "--seed", "--python", sys.executable, str(env)],
                   check=True)  # fmt: skip
    python = env / "bin" / "python"
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(python), f"vllm=={OTHER_VLLM}"],
        check=True,
    )
    before, plugins_before = _freeze(python), _platform_plugins(python)
    assert before["vllm"] == OTHER_VLLM
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         str(gate_wheel)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    after = _freeze(python)
    changed = {n: (v, after.get(n)) for n, v in before.items() if after.get(n) != v}
    assert not changed, f"installing the gate changed {changed}"
    added = set(after) - set(before)
    assert "omni-conformance" in added
    assert _platform_plugins(python) == plugins_before
    listed = subprocess.run(
        [str(env / "bin" / "omni-conformance"), "subjects"], capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "upstream" in listed.stdout
