"""What a model repository holds: its packages, their versions, and which versions to serve.

A repository PATH (a folder, or a package URL's prefix in an object store) holds
packages side by side, each served as version 1 of the model its package names::

    models/
        adder.neuropod          # model "adder", version 1
        tagger/                 # a package directory: model "tagger", version 1
            config.json ...

or models in Triton's layout, one folder per model and one numbered folder per
version, the folder's name being the model's (its packages may carry another)::

    models/
        adder/
            1/                  # a package directory, or a folder holding one package
                config.json ...
            2/
                adder.neuropod

Names starting with "." are skipped at every level: a copy being made there,
then renamed into place, is never half-loaded.

A version policy (:class:`VersionPolicy`) picks the versions served: the
latest N (Triton's default: the latest one), all of them, or specific ones.

A PATH that is a URL (``s3://bucket/models/``) is listed through fsspec and each
version's package downloaded into the cache by :func:`neuropod.storage.fetch`
when its objects change (a listing costs one request per thousand objects).

Pure Python: importing this module imports no server library.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from neuropod import storage
from neuropod.errors import NeuropodError, PackageError

_CONFIG = "config.json"
_ZIP_SUFFIXES = (".zip", ".neuropod")


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model are served: ``latest`` (the ``count`` highest), ``all``, or
    ``specific`` (those in ``versions`` that exist), as Triton's ``version_policy``."""

    kind: str = "latest"
    count: int = 1
    versions: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        """``latest``, ``latest:N``, ``all`` or ``specific:V[,V...]``.

        :raises ValueError: anything else (the message says what is accepted).
        """
        kind, _, rest = text.strip().partition(":")
        kind = kind.strip().lower()
        expected = "latest, latest:N, all, or specific:V,V,... (versions are whole numbers)"
        try:
            if kind == "latest":
                count = int(rest) if rest.strip() else 1
                if count < 1:
                    raise ValueError
                return cls("latest", count)
            if kind == "all" and not rest.strip():
                return cls("all")
            if kind == "specific":
                versions = tuple(sorted({int(v) for v in rest.split(",")}))
                if not versions or min(versions) < 0:
                    raise ValueError
                return cls("specific", versions=versions)
        except ValueError:
            pass
        raise ValueError(f"a version policy is {expected}, not {text!r}")

    def select(self, versions: Iterable[str]) -> list[str]:
        """The versions (of those present) this policy serves, lowest first."""
        present = sorted(set(versions), key=int)
        if self.kind == "all":
            return present
        if self.kind == "specific":
            wanted = set(self.versions)
            return [v for v in present if int(v) in wanted]
        return present[-self.count :]

    def __str__(self) -> str:
        if self.kind == "latest":
            return "latest" if self.count == 1 else f"latest:{self.count}"
        if self.kind == "specific":
            return "specific:" + ",".join(map(str, self.versions))
        return self.kind


@dataclass(frozen=True)
class Found:
    """One version of a model found in a repository PATH."""

    #: The package on this machine (a URL's package once downloaded; None when it could not be).
    path: Path | None
    #: The version: its folder's number in Triton's layout, "1" for a package that stands alone.
    version: str
    #: The model's folder in Triton's layout (the name it is served under); None for a package
    #: that stands alone, served under its package's name.
    folder: str | None
    #: Where it is, as messages show it: a local path, or the URL without credentials.
    where: str
    #: Changes whenever the package's files do (what a poll compares).
    stamp: str
    #: Why this version cannot be loaded ("" when it can be tried).
    problem: str = ""


def is_package(path: Path) -> bool:
    """Whether ``path`` is a package: a directory with a config.json, or a zip with one at
    its top level (or under its single top-level folder, as some tools zip it)."""
    if path.is_dir():
        return (path / _CONFIG).is_file()
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    if _CONFIG in names:
        return True
    tops = {n.split("/", 1)[0] for n in names}
    return len(tops) == 1 and f"{tops.pop()}/{_CONFIG}" in names


def _version_name(name: str) -> str | None:
    """The version a folder named ``name`` holds ("007" is version "7"), or None: not a number."""
    return str(int(name)) if name.isascii() and name.isdigit() else None


def _local_stamp(path: Path) -> str:
    """A digest of the sizes and modification times of the files of the package at ``path``."""
    h = hashlib.sha256()
    if path.is_file():
        st = path.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            h.update(f"{os.path.relpath(full, path)}\0{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def scan_local(path: str | os.PathLike[str], *, empty_ok: bool = False) -> list[Found]:
    """The versions of the models in the repository PATH ``path`` (or the package it is).

    :param empty_ok: a folder that holds no package is an empty repository (a poll after its last
        model was deleted: every model is unloaded), not an error.
    :raises PackageError: PATH does not exist or cannot be read, or (unless ``empty_ok``)
        holds neither packages nor versioned models.
    """
    try:
        return _scan_local(Path(path), empty_ok)
    except OSError as e:  # a folder not readable (its permissions), or a file gone as it was read
        raise PackageError(f"{path} cannot be read: {e.strerror or e}") from None


def _scan_local(p: Path, empty_ok: bool) -> list[Found]:
    if not p.exists():
        raise PackageError(f"{p}: no such file or directory")
    if is_package(p):
        return [Found(p, "1", None, str(p), _local_stamp(p))]
    if not p.is_dir():
        raise PackageError(f"{p} is not a Neuropod package: it is neither a directory nor a zip with a {_CONFIG}")
    found: list[Found] = []
    for child in sorted(p.iterdir()):
        if child.name.startswith("."):
            continue  # hidden: a copy being made, to be renamed into place
        if is_package(child):
            found.append(Found(child, "1", None, str(child), _local_stamp(child)))
        elif child.is_dir():
            found += _local_versions(child)
    if not found and not empty_ok:
        raise PackageError(
            f"{p} holds no Neuropod package: no {_CONFIG} in it, nor in any directory or zip directly inside it, "
            "nor in a numbered version folder of a model folder (MODEL/1/...)"
        )
    return found


def _local_versions(folder: Path) -> list[Found]:
    """The numbered version folders of the model folder ``folder`` (none: not a model folder)."""
    found: list[Found] = []
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return []
    for child in children:
        version = _version_name(child.name)
        if version is None or not child.is_dir():
            continue
        where = str(child)
        if is_package(child):
            found.append(Found(child, version, folder.name, where, _local_stamp(child)))
            continue
        inside = sorted(c for c in child.iterdir() if not c.name.startswith(".") and is_package(c))
        if len(inside) == 1:
            found.append(Found(inside[0], version, folder.name, str(inside[0]), _local_stamp(inside[0])))
        elif not inside:
            problem = f"version {version} of model {folder.name!r} holds no package ({where}: no {_CONFIG} in it or in a zip or directory inside it)"
            found.append(Found(None, version, folder.name, where, "", problem))
        else:
            problem = f"version {version} of model {folder.name!r} holds several packages ({', '.join(c.name for c in inside)}): keep one"
            found.append(Found(None, version, folder.name, where, "", problem))
    return found


class RemoteRepository:
    """A repository PATH that is a URL: listed on every scan, each package downloaded (into the
    cache, see :mod:`neuropod.storage`) when its objects changed since the last scan.

    :param storage_options: the fsspec filesystem's options (None: its own credential chain).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.where = storage.shown(url)
        self.storage_options = dict(storage_options or {})
        #: Package URL -> (stamp, local path) of what the last scans downloaded.
        self._fetched: dict[str, tuple[str, Path]] = {}
        self.last: list[Found] = []

    def scan(self) -> list[Found]:
        """List the repository and download each package whose objects changed.

        :raises PackageError: the URL cannot be listed (names it, and why).
        :raises PluginNotInstalledError: its filesystem is not installed.
        """
        files = storage.list_objects(self.url, storage_options=self.storage_options)
        # "": the URL is one object, a package zip.
        candidates = [("", "1", None, _stamp(files, ""), "")] if "" in files else _remote_candidates(files)
        found = [self._fetch(*candidate) for candidate in candidates]
        if not found:
            raise PackageError(
                f"{self.where} holds no Neuropod package: no {_CONFIG} under it, nor a .zip or .neuropod object "
                "directly inside it, nor a numbered version folder of a model folder (MODEL/1/...)"
            )
        self.last = found
        return found

    def _fetch(self, rel: str, version: str, folder: str | None, stamp: str, problem: str) -> Found:
        url = _under(self.url, rel) if rel else self.url
        where = storage.shown(url)
        if problem:
            return Found(None, version, folder, where, stamp, problem)
        known = self._fetched.get(url)
        if known is not None and known[0] == stamp and known[1].exists():
            return Found(known[1], version, folder, where, stamp)
        try:
            local = storage.fetch(url, storage_options=self.storage_options)
        except NeuropodError as e:
            return Found(None, version, folder, where, stamp, f"downloading it failed: {e}")
        self._fetched[url] = (stamp, local)
        return Found(local, version, folder, where, stamp)


def _under(url: str, rel: str) -> str:
    """The URL of ``rel`` under the repository URL ``url``: joined to its path, and its query and
    fragment kept (``s3://b/models?versionId=7``, ``rel`` ``m/1/`` -> ``s3://b/models/m/1/?versionId=7``):
    a token there (an Azure SAS token) signs each object's URL too."""
    cut = len(url)
    for mark in "?#":
        at = url.find(mark)
        if at != -1:
            cut = min(cut, at)
    return f"{url[:cut].rstrip('/')}/{rel}{url[cut:]}"


def _stamp(files: Mapping[str, Mapping[str, Any]], prefix: str) -> str:
    """A digest of what identifies the objects at ``prefix`` (all of them for ""): what a download
    of them is keyed by (:func:`neuropod.storage.object_identity`: ETags, sizes...)."""

    h = hashlib.sha256()
    for rel in sorted(files):
        if prefix == "" or rel == prefix or rel.startswith(prefix + "/"):
            h.update(f"{rel}\0{sorted((k, str(v)) for k, v in storage.object_identity(files[rel]).items())}\n".encode())
    return h.hexdigest()


def _remote_candidates(files: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, str | None, str, str]]:
    """The packages of a listed repository: (path under it, version, model folder, stamp, problem).

    The rules of :func:`scan_local`, on object names: a prefix holding a config.json is a package
    directory; a .zip or .neuropod object a package zip.
    """
    def stamp(prefix: str) -> str:
        return _stamp(files, prefix)

    if _CONFIG in files:  # the URL is a package directory itself
        return [("", "1", None, stamp(""), "")]
    tree: dict[str, set[str]] = {}
    for rel in files:
        parts = PurePosixPath(rel).parts
        for depth in range(1, len(parts)):
            tree.setdefault("/".join(parts[:depth]), set()).add(parts[depth])
    top = {PurePosixPath(rel).parts[0] for rel in files if not rel.startswith(".")}
    out: list[tuple[str, str, str | None, str, str]] = []
    for name in sorted(top):
        children = tree.get(name)
        if children is None:  # an object directly under the repository
            if name.lower().endswith(_ZIP_SUFFIXES):
                out.append((name, "1", None, stamp(name), ""))
            continue
        if _CONFIG in children:
            out.append((name + "/", "1", None, stamp(name), ""))
            continue
        for child in sorted(children, key=lambda c: (_version_name(c) is None, c)):
            version = _version_name(child)
            prefix = f"{name}/{child}"
            if version is None or prefix not in tree:
                continue
            inside = tree[prefix]
            if _CONFIG in inside:
                out.append((prefix + "/", version, name, stamp(prefix), ""))
                continue
            packages = sorted(
                c for c in inside
                if not c.startswith(".")
                and ((f"{prefix}/{c}" in files and c.lower().endswith(_ZIP_SUFFIXES)) or _CONFIG in tree.get(f"{prefix}/{c}", ()))
            )  # fmt: skip
            if len(packages) == 1:
                one = f"{prefix}/{packages[0]}"
                out.append((one if one in files else one + "/", version, name, stamp(one), ""))
            elif not packages:
                out.append((prefix, version, name, "", f"version {version} of model {name!r} holds no package "
                            f"(no {_CONFIG}, .zip or .neuropod object in it)"))  # fmt: skip
            else:
                out.append((prefix, version, name, "", f"version {version} of model {name!r} holds several "
                            f"packages ({', '.join(packages)}): keep one"))  # fmt: skip
    return out


__all__ = ["Found", "RemoteRepository", "VersionPolicy", "is_package", "scan_local"]
