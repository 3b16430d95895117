"""Lock environments: one per package ``0/requirements.lock`` (and interpreter and framework),
built on first load, shared by every package with the same lock, pruned when unused."""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from neuropod._version import __version__
from neuropod.backend import Backend
from neuropod.envs.builder import (
    FRAMEWORK_DISTRIBUTIONS,
    build_environment,
    local_source,
    plugin_distribution,
    remove_tree,
)
from neuropod.envs.records import (
    ENV_FILE,
    LOCATION_PREFIX,
    USERS_FILE,
    Environment,
    envs_dir,
    get_environment,
    list_environments,
    read_environment,
    read_users,
    utc_now,
)
from neuropod.errors import NeuropodError, PackageError

# --- lock environments ------------------------------------------------------

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
        env = read_environment(root / name) if (root / name).is_dir() else None
        if env is None or not env.ok:
            if env is not None:
                print(f"Rebuilding lock environment {name}: {env.problem}", file=out, flush=True)
            env = _build_lock(name, lock, lines, backend, base_python, xy, package_name, out, verbose)
        _record_use(env.path, package_name, package_source)
    return read_environment(env.path)


def _build_lock(
    name: str, lock_text: str, lines: list[str], backend: Backend, base_python: str, xy: str, package_name: str,
    out: TextIO, verbose: bool = False,
) -> Environment:
    what = f"the requirements of model {package_name!r}" if package_name else "the requirements"
    contents = f"{len(lines)} pinned requirement(s)" if lines else "no requirements: the core and plugin only"
    print(f"Building the Python {xy} environment {name} for {what} ({contents}); "
          "this happens once per lock, later loads reuse it", file=out, flush=True)  # fmt: skip
    plugin, plugin_version = plugin_distribution(backend.platform)
    reqs = [local_source("neuropod") or f"neuropod=={__version__}",
            local_source(plugin) or f"{plugin}=={plugin_version or __version__}"]  # fmt: skip
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
            return build_environment(name, base_python, spec, backend.platform, installs, extra, replace=True, out=out, verbose=verbose)
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


def _record_use(path: Path, name: str, source: str) -> None:
    """Note that package ``name`` at ``source`` was loaded with this environment now (best effort)."""
    key = source or name
    # Newest first; the sort in read_users is stable, so this use stays first among uses in the same second.
    kept = [{"name": name, "source": source, "last_used": utc_now()}]
    kept += [u for u in read_users(path) if (u["source"] or u["name"]) != key][: _MAX_USERS - 1]
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
            remove_tree(env.path)
        lock_path.unlink(missing_ok=True)
        gone.append(env)
    return gone
