"""Isolated Python environments, one per vLLM release (and extra packages), for the matrix.

An environment holds one vLLM release exactly as its own wheel pins it (torch and all), the
extra packages a subject asked for, and this harness (the published gate, or this checkout's
development install with its runtime, which pins vLLM 0.33.0) installed next to them without
touching vLLM (``--no-deps``, then its own requirements minus vLLM). Environments live under
``--envs-dir`` (default ``$OMNI_CONFORMANCE_ENVS`` or ``~/.cache/omni-conformance/envs``), are
named after their contents, and are reused when their recorded contents match.

uv builds them when available (resolving from the index, one cache hard-linked into every
environment, so releases that pin the same torch share its files); ``python -m venv`` + pip is
the fallback, slower and without the sharing. Either way the installer runs with the user's pip
configuration set aside (``PIP_CONFIG_FILE`` = the null device, no ``PIP_FIND_LINKS``): a local
find-links folder or index override meant for the host Python can pull a torch build that does
not match the torchvision/torchaudio vLLM pins, and ``import vllm`` then fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import Distribution, PackageNotFoundError, distribution, distributions
from pathlib import Path

from conformance._core import processes
from conformance._core.vllm_compat.versions import ByRelease, Change

# The gate as published, and this repository's development install (the gate and its runtime);
# a cell gets whichever this copy runs from.
DISTRIBUTION = "omni-conformance"
DEVELOPMENT = "omni-conformance-dev"
MARKER = ".omni-conformance-env.json"
ENVS_ENV = "OMNI_CONFORMANCE_ENVS"


class EnvBuildError(RuntimeError):
    """An environment could not be built; the message is one line naming the failing step."""


def default_envs_dir() -> Path:
    return Path(os.environ.get(ENVS_ENV) or Path.home() / ".cache" / "omni-conformance" / "envs")


def _installed() -> Distribution | None:
    """The installed harness distribution; a build's ``.egg-info`` in the working directory can
    shadow it on ``sys.path``, so prefer the copy that records where it was installed from."""
    names = (DISTRIBUTION, DEVELOPMENT)
    found = [d for d in distributions() if (d.metadata["Name"] or "").lower() in names]
    for d in found:
        if d.read_text("direct_url.json"):
            return d
    return found[0] if found else None


def harness_source() -> str:
    """What to install as the harness: the local checkout this copy runs from, else the release.

    An editable or local install records its folder in ``direct_url.json``; a copy installed
    from an index is reinstalled from the index at the same version.
    """
    dist = _installed()
    if dist is None:
        root = Path(__file__).resolve().parents[2]
        if (root / "pyproject.toml").exists():
            return str(root)
        raise EnvBuildError(f"{DISTRIBUTION} is not installed and no checkout was found")
    raw = dist.read_text("direct_url.json")
    if raw:
        url = json.loads(raw).get("url", "")
        if url.startswith("file://"):
            return url[len("file://") :]
    return f"{dist.metadata['Name']}=={dist.version}"


def harness_requirements() -> list[str]:
    """The harness's own requirements, without vLLM (the cell pins that) and without extras."""
    dist = _installed()
    requires = (dist.requires or []) if dist is not None else []
    out = []
    for req in requires:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        name = spec.strip().split("[")[0]
        for sep in ("=", "<", ">", "!", "~", " "):
            name = name.split(sep)[0]
        if name.lower() == "vllm":
            continue
        out.append(spec.strip())
    return out


# What an environment adds to a vLLM release's own requirements, by release: upper bounds a
# release did not declare, whose absence lets a newer dependency break it.
RELEASE_CONSTRAINTS: ByRelease[tuple[str, ...]] = ByRelease(
    "environment constraints",
    # 0.28-0.30 require transformers>=5.x with no upper bound; 5.17 removed
    # PixtralRotaryEmbedding, which their Pixtral code imports, so vLLM's own multimodal
    # scheduler tests fail to build a model config (36 of 320 on 0.28) with the newest release.
    ("transformers<5.17",),
    [Change("0.31.0", (), "vLLM declares transformers<5.18 itself and no longer imports it")],
)


@dataclass(frozen=True)
class EnvSpec:
    """What one environment holds: a vLLM release and extra requirements."""

    vllm: str
    extras: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        if not self.extras:
            return f"vllm-{self.vllm}"
        digest = hashlib.sha256("\n".join(sorted(self.extras)).encode()).hexdigest()[:8]
        return f"vllm-{self.vllm}+{digest}"

    def requirements(self) -> list[str]:
        return [f"vllm=={self.vllm}", *RELEASE_CONSTRAINTS.at(self.vllm), *sorted(self.extras)]


@dataclass
class Environment:
    """A built environment: where its interpreter is and how it was made."""

    spec: EnvSpec
    path: Path
    python: Path
    installer: str
    reused: bool = False
    build_s: float = 0.0
    current: bool = False  # the interpreter running the matrix itself
    log: list[str] = field(default_factory=list)

    def script(self, name: str) -> list[str]:
        """A console script of this environment, run through its own interpreter."""
        if self.current:
            return [str(self.python), "-m", _MODULE_OF.get(name, name)]
        exe = self.python.parent / name
        return [str(exe)] if exe.exists() else [str(self.python), "-m", _MODULE_OF.get(name, name)]


_MODULE_OF = {"omni-conformance": "conformance.cli"}


def find_uv() -> list[str] | None:
    exe = shutil.which("uv")
    if exe:
        return [exe]
    try:
        import uv  # type: ignore[import-not-found]

        return [str(uv.find_uv_bin())]
    except (ImportError, FileNotFoundError, AttributeError):
        return None


def choose_installer(wanted: str) -> str:
    if wanted == "pip":
        return "pip"
    if find_uv() is not None:
        return "uv"
    if wanted == "uv":
        raise EnvBuildError("--installer uv: uv is not installed (pip install uv)")
    return "pip"


def installer_env(installer: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PIP_FIND_LINKS", None)
    env["PIP_CONFIG_FILE"] = os.devnull
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    if installer == "uv":
        env.setdefault("UV_LINK_MODE", "hardlink")  # share the cache's files between envs
        # Hosts that set PYTHONDONTWRITEBYTECODE leave a fresh env without bytecode and its
        # imports several times slower; compiling at install time pays that once.
        env.setdefault("UV_COMPILE_BYTECODE", "1")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def env_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def installed_vllm(python: Path) -> str | None:
    code = "from importlib.metadata import version; print(version('vllm'))"
    try:
        out = processes.run([str(python), "-c", code], capture=True, timeout_s=120)
    except OSError:
        return None
    # A timed-out child was stopped by a signal: its negative exit status says no.
    return out.stdout.strip() or None if out.returncode == 0 else None


def _run(cmd: Sequence[str], env: dict[str, str], log: Callable[[str], None], step: str) -> None:
    log(f"$ {' '.join(cmd)}")
    # No time bound: a first install downloads gigabytes; an interrupt stops the group.
    proc = processes.run(cmd, env=env, capture=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        log(line)
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        last = tail[-1].strip() if tail else f"exit {proc.returncode}"
        raise EnvBuildError(f"{step} failed: {last}")


def current_environment(spec: EnvSpec) -> Environment | None:
    """The running interpreter, when it already is the environment ``spec`` asks for."""
    if spec.extras:
        return None
    try:
        have = distribution("vllm").version
    except PackageNotFoundError:
        return None
    if have != spec.vllm:
        return None
    return Environment(
        spec, Path(sys.prefix), Path(sys.executable), "current", reused=True, current=True
    )


def build_environment(
    spec: EnvSpec,
    envs_dir: Path,
    *,
    installer: str = "auto",
    python: str | None = None,
    harness: str | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> Environment:
    """Build (or reuse) the environment for ``spec``; always (re)install the harness into it."""
    chosen = choose_installer(installer)
    path = envs_dir / spec.name
    py = env_python(path)
    marker = path / MARKER
    env = installer_env(chosen)
    started = time.monotonic()
    reused = False
    if marker.exists() and py.exists():
        try:
            recorded = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            recorded = {}
        reused = (
            recorded.get("requirements") == spec.requirements() and installed_vllm(py) == spec.vllm
        )
    uv = find_uv() if chosen == "uv" else None
    if not reused:
        if path.exists():
            shutil.rmtree(path)  # a half-built or different environment: start over
        path.parent.mkdir(parents=True, exist_ok=True)
        base = python or sys.executable
        if uv:
            _run([*uv, "venv", "-q", "--python", base, str(path)], env, log, "creating the venv")
            _run(
                [*uv, "pip", "install", "--python", str(py), *spec.requirements()],
                env,
                log,
                f"installing vllm=={spec.vllm}",
            )
        else:
            _run([base, "-m", "venv", str(path)], env, log, "creating the venv")
            _run(
                [str(py), "-m", "pip", "install", "-q", *spec.requirements()],
                env,
                log,
                f"installing vllm=={spec.vllm}",
            )
        got = installed_vllm(py)
        if got != spec.vllm:
            raise EnvBuildError(f"environment {path} has vLLM {got}, expected {spec.vllm}")
    source = harness or harness_source()
    editable = Path(source).is_dir()
    harness_args = ["-e", source] if editable else [source]
    reqs = harness_requirements()
    if uv:
        # uv makes venvs without pip; upstream-tests fetches vLLM's sdist with the env's pip.
        reqs.append("pip")
    if uv:
        pip = [*uv, "pip", "install", "--python", str(py)]
        quiet: list[str] = ["-q"]
    else:
        pip = [str(py), "-m", "pip", "install"]
        quiet = ["-q"]
    # --no-deps: the harness's own pin on vLLM must not replace the release under test.
    _run([*pip, *quiet, "--no-deps", *harness_args], env, log, "installing the harness")
    if reqs:
        _run([*pip, *quiet, *reqs], env, log, "installing the harness's requirements")
    got = installed_vllm(py)
    if got != spec.vllm:
        raise EnvBuildError(f"installing the harness changed vLLM to {got} in {path}")
    marker.write_text(
        json.dumps(
            {
                "requirements": spec.requirements(),
                "installer": chosen,
                "harness": source,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            indent=2,
        )
    )
    return Environment(spec, path, py, chosen, reused=reused, build_s=time.monotonic() - started)


def disk_usage(paths: Sequence[Path]) -> int:
    """Bytes used by ``paths`` together, counting each hard-linked file once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root in paths:
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                total += st.st_blocks * 512
    return total
