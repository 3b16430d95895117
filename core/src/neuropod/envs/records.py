"""Backend environments as they are on disk: where they live, the record each holds
(``neuropod-env.json``), and reading them back, broken ones with a ``problem``."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuropod import _json
from neuropod._version import __version__
from neuropod.backend import Backend, DeviceCaps, backend_record
from neuropod.errors import NeuropodError

ENV_FILE = "neuropod-env.json"
FORMAT_VERSION = 1
LOCATION_PREFIX = "env:"
#: Per lock environment: the packages loaded with it, and when.
USERS_FILE = "neuropod-users.json"
#: The directory of the running neuropod core's sources.
CORE_DIR = Path(__file__).parent.parent

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")


def neuropod_home() -> Path:
    """Where neuropod keeps its backend environments:
    ``$NEUROPOD_HOME``, else ``$XDG_DATA_HOME/neuropod``, else ``~/.local/share/neuropod``."""
    home = os.environ.get("NEUROPOD_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    if xdg:
        return Path(xdg).expanduser() / "neuropod"
    return Path.home() / ".local" / "share" / "neuropod"


def envs_dir() -> Path:
    return neuropod_home() / "envs"


def env_interpreter(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def core_fingerprint(package_dir: str | os.PathLike[str]) -> str:
    """A hash of a neuropod core's Python sources (paths and contents).

    The parent process and a worker started from an environment must run the
    same core (the worker protocol is not versioned across releases, and an
    editable install changes without a version bump), so an environment
    records its core's fingerprint and is unusable once it differs from the
    running core's.
    """
    digest = hashlib.sha256()
    root = Path(package_dir)
    for file in sorted(root.rglob("*.py")):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        digest.update(file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def running_fingerprint() -> str:
    return core_fingerprint(CORE_DIR)


@dataclass(frozen=True)
class Environment:
    """One backend environment and what it was found to offer when created."""

    #: e.g. ``"onnx-1.20.1"``.
    name: str
    #: ``<home>/envs/<name>``.
    path: Path
    #: Its interpreter.
    python: Path
    #: What was asked for, e.g. ``"onnx==1.20.1"``.
    spec: str
    #: The backends its plugins reported at creation, with their device caps;
    #: each backend's ``location`` is ``"env:<name>"``.
    backends: tuple[tuple[Backend, DeviceCaps], ...] = ()
    #: ISO 8601 creation time (UTC).
    created: str = ""
    #: The environment's Python version, e.g. ``"3.11.9"``.
    python_version: str = ""
    #: The neuropod core version installed in it.
    neuropod_version: str = ""
    #: Why this environment cannot be used (empty when it can).
    problem: str = ""
    #: ``"backend"`` (made by ``neuropod env create``) or ``"lock"`` (built for a
    #: package's ``0/requirements.lock``, see :func:`lock_environment`).
    kind: str = "backend"
    #: For a lock environment: the packages loaded with it, each
    #: ``{"name", "source", "last_used"}``, most recent first.
    used_by: tuple[dict[str, str], ...] = ()
    #: ISO 8601 time of its last use by a package (lock environments), else "".
    last_used: str = ""

    @property
    def location(self) -> str:
        """The ``Backend.location`` of its backends."""
        return LOCATION_PREFIX + self.name

    @property
    def ok(self) -> bool:
        return not self.problem

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "python": str(self.python),
            "spec": self.spec,
            "created": self.created,
            "python_version": self.python_version,
            "neuropod": self.neuropod_version,
            "backends": [backend_record(b, c) for b, c in self.backends],
            "problem": self.problem,
            "kind": self.kind,
            "used_by": [dict(u) for u in self.used_by],
            "last_used": self.last_used,
        }


# --- reading ----------------------------------------------------------------


def _backend_from_dict(raw: Any, location: str) -> tuple[Backend, DeviceCaps]:
    if not isinstance(raw, dict):
        raise ValueError(f"a backend entry is {_show(raw)}, not an object")
    for key in ("platform", "version", "framework"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ValueError(f"a backend entry has no {key!r}: {_show(raw)}")
    for key in ("plugin", "plugin_distribution", "cuda"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ValueError(f"a backend entry's {key!r} is {_show(raw[key])}, not a string")
    cpu = raw.get("cpu", True)
    if not isinstance(cpu, bool):
        raise ValueError(f"a backend entry's 'cpu' is {_show(cpu)}, not true or false")
    ccs = raw.get("compute_capabilities") or []
    if not isinstance(ccs, list) or not all(isinstance(cc, str) for cc in ccs):
        raise ValueError(f"a backend entry's 'compute_capabilities' is {_show(ccs)}, not a list of strings")
    backend = Backend(
        platform=raw["platform"],
        version=raw["version"],
        framework=raw["framework"],
        plugin=raw.get("plugin") or raw["platform"],
        plugin_distribution=raw.get("plugin_distribution") or "",
        location=location,
    )
    return backend, DeviceCaps(cpu=cpu, cuda=raw.get("cuda"), compute_capabilities=tuple(ccs))


def _show(value: object) -> str:
    # Bounded: a record is the user's file, but one huge value should not swamp `neuropod env list`.
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_environment(path: Path) -> Environment:
    """The environment in one directory; a problem is recorded, never raised."""
    try:
        return _read_record(path)
    except (OSError, ValueError, TypeError) as e:  # e.g. a directory we may not look into
        return Environment(
            path.name, path, env_interpreter(path), "",
            problem=f"cannot be read: {e}; remove it with: neuropod env remove {path.name}",
        )


def _read_record(path: Path) -> Environment:
    name = path.name
    python = env_interpreter(path)
    env_file = path / ENV_FILE
    try:
        with open(env_file, encoding="utf-8") as f:
            data = _json.loads(f.read(_json.MAX_BYTES + 1))  # bounded: the record could be a link to /dev/zero
        if not isinstance(data, dict):
            raise ValueError("the top level is not an object")
        raw_backends = data.get("backends") or []
        if not isinstance(raw_backends, list):
            raise ValueError(f"'backends' is {_show(raw_backends)}, not a list")
        backends = tuple(_backend_from_dict(raw, LOCATION_PREFIX + name) for raw in raw_backends)
    except FileNotFoundError:
        return Environment(
            name, path, python, "",
            problem=f"incomplete: it has no {ENV_FILE} (was its creation interrupted?); "
            f"remove it with: neuropod env remove {name}",
        )
    except (OSError, ValueError, TypeError) as e:
        return Environment(
            name, path, python, "",
            problem=f"unreadable {env_file}: {e}; remove it with: neuropod env remove {name}",
        )
    kind = "lock" if data.get("kind") == "lock" else "backend"
    used_by = read_users(path) if kind == "lock" else ()
    env = Environment(
        name=name,
        path=path,
        python=python,
        spec=str(data.get("spec", "")),
        backends=backends,
        created=str(data.get("created", "")),
        python_version=str(data.get("python_version", "")),
        neuropod_version=str(data.get("neuropod", "")),
        kind=kind,
        used_by=used_by,
        last_used=used_by[0]["last_used"] if used_by else "",
    )
    fingerprint = data.get("neuropod_fingerprint") or "unrecorded"
    if fingerprint != running_fingerprint():
        env = dataclasses.replace(env, problem=(
            f"its neuropod core ({env.neuropod_version or '?'}, sources {fingerprint}) is not the one running here "
            f"({__version__}, sources {running_fingerprint()}), and a worker must run the same core as its caller; "
            f"{_recreate_advice(env)}"
        ))  # fmt: skip
    elif not python.exists():  # also a dangling link: the base interpreter is gone
        problem = (
            f"its interpreter {python} is missing (was the Python it was made from removed?); {_recreate_advice(env)}"
        )
        env = dataclasses.replace(env, problem=problem)
    return env


def _recreate_advice(env: Environment) -> str:
    if env.kind == "lock":
        return "it is rebuilt the next time a package with its lock is loaded (or remove it: neuropod env prune)"
    return f"recreate it with: neuropod env create {env.spec or 'PLATFORM==VERSION'} --replace"


def _entries() -> Iterator[Path]:
    root = envs_dir()
    try:
        children = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        # Loading a model must not fail because the environments cannot be listed; say so once.
        warnings.warn(f"The backend environments in {root} cannot be listed ({e}); none are used", stacklevel=3)
        return
    for child in children:
        try:
            is_dir = child.is_dir()
        except OSError:
            is_dir = True  # listed, and read_environment says what is wrong with it
        if not child.name.startswith(".") and is_dir:
            yield child


def list_environments() -> list[Environment]:
    """Every backend environment, by name; broken ones carry a ``problem``."""
    return [read_environment(p) for p in _entries()]


def get_environment(name: str) -> Environment:
    """The environment called ``name``.

    :raises NeuropodError: there is none; the message lists those there are.
    """
    check_name(name)
    path = envs_dir() / name
    if not path.is_dir():
        names = [p.name for p in _entries()]
        have = f"the environments are: {', '.join(names)}" if names else "there are none"
        raise NeuropodError(
            f"No backend environment {name!r} in {envs_dir()}; {have}. "
            "Create one with: neuropod env create PLATFORM==VERSION"
        )
    return read_environment(path)


def environment_backends() -> list[tuple[Backend, DeviceCaps]]:
    """The backends of every usable backend environment, for resolution.

    Lock environments are left out: each serves only the packages whose lock it was built from.
    """
    return [pair for env in list_environments() if env.ok and env.kind == "backend" for pair in env.backends]


def environment_of(backend: Backend) -> Environment | None:
    """The environment a backend lives in, or None for an in-process backend."""
    if not backend.location.startswith(LOCATION_PREFIX):
        return None
    return get_environment(backend.location[len(LOCATION_PREFIX):])


def check_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name):
        raise NeuropodError(
            f"{name!r} is not a valid environment name: use letters, digits, '.', '_', '+' and '-', "
            "starting with a letter or digit"
        )


def read_users(path: Path) -> tuple[dict[str, str], ...]:
    try:
        with open(path / USERS_FILE, encoding="utf-8") as f:
            data = _json.loads(f.read(_json.MAX_BYTES + 1))
        users = [
            {k: str(u.get(k, "")) for k in ("name", "source", "last_used")}
            for u in data.get("packages", []) if isinstance(u, dict)
        ]  # fmt: skip
    except (OSError, ValueError, TypeError, AttributeError):
        return ()
    return tuple(sorted(users, key=lambda u: u["last_used"], reverse=True))


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
