"""``omni-conformance matrix --ray ADDRESS``: each (subject, vLLM release) cell a Ray task.

A cell's task is the local matrix's own cell (``conformance.release.matrix.run_cell``) run on
whichever node takes it: the node builds or reuses that release's environment in its own
environments folder and runs the cell's interpreter as a child process there, into a scratch
folder, under a guard (``cell_guard``) that stops the cell's processes if the task's worker dies;
the task returns the cell's folder as files, which the driver writes under ``<out>/cells/`` the
moment the task ends (``cell.json`` last and atomically), so an interrupted driver keeps every
finished cell and ``merge`` reads them as it reads a local matrix's. A cell whose task is lost
past Ray's retries, or outlives its bound, is an error cell with the cause; ``cell.json``'s
environment says on which nodes the task started (``ray``, ``ray_retried``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
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
    from conformance.cluster import cell_guard
    from conformance.cluster.shard_run import node_name

    cell = Cell(**{**cell_data, "extras": tuple(cell_data["extras"])})
    if board is not None:
        board.started.remote(cell.dirname, node_name())
    scratch = Path(tempfile.mkdtemp(prefix="omni-conformance-cell-"))
    token = f"{cell.dirname}-{uuid.uuid4().hex}"
    cell_guard.start(os.getpid(), scratch, token)
    # Every process the cell starts (environment build, check, its pytest) inherits the token.
    os.environ[cell_guard.TOKEN_ENV] = token
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
        os.environ.pop(cell_guard.TOKEN_ENV, None)
        shutil.rmtree(scratch, ignore_errors=True)  # the guard sees it gone and ends


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


def ray_fields(nodes: Sequence[str], joined: str) -> dict[str, str]:
    """What ``cell.json``'s environment says of the cell's task: where it last started, and the
    nodes it started on when Ray ran it more than once (its retries; the harness adds none)."""
    return {
        "ray": f"cell task on {nodes[-1] if nodes else 'an unknown node'} of {joined}",
        "ray_retried": f"by Ray: {' -> '.join(nodes)}" if len(nodes) > 1 else "none",
    }


def _with_ray_fields(text: bytes, fields: dict[str, str]) -> bytes:
    from conformance.release.matrix_cells import check_cell

    data = json.loads(text)
    data["environment"] = {**(data.get("environment") or {}), **fields}
    check_cell(data, CELL_FILE)  # a cell the merge would refuse is a bug here
    return json.dumps(data, indent=2).encode()


def lost_cell(
    cell: Cell, opts: MatrixOptions, cause: str, nodes: Sequence[str], joined: str
) -> str:
    """Write an error cell naming why its task gave no result (run_cell without environment)."""
    run_cell(cell, None, cause, opts)
    cell_dir = opts.out / "cells" / cell.dirname
    text = _with_ray_fields((cell_dir / CELL_FILE).read_bytes(), ray_fields(nodes, joined))
    tmp = cell_dir / (CELL_FILE + ".tmp")
    tmp.write_bytes(text)
    tmp.replace(cell_dir / CELL_FILE)
    return "error"


def task_cause(exc: Exception, retries: int) -> str:
    """One line: why a cell's task gave no cell (``exc``, from ``ray.get``)."""
    from ray.exceptions import RayError, RayTaskError

    if isinstance(exc, RayTaskError):  # the cell's own code raised: no retry (a result, not a loss)
        inner = exc.cause if isinstance(exc.cause, BaseException) else exc
        text = f"cell task raised {type(inner).__name__}: {inner}"
    elif isinstance(exc, RayError):
        text = f"cell task lost after {retries} retries by Ray: {type(exc).__name__}: {exc}"
    else:
        text = f"cell task returned no cell: {type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


def run_matrix_ray(
    cells: Sequence[Cell],
    opts: MatrixOptions,
    say: Callable[[str], None],
    address: str,
    retries: int,
    envs_given: bool = False,
) -> int:
    """Run every cell as a Ray task; the number of cells finished. Interrupted (SIGINT, or
    SIGTERM made one by the command), it cancels the cell tasks still out and re-raises: the
    cells written so far stay, and the folders of those that started have no ``cell.json``."""
    import ray
    from ray.exceptions import RayError

    from conformance.cluster.ray_env import connect, nodes_alive, start_board, take_events

    joined = connect(address, sorted({c.subject for c in cells}))
    pending: dict[Any, tuple[int, Cell, float]] = {}
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
        attempts: dict[str, list[str]] = {}  # every node each cell's task started on, in order
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=5.0)
            running = {c.dirname for _i, c, _t in pending.values()}
            for dirname, node in take_events(board):
                if dirname not in running:
                    continue  # a start told after the cell's result: already counted
                since[dirname] = time.monotonic()
                attempts.setdefault(dirname, []).append(node)
                # Like a local matrix's running cell: a folder without cell.json until it ends
                # (what an interrupted run leaves, and the merge notes as unfinished).
                cell_dir = opts.out / "cells" / dirname
                cell_dir.mkdir(parents=True, exist_ok=True)
                (cell_dir / CELL_FILE).unlink(missing_ok=True)
                again = len(attempts[dirname]) > 1
                say(
                    f"    {dirname}: started on {node}"
                    + (" (again: retried by Ray)" if again else "")
                )
            for ref in ready:
                i, c, t0 = pending.pop(ref)
                nodes = attempts.setdefault(c.dirname, [])
                detail = ""
                try:
                    got = ray.get(ref)
                    for line in got["lines"]:
                        say(f"    {line}")
                    if not nodes or nodes[-1] != got["node"]:
                        nodes.append(got["node"])  # its start was not told (yet)
                    files = dict(got["files"])
                    files[CELL_FILE] = _with_ray_fields(files[CELL_FILE], ray_fields(nodes, joined))
                    _write_cell_files(opts.out / "cells" / c.dirname, files)
                    status = got["status"]
                except (RayError, KeyError, ValueError) as exc:
                    detail = task_cause(exc, retries)
                    status = lost_cell(c, opts, detail, nodes, joined)
                    detail = f" ({detail})"
                done += 1
                took = duration_text(time.monotonic() - t0)
                where = nodes[-1] if nodes else "?"
                say(
                    f"[{i}/{total}] {c.label}: {status} on {where} in {took} "
                    f"({len(pending)} running){detail}"
                )
            now = time.monotonic()
            for ref, (i, c, _t0) in list(pending.items()):
                if c.dirname in since and now - since[c.dirname] > limit:
                    ray.cancel(ref, force=True)
                    pending.pop(ref)
                    cause = f"no result after {limit:.0f} s; cancelled"
                    lost_cell(c, opts, cause, attempts.get(c.dirname, []), joined)
                    done += 1
                    say(f"[{i}/{total}] {c.label}: error ({cause})")
        retried = {d: n for d, n in attempts.items() if len(n) > 1}
        if retried:
            named = "; ".join(f"{d} ({' -> '.join(n)})" for d, n in sorted(retried.items()))
            say(f"retried by Ray after a lost worker or node: {named}")
    except KeyboardInterrupt:
        out = sorted(c.dirname for _i, c, _t in pending.values())
        if out:
            say(f"matrix --ray: interrupted; cancelling {len(out)} cell task(s): {', '.join(out)}")
        for ref in pending:
            try:
                ray.cancel(ref, force=True)  # their guards stop what the cells started
            except RayError:
                pass
        raise
    finally:
        ray.shutdown()
    return done
