"""Locking a model's requirements at packaging time, with pip's own resolver.

``compile_requirements`` runs ``pip install --dry-run --ignore-installed
--report`` on the requirements with the interpreter the model will run on,
and writes every distribution pip chose as an exact pin. When pip's report
gives a sha256 for every file (it does for index releases), each pin carries
it, so installing the lock (``pip install --no-deps -r``) checks that it gets
the very files that were locked. Those files are the wheels for the
packaging machine's platform and Python version: a lock made on Linux x86-64
with Python 3.11 installs there, and elsewhere pip says the hashes do not
match. Package on the platform you deploy to.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from neuropod.envs import lock_lines
from neuropod.errors import NeuropodError, PackageError

_TAIL = 30


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def resolve(requirements: str, python: str = sys.executable) -> dict[str, Any]:
    """pip's installation report for ``requirements`` as ``python`` would install them into an empty environment.

    :raises NeuropodError: pip could not resolve them (the end of its output is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="neuropod-lock-") as tmp:
        req, report = Path(tmp) / "requirements.in", Path(tmp) / "report.json"
        req.write_text(requirements, encoding="utf-8")
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "-r", str(req)]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", env=_pip_env(),
                stdin=subprocess.DEVNULL, timeout=900,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NeuropodError(f"Could not run pip to lock the requirements ({' '.join(cmd[:4])}): {e}") from e
        if proc.returncode != 0 or not report.is_file():
            tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-_TAIL:])
            raise NeuropodError(
                f"pip could not resolve the model's requirements with {python} (exit status {proc.returncode}):\n{tail}"
            )
        data: dict[str, Any] = json.loads(report.read_text(encoding="utf-8"))
        return data


def compile_requirements(requirements: str, python: str = sys.executable) -> str:
    """The lock file for ``requirements`` (pip requirements text): exact pins, hashes where pip gives them all.

    :raises PackageError: a requirement pip would take from a local path, a
        URL or a VCS checkout (a lock must name index releases).
    :raises NeuropodError: pip could not resolve them.
    """
    report = resolve(requirements, python)
    pins: list[tuple[str, str, str | None]] = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name, version = meta.get("name"), meta.get("version")
        info = item.get("download_info") or {}
        if item.get("is_direct") or not name or not version:
            raise PackageError(
                f"Requirement {name or info.get('url', '?')!r} comes from {info.get('url', 'a direct reference')}: "
                "a lock can only pin releases from a package index (publish it to an index, or vendor the code "
                "into code_path_spec)"
            )
        hashes = (info.get("archive_info") or {}).get("hashes") or {}
        pins.append((name, version, hashes.get("sha256")))
    pins.sort(key=lambda p: p[0].lower())
    with_hashes = bool(pins) and all(h for _, _, h in pins)
    env = report.get("environment", {})
    where = (
        f"Python {env.get('python_full_version', platform.python_version())} "
        f"({env.get('implementation_name', sys.implementation.name)}) on "
        f"{env.get('sys_platform', sys.platform)} {env.get('platform_machine', platform.machine())}"
    )
    lines = [
        "# Locked by neuropod-python (pip's resolver): install with pip install --no-deps -r requirements.lock",
        f"# locked for {where}" + ("; the hashes are of the files for that platform" if with_hashes else ""),
        "# from these requirements:",
        *(f"#   {line.strip()}" for line in requirements.splitlines() if line.strip() and not line.strip().startswith("#")),
    ]
    if pins and not with_hashes:
        missing = ", ".join(n for n, _, h in pins if not h)
        lines.append(f"# no hashes: pip gave none for {missing}")
    for name, version, sha in pins:
        lines.append(f"{name}=={version}" + (f" \\\n    --hash=sha256:{sha}" if with_hashes else ""))
    text = "\n".join(lines) + "\n"
    lock_lines(text, "the new requirements.lock")  # what the loader will accept
    return text


def requirement_names(requirements: str) -> set[str]:
    """The normalized distribution names a requirements text names (for "does it already ask for torch?")."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    names: set[str] = set()
    for raw in requirements.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            names.add(canonicalize_name(Requirement(line).name))
        except InvalidRequirement:
            continue
    return names


__all__ = ["compile_requirements", "requirement_names", "resolve"]
