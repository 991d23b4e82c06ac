"""``omni-conformance matrix --ray ADDRESS``: each (subject, vLLM release) cell a Ray task.

A cell's task is the local matrix's own cell (``conformance.release.matrix.run_cell``) run on
whichever node takes it: the node builds or reuses that release's environment in its own
environments folder and runs the cell's interpreter as a child process there, into a scratch
folder; the task returns the cell's folder as files, which the driver writes under
``<out>/cells/`` the moment the task ends (``cell.json`` last and atomically), so an interrupted
driver keeps every finished cell and ``merge`` reads them as it reads a local matrix's. A cell
whose task is lost past Ray's retries, or outlives its bound, is an error cell with the cause.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conformance.release.matrix import (
    Cell,
    MatrixOptions,
    _environment_for,
    _existing,
    duration_text,
    run_cell,
)

CELL_FILE = "cell.json"


def _ray_pythonpath() -> tuple[str, ...]:
    """The folders Ray's runtime environment put on this worker's path (a ``module:attr``
    subject's own source), for the cell's child interpreter."""
    return tuple(p for p in sys.path if "runtime_resources" in p)


def cell_body(
    cell_data: dict[str, Any], opts_data: dict[str, Any], board: Any = None
) -> dict[str, Any]:
    """Run one cell here (a Ray task's body); its folder's files, its status and this node."""
    from conformance.cluster.shard_run import node_name

    cell = Cell(**{**cell_data, "extras": tuple(cell_data["extras"])})
    if board is not None:
        board.started.remote(cell.dirname, node_name())
    scratch = Path(tempfile.mkdtemp(prefix="omni-conformance-cell-"))
    lines: list[str] = []
    try:
        from conformance.release.envs import default_envs_dir

        given = opts_data.get("envs_dir")
        fields = {
            **opts_data,
            "out": scratch,
            "envs_dir": Path(given) if given else default_envs_dir(),
        }
        fields["pythonpath"] = _ray_pythonpath()
        opts = MatrixOptions(**fields)
        env = env_error = None
        if cell.unsupported is None:
            from conformance.release.envs import EnvSpec

            env, env_error = _environment_for(
                EnvSpec(cell.vllm, cell.extras), opts, lines.append, 1, 1
            )
        result = run_cell(cell, env, env_error, opts)
        folder = scratch / "cells" / cell.dirname
        files = {
            str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        return {"status": result.status, "files": files, "node": node_name(), "lines": lines}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_cell_files(cell_dir: Path, files: dict[str, bytes]) -> None:
    cell_dir.mkdir(parents=True, exist_ok=True)
    (cell_dir / CELL_FILE).unlink(missing_ok=True)
    for rel, data in files.items():
        if rel == CELL_FILE:
            continue
        target = cell_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    tmp = cell_dir / (CELL_FILE + ".tmp")
    tmp.write_bytes(files[CELL_FILE])
    tmp.replace(cell_dir / CELL_FILE)  # last and atomic: a cell.json means a whole cell


def _lost_cell(cell: Cell, opts: MatrixOptions, cause: str) -> str:
    """Write an error cell naming why its task gave no result (run_cell without environment)."""
    run_cell(cell, None, cause, opts)
    return "error"


def run_matrix_ray(
    cells: Sequence[Cell],
    opts: MatrixOptions,
    say: Callable[[str], None],
    address: str,
    retries: int,
    envs_given: bool = False,
) -> int:
    """Run every cell as a Ray task; the number of cells finished."""
    import ray
    from ray.exceptions import RayError

    from conformance.cluster.ray_env import connect, nodes_alive, start_board, take_events

    joined = connect(address, sorted({c.subject for c in cells}))
    try:
        board = start_board()
        task = ray.remote(num_cpus=1, max_retries=retries, retry_exceptions=False)(cell_body)
        opts_data = {
            f.name: getattr(opts, f.name)
            for f in dataclasses.fields(opts)
            if f.name not in ("out", "pythonpath")
        }
        # The environments folder each node uses: the one asked for, else the node's default.
        opts_data["envs_dir"] = str(opts.envs_dir) if envs_given else None
        pending: dict[Any, tuple[int, Cell, float]] = {}
        total = len(cells)
        for i, c in enumerate(cells, 1):
            prior = _existing(opts.out / "cells" / c.dirname) if opts.resume else None
            if prior is not None:
                say(f"[{i}/{total}] {c.label}: {prior['status']} (kept from an earlier run)")
                continue
            data = {**dataclasses.asdict(c), "extras": list(c.extras)}
            pending[task.remote(data, opts_data, board)] = (i, c, time.monotonic())
        say(f"matrix --ray: {len(pending)} cell task(s) on {joined}, {nodes_alive()} node(s)")
        # A cell runs check and upstream-tests, each bounded by the cell timeout, after its
        # environment is built or reused: past three bounds its task is given up.
        limit = 3 * opts.timeout_s
        done = 0
        since: dict[str, float] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=5.0)
            for dirname, node in take_events(board):
                since[dirname] = time.monotonic()
                say(f"    {dirname}: started on {node}")
            for ref in ready:
                i, c, t0 = pending.pop(ref)
                try:
                    got = ray.get(ref)
                    for line in got["lines"]:
                        say(f"    {line}")
                    _write_cell_files(opts.out / "cells" / c.dirname, got["files"])
                    status, where = got["status"], got["node"]
                except (RayError, KeyError) as exc:
                    cause = " ".join(str(exc).split())[:240]
                    status, where = _lost_cell(c, opts, f"cell task lost: {cause}"), "?"
                done += 1
                took = duration_text(time.monotonic() - t0)
                say(
                    f"[{i}/{total}] {c.label}: {status} on {where} in {took} ({len(pending)} running)"
                )
            now = time.monotonic()
            for ref, (i, c, _t0) in list(pending.items()):
                if c.dirname in since and now - since[c.dirname] > limit:
                    ray.cancel(ref, force=True)
                    pending.pop(ref)
                    _lost_cell(c, opts, f"no result after {limit:.0f} s; cancelled")
                    done += 1
                    say(f"[{i}/{total}] {c.label}: error (no result after {limit:.0f} s)")
    finally:
        ray.shutdown()
    return done
