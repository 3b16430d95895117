"""The package at a URL, downloaded once per version of the object into the cache's
``downloads/``; checking and pruning those downloads."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from neuropod import cache
from neuropod.errors import PackageError
from neuropod.storage.stores import (
    fs_protocol,
    is_ranged,
    is_validated,
    list_files,
    object_identity,
    object_info,
    open_filesystem,
)
from neuropod.storage.transfer import (
    DIR_ENTRY,
    RECORD_FILE,
    ZIP_ENTRY,
    download,
    is_complete,
    read_ahead,
    s3_probe,
    whole_read_ahead,
)
from neuropod.storage.urls import download_url, is_package_url, shown

#: A download not finished: ``<key>.partial``, a zip object's file or a prefix's directory, written
#: under the key's lock; what a killed download left is resumed by the next load of its URL.
_PARTIAL = re.compile(r"([0-9a-f]{64})\.partial")


def downloads_dir() -> Path:
    """Where downloaded packages live: ``downloads/`` in the package cache."""
    return cache.cache_dir() / "downloads"


def fetch(url: str, *, storage_options: Mapping[str, Any] | None = None) -> Path:
    """The local copy of the package at ``url``: downloaded once per version of the object.

    :param storage_options: passed to the fsspec filesystem (credentials, ``endpoint_url``,
        ``anon``...), e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``
        for s3fs. None: the filesystem's own defaults and credential chain.
    :returns: a zip file or a package directory in the cache.
    :raises PluginNotInstalledError: the scheme's filesystem is not installed (says which extra).
    :raises PackageError: nothing at the URL, no access, or the download failed; names the URL.
    """
    if not is_package_url(url):
        raise PackageError(f"{shown(url)} is not a package URL (s3://, gs://, az://, abfs://, or an http(s) "
                           f"URL of a .zip or .neuropod file)")  # fmt: skip
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a dict of the filesystem's options, not {type(storage_options).__name__}")
    fs, path = open_filesystem(url, dict(storage_options or {}))
    where = shown(url)
    # The URL's query names the package too (?version=3), less what only signs it (a presigned URL).
    keyed = download_url(url)
    root = cache.make_private_dir("downloads", "download cache")
    # A URL never downloaded here: its first chunk is read while the store is asked what the
    # object is (GCS, Azure: used only when its MD5 proves it whole), a round trip less for a
    # small package.
    seen = root / "urls" / hashlib.sha256(keyed.encode()).hexdigest()
    first_time = is_ranged(fs) and not path.endswith("/") and not seen.exists()
    # S3: one GET of the first chunk says what the object is (its ETag, size...) and holds its first
    # chunk (a small object whole): no HEAD, and no MD5 needed to tie the bytes to their identity.
    probe = s3_probe(fs, path) if first_time and fs_protocol(fs) in ("s3", "s3a") else None
    first: concurrent.futures.Future[bytes] | None = None
    probed: bytes | None = None
    if probe is not None:
        info, probed = probe
    else:
        first = read_ahead(fs, path) if first_time else None
        try:
            info = object_info(fs, path, where)
        except BaseException:
            if first is not None:
                first.cancel()
            raise
    if info.get("type") == "directory":
        files = list_files(fs, path, where)
        identity: Any = {name: object_identity(i) for name, i in files.items()}
        kind = DIR_ENTRY
    else:
        files = {"": info}
        identity = object_identity(info)
        kind = ZIP_ENTRY
    key = hashlib.sha256(json.dumps({"url": keyed, "kind": kind, "identity": identity}, sort_keys=True,
                                    default=str).encode()).hexdigest()  # fmt: skip
    cacheable = all(is_validated(i) for i in identity.values()) if kind == DIR_ENTRY else is_validated(identity)
    entry = root / key
    if cacheable and is_complete(entry, key, kind, files):
        _used(entry)
        return entry / kind
    with cache.entry_lock(root, key):
        if cacheable and is_complete(entry, key, kind, files):  # downloaded by another process meanwhile
            _used(entry)
            return entry / kind
        if probed is not None:  # the whole object, or its first chunk
            whole = probed if len(probed) == info["size"] else None
            head = [probed] if whole is None else None
            probe = probed = None
        else:
            whole, head = whole_read_ahead(first, fs, info) if kind == ZIP_ENTRY else None, None
        download(fs, path, files, root, key, kind, where, identity, resumable=cacheable, whole=whole, head=head)
    with contextlib.suppress(OSError):
        seen.parent.mkdir(mode=0o700, exist_ok=True)
        seen.touch()
    return entry / kind


def list_objects(url: str, *, storage_options: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """What is at ``url`` now, as the store lists it: ``{"": info}`` for one object, else each
    object under the prefix by its path relative to it (the infos carry ETags, sizes...).

    :raises PluginNotInstalledError: the scheme's filesystem is not installed (says which extra).
    :raises PackageError: nothing at the URL, or no access; names the URL.
    """
    fs, path = open_filesystem(url, dict(storage_options or {}))
    where = shown(url)
    info = object_info(fs, path, where)
    if info.get("type") == "directory":
        return list_files(fs, path, where)
    return {"": info}


def _used(entry: Path) -> None:
    """Mark the download at ``entry`` as used now (its record's time: what :func:`prune_downloads` reads)."""
    with contextlib.suppress(OSError):
        os.utime(entry / RECORD_FILE)


def verify_downloads(repair: bool = False) -> list[str]:
    """Check every download against its record: each file there, a regular file of the size the store
    listed (the package's own hashes are checked by every load).

    :param repair: remove each bad download (it is downloaded again when its URL is next loaded),
        each temporary directory and partial download an interrupted download left (no process
        writing it, none of it written for :data:`cache.STALE_SECONDS`), and each ``.trash-`` folder
        an interrupted removal left (nothing in it changed for as long).
    :returns: one line per problem, naming the download, its URL and what is wrong (ending in
        "(removed)" when ``repair`` removed it); empty when every download is sound.
    """
    root = downloads_dir()
    try:
        children = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise PackageError(f"Cannot list the download cache {root}: {e.strerror}") from None
    problems = []
    for child in children:
        path = Path(child.path)
        url = ""
        if cache.HEX64.fullmatch(child.name):
            with cache.entry_lock(root, child.name):
                reason, url = _check_download(path, child.name)
                if reason and repair:
                    cache.remove_path(path)
        elif child.name.startswith(cache.TRASH_PREFIX):
            reason = _trash_reason(path) if _untouched(path, cache.STALE_SECONDS) else None
            if reason and repair:
                cache.remove_path(path)
        elif child.name.startswith(".") and child.name.endswith(".tmp"):
            try:
                old = time.time() - child.stat(follow_symlinks=False).st_mtime > cache.STALE_SECONDS
            except OSError:
                continue
            reason = "a temporary directory left by an interrupted download" if old else None
            if reason and repair:
                cache.remove_path(path)
        elif _PARTIAL.fullmatch(child.name):
            with _stale_partial(root, child.name, cache.STALE_SECONDS) as stale:
                reason = ("a partial download left by an interrupted download (nothing written in it for "
                          f"{cache.STALE_SECONDS // 60} minutes)") if stale else None  # fmt: skip
                if reason and repair:
                    cache.remove_path(path)
        else:
            continue  # urls/, locks/
        if reason:
            shown_url = f" ({url})" if url else ""
            problems.append(f"{path}{shown_url}: {reason}" + (" (removed)" if repair else ""))
    return problems


def _check_download(entry: Path, key: str) -> tuple[str | None, str]:
    """Why the download at ``entry`` is bad (None: it is sound), and its URL as recorded."""
    try:
        record = json.loads((entry / RECORD_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"its {RECORD_FILE} cannot be read ({e})", ""
    if not isinstance(record, dict):
        return f"its {RECORD_FILE} is not a download record", ""
    url = str(record.get("url", ""))
    if record.get("key") != key:
        return f"its {RECORD_FILE} is for another download ({record.get('key')!r})", url
    sizes = record.get("sizes")
    kind = ZIP_ENTRY if (entry / ZIP_ENTRY).exists() or "" in (sizes or {}) else DIR_ENTRY
    if not isinstance(sizes, dict):
        return f"its {RECORD_FILE} lists no files", url
    for name, size in sorted(sizes.items()):
        target = entry / kind / name if name else entry / kind
        try:
            st = os.lstat(target)
        except OSError:
            return f"{name or kind!r} is missing", url
        if not stat.S_ISREG(st.st_mode):
            return f"{name or kind!r} is not a regular file", url
        if st.st_size != size:
            return f"{name or kind!r} holds {st.st_size:,} bytes, not the {size:,} downloaded", url
    if kind == DIR_ENTRY:
        present = {p.relative_to(entry / kind).as_posix() for p in (entry / kind).rglob("*") if not p.is_dir()}
        extra = sorted(present - set(sizes))
        if extra:
            return f"{extra[0]!r} was not downloaded (it is not in its {RECORD_FILE})", url
    return None, url


def prune_downloads(days: float = 30, *, dry_run: bool = False) -> list[tuple[Path, str, int]]:
    """Remove the downloads no load has used for ``days`` days (a download is used when a load of its
    URL finds its objects unchanged): old versions of packages, objects since deleted; the partial
    downloads interrupted ones left (no process writing them, none of it written for ``days`` days or
    :data:`cache.STALE_SECONDS`, whichever is shorter); and the ``.trash-`` folders removals killed
    half-way left (nothing in them changed for as long: a removal under way deletes in it all the time).

    :param days: a number >= 0; 0 removes every download not being made right now.
    :param dry_run: only say which would go.
    :returns: (path, URL, bytes) of each download removed (or that would be); a partial download's
        URL is "" (it has no record yet), as is a ``.trash-`` folder's.
    """
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not (days >= 0):
        raise ValueError(f"days must be a number >= 0, not {days!r}")
    root = downloads_dir()
    try:
        children = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    gone = []
    now = time.time()
    for child in children:
        path = Path(child.path)
        if child.name.startswith(cache.TRASH_PREFIX):
            if _untouched(path, min(days * 86400, cache.STALE_SECONDS)):
                try:
                    size = _size(path)
                except OSError:  # another process removed it meanwhile
                    continue
                if not dry_run:
                    cache.remove_path(path)
                gone.append((path, "", size))
            continue
        if _PARTIAL.fullmatch(child.name):
            with _stale_partial(root, child.name, min(days * 86400, cache.STALE_SECONDS)) as stale:
                if not stale:
                    continue
                size = _size(path)
                if not dry_run:
                    cache.remove_path(path)
            gone.append((path, "", size))
            continue
        if not cache.HEX64.fullmatch(child.name):
            continue
        with cache.entry_lock(root, child.name):
            try:
                used = os.stat(path / RECORD_FILE).st_mtime
            except OSError:
                continue  # not finished (or broken: `neuropod cache verify --repair`)
            if now - used < days * 86400:
                continue
            _, url = _check_download(path, child.name)
            size = _size(path)
            if not dry_run:
                cache.remove_path(path)
        gone.append((path, url, size))
    return gone


def _size(path: Path) -> int:
    """The bytes of the regular files at or under ``path``."""
    if path.is_file() and not path.is_symlink():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


@contextlib.contextmanager
def _stale_partial(root: Path, name: str, older_than: float) -> Iterator[bool]:
    """Whether the partial download ``root/name`` is left over: no process holds its key's lock (a
    download holds it while it writes there) and nothing in it was written for ``older_than`` seconds
    (a recent one is kept for the next load of its URL to resume). True: the lock is held meanwhile,
    so that no download takes it up while it is removed."""
    key = name.removesuffix(".partial")
    with cache.entry_lock(root, key, wait=False) as held:
        try:
            stale = held and time.time() - _last_written(root / name) >= older_than
        except OSError:  # gone meanwhile
            stale = False
        yield stale


def _untouched(path: Path, older_than: float) -> bool:
    """Whether nothing at or under ``path`` was written for ``older_than`` seconds (False: gone)."""
    try:
        return time.time() - _last_written(path) >= older_than
    except OSError:
        return False


def _trash_reason(path: Path) -> str:
    what = "a folder" if path.is_dir() and not path.is_symlink() else "a file"
    return f"{what} left by an interrupted removal (nothing in it changed for {cache.STALE_SECONDS // 60} minutes)"


def _last_written(path: Path) -> float:
    """When ``path`` (a file, or a directory and everything under it) was last written."""
    newest = os.lstat(path).st_mtime
    if stat.S_ISDIR(os.lstat(path).st_mode):
        for dirpath, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    return newest
