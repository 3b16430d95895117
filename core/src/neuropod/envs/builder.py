"""Creating backend environments: ``python -m venv``, ``pip install`` of the matching core, plugin
and framework, a record of what the new environment offers, and moving it into place."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlparse

import importlib_metadata

from neuropod import _json
from neuropod._version import __version__
from neuropod.envs.records import (
    CORE_DIR,
    ENV_FILE,
    FORMAT_VERSION,
    Environment,
    check_name,
    core_fingerprint,
    env_interpreter,
    envs_dir,
    get_environment,
    read_environment,
    running_fingerprint,
    utc_now,
)
from neuropod.errors import NeuropodError
from neuropod.plugins import ENTRY_POINT_GROUP, KNOWN_PLATFORMS

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

# PLATFORM==VERSION with VERSION a release (1.20.1, 1.20), optionally a
# wildcard (1.20.*), or a full PEP 440 version (2.13.0+cpu, 1.0rc1).
_SPEC_RE = re.compile(
    r"(?P<platform>[a-z][a-z0-9_]*)\s*==\s*(?P<version>[0-9]+(?:\.[0-9]+)*(?:\.\*|[A-Za-z0-9.+!_-]*))"
)
_TAIL_LINES = 40


# --- creating ---------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str]:
    """``"onnx==1.20.1"`` -> ``("onnx", "1.20.1")``.

    :raises NeuropodError: the spec is not ``PLATFORM==VERSION`` or the
        platform is not one neuropod can create environments for.
    """

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


def local_source(dist_name: str) -> str | None:
    """The local directory or wheel ``dist_name`` was installed from, if it was (pip's direct_url.json)."""
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


def plugin_distribution(platform: str) -> tuple[str, str | None]:
    """(distribution name, installed version or None) of the plugin that runs ``platform``."""
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == platform and ep.dist is not None:
            return ep.dist.name, ep.dist.version
    return KNOWN_PLATFORMS[platform], None


def install_requirements(platform: str, version: str) -> list[str]:
    """What ``pip install`` gets for an environment: the core, the plugin, the framework."""
    reqs = [local_source("neuropod") or f"neuropod=={__version__}"]
    plugin, plugin_version = plugin_distribution(platform)
    # Plugins are released with the core, so an absent plugin is pinned to the core's version.
    reqs.append(local_source(plugin) or f"{plugin}=={plugin_version or __version__}")
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
    bindir = env_interpreter(path).parent
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


def remove_tree(path: Path) -> None:
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
        check_name(name)
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
    step = f"installing the neuropod core, {plugin_distribution(platform)[0]} and {reqs[-1]}"
    print(f"Creating a backend environment for {spec}{f' named {name!r}' if name else ''}:", file=out, flush=True)
    return build_environment(
        name, base_python, spec, platform,
        [([*links, *reqs], f"pip install of {spec} into the new environment", step)],
        {"requirements": reqs}, replace=replace, out=out, verbose=verbose,
    )  # fmt: skip


def build_environment(
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
        env_python = env_interpreter(tmp)
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
            if fingerprint != running_fingerprint():
                raise NeuropodError(
                    f"The neuropod core installed in the new environment ({core_dir}) differs from the one running "
                    f"here ({CORE_DIR}); install this core from a wheel or directory pip can reach "
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
            check_name(name)
        record = {
            "format": FORMAT_VERSION,
            "name": name,
            "spec": spec,
            "created": utc_now(),
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
    env = read_environment(final)
    print(f"Created {env.kind} environment {env.name!r} at {env.path}: "
          + ", ".join(b.id for b, _ in env.backends), file=out, flush=True)
    return env


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
    remove_tree(env.path)
