"""Backend environments: other framework versions, each in its own Python environment.

One Python process can import only one onnxruntime (or torch, or TensorFlow).
A machine offers several versions of a framework by keeping each in its own
virtual environment under ``<NEUROPOD_HOME>/envs/<name>``, with the neuropod
core, the platform's plugin and the pinned framework installed. Resolution
treats the backends of every environment as candidates beside the in-process
ones (their ``Backend.location`` is ``"env:<name>"``); a model that only an
environment can run is loaded in a worker process started from that
environment's interpreter.

::

    neuropod env create onnx==1.20.1          # -> <home>/envs/onnx-1.20.1
    neuropod env create onnx==1.24.* --name ort124
    neuropod env list [--json]
    neuropod env remove onnx-1.20.1
    neuropod env prune --days 30              # lock environments unused for 30 days

Where: ``$NEUROPOD_HOME``, else ``$XDG_DATA_HOME/neuropod``, else
``~/.local/share/neuropod`` (see :func:`neuropod_home`).

Creation (:func:`create_environment`):

1. ``python -m venv`` (the running interpreter unless ``python=`` names
   another) into a hidden temporary directory ``<home>/envs/.tmp-<name>-*``;
2. ``<env python> -m pip install`` of the matching core, the plugin and the
   framework. "Matching" means: a core or
   plugin that was installed here from a local directory or wheel (pip's
   ``direct_url.json``; editable installs included) is installed from that same
   path, not editable; otherwise ``neuropod==<this version>`` and
   ``<plugin>==<its version>``, found through the user's pip configuration
   and ``--find-links`` (e.g. ``dist/`` from ``nox -s build``). The core is
   always pinned, so pip can never pick PyPI's unrelated ``neuropod`` 0.2;
3. ``<env python> -m neuropod backends --json``: the environment's own plugins
   say, through their hooks, which backends and devices it offers; that is
   recorded in ``<env>/neuropod-env.json`` with the spec, the creation time and
   the Python version;
4. the directory is renamed into place (atomic on one file system), and the
   scripts in its ``bin/`` that name the temporary path are rewritten.

A build reports one line per step with its time (``  installing 14 locked
requirements ... 38.0 s``) to ``out`` (stderr by default); ``verbose=True``
(``--verbose``) adds pip's own output. Any failure removes the temporary
directory and raises a
:class:`~neuropod.errors.NeuropodError` with the tail of pip's output. An
existing environment of the same name is an error unless ``replace=True``
(``--replace``), which swaps the new one in only once it is complete.

Lock environments (:func:`lock_environment`) are the other kind: a package
with ``0/requirements.lock`` (for example a ``python`` package with its
requirements) runs in a worker from an environment built from that lock,
the core and the package's plugin, named ``lock-py<X.Y>-<hash of the lock>``
and shared by every package with the same lock. They are built on first
load, rebuilt when the core changes, never
offered to resolution for other packages, and ``neuropod env prune`` removes
those no package used for N days (each load records its package in
``neuropod-users.json``).

Hidden entries (``.tmp-*`` being created, ``.trash-*`` being removed,
``.locks/`` for building) are not environments. A directory without a
readable ``neuropod-env.json`` or whose
interpreter is gone is listed with a ``problem`` and offers no backends.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlparse

from neuropod import __version__, _json
from neuropod.backend import Backend, DeviceCaps, backend_record
from neuropod.errors import NeuropodError

ENV_FILE = "neuropod-env.json"
FORMAT_VERSION = 1
LOCATION_PREFIX = "env:"

#: The framework distribution pinned for each platform by ``neuropod env create``.
#: (The plugin that runs each platform is :data:`neuropod.plugins.KNOWN_PLATFORMS`.)
FRAMEWORK_DISTRIBUTIONS = {
    "onnx": "onnxruntime",
    "torchscript": "torch",
    "tensorflow": "tensorflow-cpu",
    "keras": "tensorflow-cpu",
    "tensorrt": "tensorrt",
    "torch_export": "torch",
    "aoti": "torch",
    "jax": "jax",
}

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
# PLATFORM==VERSION with VERSION a release (1.20.1, 1.20), optionally a
# wildcard (1.20.*), or a full PEP 440 version (2.13.0+cpu, 1.0rc1).
_SPEC_RE = re.compile(
    r"(?P<platform>[a-z][a-z0-9_]*)\s*==\s*(?P<version>[0-9]+(?:\.[0-9]+)*(?:\.\*|[A-Za-z0-9.+!_-]*))"
)
_TAIL_LINES = 40


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


def _env_python(path: Path) -> Path:
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
def _running_fingerprint() -> str:
    return core_fingerprint(Path(__file__).parent)


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


def _read(path: Path) -> Environment:
    """The environment in one directory; a problem is recorded, never raised."""
    try:
        return _read_record(path)
    except (OSError, ValueError, TypeError) as e:  # e.g. a directory we may not look into
        return Environment(
            path.name, path, _env_python(path), "",
            problem=f"cannot be read: {e}; remove it with: neuropod env remove {path.name}",
        )


def _read_record(path: Path) -> Environment:
    name = path.name
    python = _env_python(path)
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
    used_by = _read_users(path) if kind == "lock" else ()
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
    if fingerprint != _running_fingerprint():
        env = dataclasses.replace(env, problem=(
            f"its neuropod core ({env.neuropod_version or '?'}, sources {fingerprint}) is not the one running here "
            f"({__version__}, sources {_running_fingerprint()}), and a worker must run the same core as its caller; "
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
            is_dir = True  # listed, and _read says what is wrong with it
        if not child.name.startswith(".") and is_dir:
            yield child


def list_environments() -> list[Environment]:
    """Every backend environment, by name; broken ones carry a ``problem``."""
    return [_read(p) for p in _entries()]


def get_environment(name: str) -> Environment:
    """The environment called ``name``.

    :raises NeuropodError: there is none; the message lists those there are.
    """
    _check_name(name)
    path = envs_dir() / name
    if not path.is_dir():
        names = [p.name for p in _entries()]
        have = f"the environments are: {', '.join(names)}" if names else "there are none"
        raise NeuropodError(
            f"No backend environment {name!r} in {envs_dir()}; {have}. "
            "Create one with: neuropod env create PLATFORM==VERSION"
        )
    return _read(path)


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


# --- creating ---------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str]:
    """``"onnx==1.20.1"`` -> ``("onnx", "1.20.1")``.

    :raises NeuropodError: the spec is not ``PLATFORM==VERSION`` or the
        platform is not one neuropod can create environments for.
    """
    from neuropod.plugins import KNOWN_PLATFORMS

    m = _SPEC_RE.fullmatch(spec.strip())
    known = ", ".join(sorted(FRAMEWORK_DISTRIBUTIONS))
    if not m:
        raise NeuropodError(
            f"Environment spec {spec!r} is not PLATFORM==VERSION: write e.g. 'onnx==1.20.1' or 'onnx==1.20.*' "
            f"(platforms: {known})"
        )
    platform, version = m["platform"], m["version"]
    if platform not in FRAMEWORK_DISTRIBUTIONS or platform not in KNOWN_PLATFORMS:
        raise NeuropodError(f"Environment spec {spec!r}: unknown platform {platform!r}; the platforms are: {known}")
    from packaging.specifiers import InvalidSpecifier, Specifier

    try:
        Specifier(f"=={version}")
    except InvalidSpecifier:
        raise NeuropodError(
            f"Environment spec {spec!r}: {version!r} is not a version pip accepts; write e.g. '{platform}==1.2.3'"
        ) from None
    return platform, version


def _check_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name):
        raise NeuropodError(
            f"{name!r} is not a valid environment name: use letters, digits, '.', '_', '+' and '-', "
            "starting with a letter or digit"
        )


def _local_source(dist_name: str) -> str | None:
    """The local directory or wheel ``dist_name`` was installed from, if it was (pip's direct_url.json)."""
    import importlib_metadata

    try:
        dist = importlib_metadata.distribution(dist_name)
    except importlib_metadata.PackageNotFoundError:
        return None
    return _direct_path(dist.read_text("direct_url.json"))


def _direct_path(text: str | None) -> str | None:
    if not text:
        return None
    try:
        data = _json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or not ("dir_info" in data or "archive_info" in data):
        return None  # a VCS checkout or nothing useful
    url = urlparse(str(data.get("url", "")))
    if url.scheme != "file":
        return None
    path = unquote(url.path)
    if os.name == "nt" and re.match(r"/[A-Za-z]:", path):
        path = path[1:]
    return path if os.path.exists(path) else None


def _plugin_distribution(platform: str) -> tuple[str, str | None]:
    """(distribution name, installed version or None) of the plugin that runs ``platform``."""
    import importlib_metadata

    from neuropod.plugins import ENTRY_POINT_GROUP, KNOWN_PLATFORMS

    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == platform and ep.dist is not None:
            return ep.dist.name, ep.dist.version
    return KNOWN_PLATFORMS[platform], None


def install_requirements(platform: str, version: str) -> list[str]:
    """What ``pip install`` gets for an environment: the core, the plugin, the framework."""
    reqs = [_local_source("neuropod") or f"neuropod=={__version__}"]
    plugin, plugin_version = _plugin_distribution(platform)
    # Plugins are released with the core, so an absent plugin is pinned to the core's version.
    reqs.append(_local_source(plugin) or f"{plugin}=={plugin_version or __version__}")
    reqs.append(f"{FRAMEWORK_DISTRIBUTIONS[platform]}=={version}")
    return reqs


def _child_env() -> dict[str, str]:
    """The environment for processes run with an environment's interpreter: nothing of ours leaks in."""
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "NEUROPOD_PLUGINS", "NEUROPOD_DISABLE_PLUGINS", "VIRTUAL_ENV")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def _stream(cmd: Sequence[str], out: TextIO, what: str, *, verbose: bool = True) -> None:
    """Run ``cmd``, copying its output to ``out`` as it comes when ``verbose``; a failure raises with the tail."""
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    try:
        proc = subprocess.Popen(
            list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=_child_env(), text=True, encoding="utf-8", errors="replace", bufsize=1,
        )
    except OSError as e:
        raise NeuropodError(f"{what} could not start {cmd[0]}: {e}") from e
    with proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                if verbose:
                    out.write("    " + line)
                    out.flush()
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if code != 0:
        text = "\n".join(tail)
        raise NeuropodError(f"{what} failed (exit status {code}); the end of its output:\n{text}")


@contextlib.contextmanager
def _step(out: TextIO, label: str, verbose: bool) -> Iterator[None]:
    """One line per step of a build, with its time: ``  installing 14 locked requirements ... 38.0 s``.

    With ``verbose`` the step's own output (pip's) comes between its start and its end, so each gets a line.
    """
    print(f"  {label} ...", end="\n" if verbose else "", file=out, flush=True)
    t0 = time.perf_counter()
    ending = f"  {label}: " if verbose else " "
    try:
        yield
    except BaseException:
        print(f"{ending}failed after {time.perf_counter() - t0:.1f} s", file=out, flush=True)
        raise
    print(f"{ending}{time.perf_counter() - t0:.1f} s", file=out, flush=True)


def _ask(python: Path, *args: str, what: str) -> str:
    proc = subprocess.run(
        [str(python), *args], capture_output=True, text=True, encoding="utf-8", errors="replace",
        env=_child_env(), stdin=subprocess.DEVNULL, timeout=300,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-_TAIL_LINES:])
        raise NeuropodError(f"{what} failed (exit status {proc.returncode}):\n{tail}")
    return proc.stdout


def _resolve_python(python: str | None) -> str:
    if python is None:
        return sys.executable
    found = shutil.which(python) or (python if os.path.isfile(python) else None)
    if found is None:
        raise NeuropodError(f"--python {python!r}: no such interpreter (give a path or a command on PATH, e.g. python3.12)")
    return found


def _rewrite_scripts(path: Path, old: Path) -> None:
    """Point ``bin/`` scripts (shebangs, activate) that name the temporary path at the final one."""
    old_b, new_b = str(old).encode(), str(path).encode()
    bindir = _env_python(path).parent
    for script in bindir.iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        try:
            if script.stat().st_size > 1 << 20:
                continue
            data = script.read_bytes()
            if old_b in data:
                script.write_bytes(data.replace(old_b, new_b))
        except OSError:
            continue


def _remove_tree(path: Path) -> None:
    """Rename out of sight, then delete (a half-deleted environment is never listed)."""
    if not path.exists():
        return
    trash = Path(tempfile.mkdtemp(prefix=f".trash-{path.name}-", dir=path.parent))
    try:
        path.rename(trash / "env")
    except OSError:
        shutil.rmtree(trash, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
        return
    shutil.rmtree(trash, ignore_errors=True)


def create_environment(
    spec: str,
    *,
    name: str | None = None,
    python: str | None = None,
    find_links: Sequence[str] = (),
    replace: bool = False,
    out: TextIO | None = None,
    verbose: bool = False,
) -> Environment:
    """Create a backend environment for ``spec`` (``"onnx==1.20.1"``).

    :param name: the environment's name; by default ``<platform>-<installed version>``.
    :param python: the interpreter to base it on (a path or a command such as
        ``python3.12``); by default the running one.
    :param find_links: directories or URLs with wheels for pip (``--find-links``),
        e.g. ``dist/`` from ``nox -s build``; with the user's pip configuration
        these make creation work offline.
    :param replace: replace an existing environment of the same name (once
        the new one is complete); otherwise that is an error.
    :param out: where progress goes: a line per step with its time (default: ``sys.stderr`` when called).
    :param verbose: also copy pip's own output to ``out`` (a failure's
        message holds the end of it either way).
    :raises NeuropodError: a bad spec, an existing name, pip or the
        environment's plugins failed; nothing is left behind.
    """
    out = sys.stderr if out is None else out
    platform, version = parse_spec(spec)
    spec = f"{platform}=={version}"
    if name is not None:
        _check_name(name)
    elif "*" not in version:
        name = f"{platform}-{version}"
    if name is not None and not replace and (envs_dir() / name).exists():
        raise NeuropodError(
            f"A backend environment {name!r} already exists in {envs_dir()}: remove it with "
            f"`neuropod env remove {name}`, pass --replace, or choose another --name"
        )
    base_python = _resolve_python(python)
    reqs = install_requirements(platform, version)
    links = [arg for d in find_links for arg in ("--find-links", str(d))]
    step = f"installing the neuropod core, {_plugin_distribution(platform)[0]} and {reqs[-1]}"
    print(f"Creating a backend environment for {spec}{f' named {name!r}' if name else ''}:", file=out, flush=True)
    return _build(
        name, base_python, spec, platform,
        [([*links, *reqs], f"pip install of {spec} into the new environment", step)],
        {"requirements": reqs}, replace=replace, out=out, verbose=verbose,
    )  # fmt: skip


def _build(
    name: str | None, base_python: str, spec: str, platform: str, installs: Sequence[tuple[list[str], str, str]],
    extra: dict[str, Any], *, replace: bool, out: TextIO, verbose: bool = False,
) -> Environment:  # fmt: skip
    """Make a venv from ``base_python`` in a hidden directory, run each ``pip install``, record what it
    offers and move it into place as ``name`` (by default ``<platform>-<version found>``).

    :param installs: per ``pip install``: its arguments, what it is (for an error) and its progress label.
    :param verbose: copy pip's output to ``out``; otherwise ``out`` gets one line per step.
    :raises NeuropodError: any step failed (with the end of its output); nothing is left behind.
    """
    root = envs_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name or platform}-", dir=root))
    try:
        env_python = _env_python(tmp)
        if verbose:
            print(f"Creating backend environment for {spec} with {base_python} in {tmp}", file=out, flush=True)
        with _step(out, f"creating the virtual environment ({base_python})", verbose):
            _stream([base_python, "-m", "venv", "--prompt", f"neuropod:{name or spec}", str(tmp)], out,
                    f"Creating a virtual environment with {base_python}", verbose=verbose)  # fmt: skip
        for args, what, label in installs:
            with _step(out, label, verbose):
                if verbose:
                    print(f"Running {what}: pip install {' '.join(args)}", file=out, flush=True)
                _stream([str(env_python), "-m", "pip", "install", *args], out, what, verbose=verbose)
        with _step(out, "checking what the new environment offers", verbose):
            python_version, core_dir = _ask(
                env_python, "-c", "import os, platform, neuropod; print(platform.python_version()); "
                "print(os.path.dirname(neuropod.__file__))", what="Asking the new environment's Python and core",
            ).strip().splitlines()[-2:]  # fmt: skip
            fingerprint = core_fingerprint(core_dir)
            if fingerprint != _running_fingerprint():
                raise NeuropodError(
                    f"The neuropod core installed in the new environment ({core_dir}) differs from the one running "
                    f"here ({Path(__file__).parent}); install this core from a wheel or directory pip can reach "
                    "(e.g. --find-links dist/ after `nox -s build`)"
                )
            report = _ask(
                env_python, "-m", "neuropod", "backends", "--json",
                what=f"Listing the backends of the new environment ({env_python} -m neuropod backends --json)",
            )
        try:
            listed = _json.loads(report)
            # Its own backends only: not those it can reach through environments or other interpreters.
            raw_backends = [
                b for b in listed["backends"] if isinstance(b, dict) and b.get("location", "in-process") == "in-process"
            ]
        except (ValueError, KeyError, TypeError) as e:
            raise NeuropodError(f"`neuropod backends --json` in the new environment printed no backend list: {e}") from e
        offered = [b for b in raw_backends if b.get("platform") == platform]
        if not offered:
            failed = "; ".join(str(f) for f in listed.get("failed_plugins") or []) or "none failed"
            raise NeuropodError(
                f"The new environment for {spec} offers no {platform!r} backend (plugins that failed: {failed})"
            )
        if name is None:
            name = f"{platform}-{offered[0]['version']}"
            _check_name(name)
        record = {
            "format": FORMAT_VERSION,
            "name": name,
            "spec": spec,
            "created": _now(),
            "python_version": python_version,
            "base_python": base_python,
            "neuropod": listed.get("neuropod", ""),
            "neuropod_fingerprint": fingerprint,
            **extra,
            "backends": [{k: v for k, v in b.items() if k != "location"} for b in raw_backends],
            "failed_plugins": listed.get("failed_plugins") or [],
        }
        (tmp / ENV_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        final = root / name
        _move_into_place(tmp, final, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _rewrite_scripts(final, tmp)
    env = _read(final)
    print(f"Created {env.kind} environment {env.name!r} at {env.path}: "
          + ", ".join(b.id for b, _ in env.backends), file=out, flush=True)
    return env


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _move_into_place(tmp: Path, final: Path, replace: bool) -> None:
    if final.exists():
        if not replace:
            raise NeuropodError(
                f"A backend environment {final.name!r} already exists in {final.parent}: remove it with "
                f"`neuropod env remove {final.name}`, pass --replace, or choose another --name"
            )
        old = Path(tempfile.mkdtemp(prefix=f".trash-{final.name}-", dir=final.parent)) / "env"
        final.rename(old)
        try:
            tmp.rename(final)
        except OSError:
            old.rename(final)
            raise
        shutil.rmtree(old.parent, ignore_errors=True)
        return
    try:
        tmp.rename(final)
    except OSError as e:  # another process made it meanwhile
        raise NeuropodError(f"Could not move the new environment to {final}: {e}") from e


def remove_environment(name: str) -> None:
    """Delete the environment called ``name``.

    :raises NeuropodError: there is none (the message lists those there are).
    """
    env = get_environment(name)
    _remove_tree(env.path)


# --- lock environments ------------------------------------------------------

#: Per lock environment: the packages loaded with it, and when.
USERS_FILE = "neuropod-users.json"
LOCK_PREFIX = "lock-"
_MAX_USERS = 100
# name==version, optionally with extras and an environment marker; then only --hash options.
_PIN_RE = re.compile(
    r"(?P<req>(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(?:\[[A-Za-z0-9._,\s-]*\])?\s*===?\s*[^\s;\\]+"
    r"(?:\s*;[^-]*)?)(?P<hashes>(?:\s+--hash[=\s]\S+)*)"
)
_COMMENT_RE = re.compile(r"(^|\s+)#.*$")


def lock_lines(lock: str, where: str = "requirements.lock") -> list[str]:
    """The requirements of a pip lock file, one normalized line each (``name==version --hash=...``).

    Comments and blank lines are dropped and continuation lines joined. Only
    pinned requirements are allowed, with ``--hash`` options: no ``-r``,
    ``-e``, index options, paths or URLs, which would make the lock mean
    something else on another machine.

    :raises PackageError: a line that is not a pin, naming it.
    """
    from neuropod.errors import PackageError

    lines: list[str] = []
    current = ""
    for raw in lock.splitlines():
        line = _COMMENT_RE.sub("", raw).rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        line, current = (current + line).strip(), ""
        if not line:
            continue
        normalized = " ".join(line.split())
        if not _PIN_RE.fullmatch(normalized):
            raise PackageError(
                f"{where}: {normalized[:200]!r} is not a pinned requirement; a lock holds only "
                "'name==version' lines, each optionally with --hash=sha256:... options"
            )
        lines.append(normalized)
    if current.strip():
        raise PackageError(f"{where}: the last line ends with a continuation backslash")
    return lines


def _pins(lines: Sequence[str]) -> list[str]:
    """The lock's requirements without hashes or extras: a pip constraints file."""
    out = []
    for line in lines:
        m = _PIN_RE.fullmatch(line)
        assert m is not None
        out.append(re.sub(r"\[[^\]]*\]", "", m["req"]))
    return out


def _base_interpreter(backend: Backend) -> tuple[str, str]:
    """(interpreter, its X.Y) a lock environment for ``backend`` is made from."""
    if backend.location.startswith("python:"):
        return backend.location[len("python:"):], ".".join(backend.version.split(".")[:2])
    if backend.location.startswith(LOCATION_PREFIX):
        env = get_environment(backend.location[len(LOCATION_PREFIX):])
        return str(env.python), ".".join(env.python_version.split(".")[:2])
    return sys.executable, f"{sys.version_info[0]}.{sys.version_info[1]}"


def lock_environment_name(lock: str, backend: Backend) -> str:
    """``lock-py<X.Y>-<hash>``: the environment a lock gets with ``backend``'s interpreter and framework."""
    lines = lock_lines(lock)
    _, xy = _base_interpreter(backend)
    framework = _framework_pin(backend)
    key = "\n".join([*sorted(lines), f"# python {xy}", f"# {backend.platform} {framework or ''}"])
    return f"{LOCK_PREFIX}py{xy}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _framework_pin(backend: Backend) -> str | None:
    if backend.platform not in FRAMEWORK_DISTRIBUTIONS:
        return None  # e.g. python: the plugin needs no framework
    return f"{backend.framework or FRAMEWORK_DISTRIBUTIONS[backend.platform]}=={backend.version}"


def lock_environment(
    lock: str, backend: Backend, *, package_name: str = "", package_source: str = "", out: TextIO | None = None,
    verbose: bool = False,
) -> Environment:  # fmt: skip
    """The environment for a package's ``0/requirements.lock``, built on first use.

    It holds the lock's exact pins (installed with ``--no-deps``; pip checks
    the hashes when the lock has them), then the neuropod core and the plugin
    for ``backend``'s platform (with its framework pinned to the backend's
    version, for platforms that have one), constrained to the lock's pins.
    Its name comes from the lock's requirements, the interpreter's X.Y and
    the framework (:func:`lock_environment_name`), so every package with the
    same lock shares it. It is made from ``backend``'s interpreter: this
    one for an in-process backend, ``python:<path>``'s, or a backend
    environment's.

    Concurrent loads wait for one build (a file lock). An environment that
    became unusable (a new neuropod core, a removed interpreter) is rebuilt.
    Each call records the package as a user (``neuropod env list``,
    :func:`prune_environments`).

    A build writes one line per step to ``out``, with its time; ``verbose``
    adds pip's own output.

    :raises PackageError: the lock holds something other than pins.
    :raises NeuropodError: the build failed (the end of pip's output is in
        the message); nothing is left behind.
    """
    out = sys.stderr if out is None else out
    lines = lock_lines(lock, f"requirements.lock of model {package_name!r}" if package_name else "requirements.lock")
    name = lock_environment_name(lock, backend)
    base_python, xy = _base_interpreter(backend)
    root = envs_dir()
    lock_path = _build_lock_path(name)
    with _file_lock(lock_path, blocking=False) as free:
        pass
    if not free:
        print(f"Waiting for another process to finish building the environment {name} ...", file=out, flush=True)
    with _file_lock(lock_path):
        env = _read(root / name) if (root / name).is_dir() else None
        if env is None or not env.ok:
            if env is not None:
                print(f"Rebuilding lock environment {name}: {env.problem}", file=out, flush=True)
            env = _build_lock(name, lock, lines, backend, base_python, xy, package_name, out, verbose)
        _record_use(env.path, package_name, package_source)
    return _read(env.path)


def _build_lock(
    name: str, lock_text: str, lines: list[str], backend: Backend, base_python: str, xy: str, package_name: str,
    out: TextIO, verbose: bool = False,
) -> Environment:
    what = f"the requirements of model {package_name!r}" if package_name else "the requirements"
    contents = f"{len(lines)} pinned requirement(s)" if lines else "no requirements: the core and plugin only"
    print(f"Building the Python {xy} environment {name} for {what} ({contents}); "
          "this happens once per lock, later loads reuse it", file=out, flush=True)  # fmt: skip
    plugin, plugin_version = _plugin_distribution(backend.platform)
    reqs = [_local_source("neuropod") or f"neuropod=={__version__}",
            _local_source(plugin) or f"{plugin}=={plugin_version or __version__}"]  # fmt: skip
    framework = _framework_pin(backend)
    if framework:
        reqs.append(framework)
    with tempfile.TemporaryDirectory(prefix="neuropod-lock-") as tmp:
        lock_file, constraints = Path(tmp) / "requirements.lock", Path(tmp) / "constraints.txt"
        lock_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
        constraints.write_text("\n".join(_pins(lines)) + "\n", encoding="utf-8")
        installs = []
        if lines:
            installs.append((["--no-deps", "-r", str(lock_file)], f"pip install of {what} (the lock) into the new environment",
                             f"installing {len(lines)} locked requirement{'s' if len(lines) != 1 else ''}"))  # fmt: skip
        core = f"installing the neuropod core and {plugin}" + (f" with {framework}" if framework else "")
        installs.append(([*reqs, "-c", str(constraints)], "pip install of the neuropod core and plugin into the new environment", core))
        extra = {
            "kind": "lock",
            "lock": lines,
            "requirements": reqs,
            "lock_sha256": hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest(),
        }
        spec = f"lock: {_lock_summary(lock_text, lines)}"
        try:
            return _build(name, base_python, spec, backend.platform, installs, extra, replace=True, out=out, verbose=verbose)
        except NeuropodError as e:
            if "DO NOT MATCH THE HASHES" in str(e):
                raise NeuropodError(
                    f"{e}\nThe lock's hashes are those of the files pip chose where the package was made (its "
                    "header says for which Python and platform); on another Python or platform pip needs other "
                    "files. Package the model on the Python and platform it runs on."
                ) from e.__cause__
            raise


def _lock_summary(lock: str, lines: list[str]) -> str:
    """What a lock was made from, for ``neuropod env list``: the requirements its header names
    (``# from these requirements:`` then ``#   <requirement>`` lines, as neuropod-python writes),
    else its first pins."""
    asked, on = [], False
    for raw in lock.splitlines():
        if raw.startswith("# from these requirements:"):
            on = True
        elif on and raw.startswith("#   "):
            asked.append(raw[4:].strip())
        elif on:
            break
    shown = asked or _pins(lines)
    text = ", ".join(shown[:3]) + (f" +{len(shown) - 3} more" if len(shown) > 3 else "")
    if asked:
        text += f" ({len(lines)} pins)"
    return text or "no requirements"


def _build_lock_path(name: str) -> Path:
    """The file whose ``flock`` guards building (and pruning) environment ``name``."""
    locks = envs_dir() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"{name}.lock"


class _file_lock:
    """An exclusive ``flock`` on a file (created if missing) for the ``with`` block."""

    def __init__(self, path: Path, blocking: bool = True):
        self.path = path
        self.blocking = blocking
        self.fd = -1

    def __enter__(self) -> bool:
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(self.fd)
            self.fd = -1
            return False
        return True

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


def _read_users(path: Path) -> tuple[dict[str, str], ...]:
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


def _record_use(path: Path, name: str, source: str) -> None:
    """Note that package ``name`` at ``source`` was loaded with this environment now (best effort)."""
    key = source or name
    # Newest first; the sort in _read_users is stable, so this use stays first among uses in the same second.
    kept = [{"name": name, "source": source, "last_used": _now()}]
    kept += [u for u in _read_users(path) if (u["source"] or u["name"]) != key][: _MAX_USERS - 1]
    tmp = path / f".{USERS_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"packages": kept}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path / USERS_FILE)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        warnings.warn(f"Could not record the use of environment {path.name} ({e}); prune may remove it early", stacklevel=3)


def _age_days(env: Environment, now: datetime.datetime) -> float | None:
    stamp = env.last_used or env.created
    try:
        when = datetime.datetime.fromisoformat(stamp)
    except ValueError:
        try:
            when = datetime.datetime.fromtimestamp((env.path / ENV_FILE).stat().st_mtime, datetime.timezone.utc)
        except OSError:
            return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return (now - when).total_seconds() / 86400


def _in_use(path: Path) -> bool:
    """Whether a running process was started from this environment's ``bin/`` (Linux's ``/proc``)."""
    prefix = (str(path / "bin") + os.sep).encode()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read(4096).split(b"\0", 1)[0]
        except OSError:
            continue
        if argv0.startswith(prefix):
            return True
    return False


def prune_environments(days: float = 30, *, dry_run: bool = False) -> list[Environment]:
    """Remove the lock environments no package has used for ``days`` days.

    Backend environments (``neuropod env create``) are never pruned; remove
    them by name. An environment being built right now, or whose interpreter
    a running process was started with (a loaded model's worker), is skipped.

    :param days: a number >= 0; 0 removes every lock environment.
    :param dry_run: only say which would go.
    :returns: the environments removed (or that would be).
    """
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not (days >= 0):
        raise ValueError(f"days must be a number >= 0, not {days!r}")
    now = datetime.datetime.now(datetime.timezone.utc)
    gone = []
    for env in list_environments():
        if env.kind != "lock" and not env.name.startswith(LOCK_PREFIX):
            continue
        age = _age_days(env, now)
        if age is None or age < days:
            continue
        if _in_use(env.path):
            continue
        if dry_run:
            gone.append(env)
            continue
        lock_path = _build_lock_path(env.name)
        with _file_lock(lock_path, blocking=False) as free:
            if not free:
                continue
            _remove_tree(env.path)
        lock_path.unlink(missing_ok=True)
        gone.append(env)
    return gone


__all__ = [
    "ENV_FILE",
    "FRAMEWORK_DISTRIBUTIONS",
    "Environment",
    "core_fingerprint",
    "create_environment",
    "environment_backends",
    "environment_of",
    "get_environment",
    "install_requirements",
    "list_environments",
    "lock_environment",
    "lock_environment_name",
    "lock_lines",
    "neuropod_home",
    "parse_spec",
    "prune_environments",
    "remove_environment",
]
