"""The matrix runner: cell planning, environment naming, refusals, and what survives an interrupt.

Nothing here builds an environment (that is minutes and gigabytes): cells run in this
interpreter as the "current" environment, with subjects that end before the suite starts, so
each test takes seconds. The real multi-release run is ``tests/test_matrix_real.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conformance._core.subjects import SubjectUnsupported
from conformance.cli import main
from conformance.release import matrix
from conformance.release.envs import Environment, EnvSpec, harness_requirements, harness_source


def test_env_names_follow_contents():
    assert EnvSpec("0.30.0").name == "vllm-0.30.0"
    a = EnvSpec("0.30.0", ("vllm-omni==0.30.0",))
    b = EnvSpec("0.30.0", ("vllm-omni==0.30.0",))
    assert a.name == b.name and a.name.startswith("vllm-0.30.0+")
    assert a.requirements() == ["vllm==0.30.0", "transformers<5.17", "vllm-omni==0.30.0"]


def test_release_constraints_are_keyed_by_release():
    # 0.28-0.30 float transformers past a release that breaks them; 0.31+ bound it themselves.
    assert EnvSpec("0.28.0").requirements() == ["vllm==0.28.0", "transformers<5.17"]
    assert EnvSpec("0.31.0").requirements() == ["vllm==0.31.0"]
    assert EnvSpec("0.33.0", ("x==1",)).requirements() == ["vllm==0.33.0", "x==1"]


def test_harness_installs_without_touching_vllm():
    reqs = harness_requirements()
    assert not any(r.lower().startswith("vllm") for r in reqs)
    assert any(r.startswith("pytest") for r in reqs) and any("hypothesis" in r for r in reqs)
    source = harness_source()
    assert Path(source).is_dir() or source.startswith("omni-conformance==")


def test_plan_cells_orders_releases_and_takes_extras(monkeypatch):
    def hook(subject, vllm):
        if subject == "picky":
            if vllm == "0.29.0":
                raise SubjectUnsupported("no release for 0.29")
            return [f"picky-extra=={vllm}"]
        return []

    monkeypatch.setattr(matrix, "declared_requirements", hook)
    with_ = matrix.parse_with(["upstream=six=={vllm}"])
    cells = matrix.plan_cells(["upstream", "picky"], ["0.30.0", "0.29.0", "0.28.0"], with_)
    assert [(c.vllm, c.subject) for c in cells][:2] == [("0.28.0", "upstream"), ("0.28.0", "picky")]
    by = {(c.subject, c.vllm): c for c in cells}
    assert by[("upstream", "0.30.0")].extras == ("six==0.30.0",)
    assert by[("picky", "0.28.0")].extras == ("picky-extra==0.28.0",)
    assert by[("picky", "0.29.0")].unsupported == "no release for 0.29"
    with pytest.raises(ValueError, match="SUBJECT=REQUIREMENT"):
        matrix.parse_with(["nothing"])


def _current(vllm: str = "0.33.0") -> Environment:
    return Environment(
        EnvSpec(vllm), Path(sys.prefix), Path(sys.executable), "current", current=True
    )


def _opts(tmp_path: Path) -> matrix.MatrixOptions:
    return matrix.MatrixOptions(
        out=tmp_path / "out", envs_dir=tmp_path / "envs", upstream_tests=False, timeout_s=300
    )


def test_cell_that_cannot_start_is_an_error_with_one_line(tmp_path):
    result = matrix.run_cell(
        matrix.Cell("does-not-exist", "0.33.0"), _current(), None, _opts(tmp_path)
    )
    data = json.loads((tmp_path / "out/cells/does-not-exist--vllm-0.33.0/cell.json").read_text())
    assert result.status == data["status"] == "error"
    assert "unknown subject" in data["error"] and "\n" not in data["error"]
    assert data["exit_code"] == 2 and data["report"] is None


def test_refusals_are_unsupported_not_errors(tmp_path, monkeypatch):
    # Declared before anything is built: no environment, no run.
    refused = matrix.run_cell(
        matrix.Cell("picky", "0.29.0", unsupported="no release for 0.29"),
        None,
        None,
        _opts(tmp_path),
    )
    assert refused.status == "unsupported" and refused.data["error"] == "no release for 0.29"
    # Refused by the subject's factory when check loads it: check exits 4, the cell says why.
    (tmp_path / "picky_subject.py").write_text(
        "from conformance._core.subjects import SubjectUnsupported\n"
        "def subject():\n    raise SubjectUnsupported('needs vLLM 9.9')\n"
    )
    monkeypatch.chdir(tmp_path)
    cell = matrix.run_cell(
        matrix.Cell("picky_subject:subject", "0.33.0"), _current(), None, _opts(tmp_path)
    )
    assert cell.status == "unsupported" and cell.data["exit_code"] == matrix.EXIT_UNSUPPORTED
    assert "needs vLLM 9.9" in cell.data["error"]


def test_interrupted_matrix_keeps_finished_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "current_environment", lambda spec: _current(spec.vllm))
    opts = _opts(tmp_path)
    cells = [matrix.Cell("no-such-a", "0.33.0"), matrix.Cell("no-such-b", "0.33.0")]
    seen: list[str] = []

    def say(line: str) -> None:
        seen.append(line)
        if "no-such-b" in line and "running" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        matrix.run_matrix(cells, opts, say)
    assert (opts.out / "cells/no-such-a--vllm-0.33.0/cell.json").exists()
    assert not (opts.out / "cells/no-such-b--vllm-0.33.0/cell.json").exists()
    assert matrix.merge_into(opts.out, seen.append) == 1  # the finished cell is an error
    merged = json.loads((opts.out / "matrix-report.json").read_text())
    assert [c["subject"] for c in merged["cells"]] == ["no-such-a"]
    # --resume keeps the finished cell and runs only what is missing.
    opts.resume = True
    seen.clear()
    matrix.run_matrix(cells[:1], opts, seen.append)
    assert any("kept from an earlier run" in line for line in seen)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--vllm", "0.27.0"], "not supported by the harness"),
        (["--vllm", "zero"], "not a vLLM version"),
        (["--with", "broken"], "SUBJECT=REQUIREMENT"),
    ],
)
def test_bad_matrix_arguments_are_one_line(capsys, argv, needle):
    assert main(["matrix", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["matrix", "--vllm", "0.33.0", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot write" in err
