"""Joining a Ray cluster for ``check --ray`` and ``matrix --ray``: the address (``auto``: a cluster
already running on this machine, else a local instance this command starts and stops), the job's
runtime environment (a ``module:attr`` subject from the user's own path shipped to every node in
``py_modules``), and the remote options every task shares (retries on a lost node or worker).
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Ray retries a task whose worker or node died this many times (system failures only: a shard
# whose pytest failed is a result, not a retry).
DEFAULT_RETRIES = 3


def _installed_roots() -> list[Path]:
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    roots.update({sys.prefix, sys.base_prefix})
    return [Path(r).resolve() for r in roots if r]


def subject_py_modules(spec: str) -> list[str]:
    """The local source a ``module:attr`` subject needs on every node: its top-level package's
    folder (or its module's file) when that is not installed in this interpreter's site
    folders; nothing for a registered name or an installed package (install it on every node)."""
    if ":" not in spec:
        return []
    top = spec.split(":", 1)[0].split(".")[0]
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)  # the console script does not put the working folder there
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    finally:
        if added:
            sys.path.remove(cwd)
    if found is None or not found.origin or found.origin in ("built-in", "frozen"):
        return []
    origin = Path(found.origin).resolve()
    path = origin.parent if found.submodule_search_locations else origin
    roots = _installed_roots()
    if any(root == path or root in path.parents for root in roots):
        return []
    return [str(path)]


def runtime_env(subjects: Sequence[str]) -> dict[str, Any]:
    """The job's runtime environment: the gate's variables and the subjects' own source."""
    env_vars = {"HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    env_vars.update({k: v for k, v in os.environ.items() if k.startswith("OMNI_CONFORMANCE_")})
    out: dict[str, Any] = {"env_vars": env_vars}
    modules = sorted({m for s in subjects for m in subject_py_modules(s)})
    if modules:
        out["py_modules"] = modules
    return out


def connect(address: str, subjects: Sequence[str], local_cpus: int | None = None) -> str:
    """``ray.init`` for this command; how it joined ("cluster at ADDRESS" or "local instance")."""
    import ray

    env = runtime_env(subjects)
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": "WARNING"}
    if address == "auto":
        try:
            ray.init(address="auto", runtime_env=env, **quiet)
            return "the cluster running on this machine"
        except ConnectionError:
            pass
        ray.init(
            num_cpus=local_cpus,
            include_dashboard=False,
            object_store_memory=300 * 2**20,
            runtime_env=env,
            **quiet,
        )
        return "a local Ray instance"
    ray.init(address=address, runtime_env=env, **quiet)
    return f"the cluster at {address}"


def nodes_alive() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def start_board() -> Any:
    """An actor (no CPU) where tasks say they started and on which node: the driver's progress
    per node, each task's start time for its bound, and how often Ray ran it (its retries)."""
    import ray

    @ray.remote(num_cpus=0)
    class Board:
        def __init__(self) -> None:
            self.events: list[tuple[str, str]] = []

        def started(self, key: str, node: str) -> None:
            self.events.append((key, node))

        def take(self) -> list[tuple[str, str]]:
            out, self.events = self.events, []
            return out

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the driver's node: a worker node lost mid-run must not take the board with it.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return Board.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]


def take_events(board: Any) -> list[tuple[str, str]]:
    """What tasks told the board since the last call (nothing if the board cannot answer)."""
    import ray
    from ray.exceptions import RayError

    try:
        return list(ray.get(board.take.remote(), timeout=30))
    except (RayError, TimeoutError):
        return []
