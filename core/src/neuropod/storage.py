"""Packages in object stores and on web servers: ``load_neuropod("s3://bucket/adder.neuropod")``.

A package URL names a zip (an object) or a package directory (a prefix:
``s3://bucket/models/adder/``) in S3 (``s3://``), Google Cloud Storage
(``gs://``), Azure (``az://``, ``abfs://``, ``abfss://``), or a zip on a web
server (``https://`` and ``http://`` URLs whose path ends in ``.zip`` or
``.neuropod``; any other http URL is a model on a server, see
:mod:`neuropod.remote`). The filesystems are fsspec's (s3fs, gcsfs, adlfs,
aiohttp for http), installed by the core's extras (``neuropod[s3]``,
``neuropod[gcs]``, ``neuropod[azure]``, ``neuropod[http]``); the core
itself imports none of them until a URL is loaded.

Downloads live in the cache (:func:`neuropod.cache.cache_dir`)::

    downloads/<key>/
        package.zip    the object, or
        package/       the prefix's files
        record.json    written last: the URL (no credentials, no query),
                       what identified the object, each file's size

The key is the sha256 of the URL and what the store says identifies the
object's content: its ETag, version id, generation or MD5 and its size (a
directory: those of every file under it). A load whose object still has the
same identity takes the download already made, without reading it again; a
changed object has a new key, so it is downloaded again. An object without
any of them (a web server that sends no ETag nor Last-Modified) is
downloaded on every load.

A download is streamed to a partial file in chunks (memory stays a few chunks),
retried from where it stopped when the connection fails, checked against
the store's identity once complete (an object rewritten meanwhile is fetched
again), then renamed into place with its record last: an interrupted or
concurrent download never leaves anything a later load would take. Processes
fetching the same object wait for one another (a lock per key); a partial
file left by a killed one is resumed by the next. The package's manifest is
checked by the load itself, as for a local package.

Credentials come from each filesystem's own chain (environment variables,
config files, instance metadata) or ``storage_options``; neither the URL's
user, password and query nor any option is logged or written to the cache.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from neuropod import cache
from neuropod.errors import NeuropodError, PackageError, PluginNotInstalledError

log = logging.getLogger("neuropod.storage")

#: URL scheme -> (fsspec protocol, the filesystem's distribution, the core's extra that installs it).
SCHEMES: dict[str, tuple[str, str, str]] = {
    "s3": ("s3", "s3fs", "s3"),
    "s3a": ("s3", "s3fs", "s3"),
    "gs": ("gs", "gcsfs", "gcs"),
    "gcs": ("gs", "gcsfs", "gcs"),
    "az": ("az", "adlfs", "azure"),
    "abfs": ("abfs", "adlfs", "azure"),
    "abfss": ("abfs", "adlfs", "azure"),
    "http": ("http", "aiohttp", "http"),
    "https": ("https", "aiohttp", "http"),
}
#: An http(s) URL whose path ends so is a package to download; any other is a model on a server.
PACKAGE_SUFFIXES = (".zip", ".neuropod")
#: Bytes read and written at a time: a download holds at most about ``2 * PARALLEL + 4`` of them in
#: memory (each range read in flight twice while the HTTP client joins its body into one bytes object).
CHUNK = 16 * 1024 * 1024
#: Range reads of an object store's object in flight at once.
PARALLEL = 4
#: Seconds the first download of a URL waits for the chunk read ahead once the store said what the
#: object is (beyond them, the download proper reads it).
READ_AHEAD_WAIT_S = 30.0
#: Attempts at one file before a download fails; the waits between them (seconds) double from the first.
ATTEMPTS = 5
FIRST_WAIT_S = 0.5
#: What an object's info may hold that identifies its content, by filesystem: compared before a
#: cached download is taken and after a download, to see that the object did not change.
_IDENTITY_FIELDS = (
    "ETag", "etag", "VersionId", "version_id", "generation", "md5Hash", "Content-MD5", "content_md5",
    "LastModified", "last_modified", "Last-Modified", "updated", "mtime",
)  # fmt: skip
_ZIP = "package.zip"
_DIR = "package"
_RECORD = "record.json"


def is_package_url(value: object) -> bool:
    """Whether ``load_neuropod`` should download ``value``: a str URL of an object store, or an
    http(s) URL whose path ends in ``.zip`` or ``.neuropod``. Imports nothing."""
    if not isinstance(value, str) or "://" not in value:
        return False
    scheme = value.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        return False
    if scheme in ("http", "https"):
        return urlsplit(value).path.rstrip("/").lower().endswith(PACKAGE_SUFFIXES)
    return True


def shown(url: str) -> str:
    """``url`` as messages and records show it: without user, password, query or fragment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme.lower(), host, parts.path, "", ""))


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
    fs, path = _filesystem(url, dict(storage_options or {}))
    where = shown(url)
    root = cache.make_private_dir("downloads", "download cache")
    # A URL never downloaded here: its first chunk is read while the store is asked what the
    # object is (GCS, Azure: used only when its MD5 proves it whole), a round trip less for a
    # small package.
    seen = root / "urls" / hashlib.sha256(where.encode()).hexdigest()
    first_time = _ranged(fs) and not path.endswith("/") and not seen.exists()
    # S3: one GET of the first chunk says what the object is (its ETag, size...) and holds its first
    # chunk (a small object whole): no HEAD, and no MD5 needed to tie the bytes to their identity.
    probe = _s3_probe(fs, path) if first_time and _protocol(fs) in ("s3", "s3a") else None
    first: concurrent.futures.Future[bytes] | None = None
    probed: bytes | None = None
    if probe is not None:
        info, probed = probe
    else:
        first = _read_ahead(fs, path) if first_time else None
        try:
            info = _info(fs, path, where)
        except BaseException:
            if first is not None:
                first.cancel()
            raise
    if info.get("type") == "directory":
        files = _listing(fs, path, where)
        identity: Any = {name: object_identity(i) for name, i in files.items()}
        kind = _DIR
    else:
        files = {"": info}
        identity = object_identity(info)
        kind = _ZIP
    key = hashlib.sha256(json.dumps({"url": where, "kind": kind, "identity": identity}, sort_keys=True,
                                    default=str).encode()).hexdigest()  # fmt: skip
    cacheable = all(_validated(i) for i in identity.values()) if kind == _DIR else _validated(identity)
    entry = root / key
    if cacheable and _complete(entry, key, kind, files):
        _used(entry)
        return entry / kind
    with cache.entry_lock(root, key):
        if cacheable and _complete(entry, key, kind, files):  # downloaded by another process meanwhile
            _used(entry)
            return entry / kind
        if probed is not None:  # the whole object, or its first chunk
            whole = probed if len(probed) == info["size"] else None
            head = [probed] if whole is None else None
            probe = probed = None
        else:
            whole, head = _whole(first, fs, info) if kind == _ZIP else None, None
        _download(fs, path, files, root, key, kind, where, identity, resumable=cacheable, whole=whole, head=head)
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
    fs, path = _filesystem(url, dict(storage_options or {}))
    where = shown(url)
    info = _info(fs, path, where)
    if info.get("type") == "directory":
        return _listing(fs, path, where)
    return {"": info}


def _used(entry: Path) -> None:
    """Mark the download at ``entry`` as used now (its record's time: what :func:`prune_downloads` reads)."""
    with contextlib.suppress(OSError):
        os.utime(entry / _RECORD)


def verify_downloads(repair: bool = False) -> list[str]:
    """Check every download against its record: each file there, a regular file of the size the store
    listed (the package's own hashes are checked by every load).

    :param repair: remove each bad download (it is downloaded again when its URL is next loaded) and
        each temporary directory an interrupted download left.
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
        elif child.name.startswith(".") and child.name.endswith(".tmp"):
            try:
                old = time.time() - child.stat(follow_symlinks=False).st_mtime > cache.STALE_SECONDS
            except OSError:
                continue
            reason = "a temporary directory left by an interrupted download" if old else None
            if reason and repair:
                cache.remove_path(path)
        else:
            continue  # urls/, locks/ and partial downloads (resumed by the next load of their URL)
        if reason:
            shown_url = f" ({url})" if url else ""
            problems.append(f"{path}{shown_url}: {reason}" + (" (removed)" if repair else ""))
    return problems


def _check_download(entry: Path, key: str) -> tuple[str | None, str]:
    """Why the download at ``entry`` is bad (None: it is sound), and its URL as recorded."""
    try:
        record = json.loads((entry / _RECORD).read_text())
    except (OSError, ValueError) as e:
        return f"its {_RECORD} cannot be read ({e})", ""
    if not isinstance(record, dict):
        return f"its {_RECORD} is not a download record", ""
    url = str(record.get("url", ""))
    if record.get("key") != key:
        return f"its {_RECORD} is for another download ({record.get('key')!r})", url
    sizes = record.get("sizes")
    kind = _ZIP if (entry / _ZIP).exists() or "" in (sizes or {}) else _DIR
    if not isinstance(sizes, dict):
        return f"its {_RECORD} lists no files", url
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
    if kind == _DIR:
        present = {p.relative_to(entry / kind).as_posix() for p in (entry / kind).rglob("*") if not p.is_dir()}
        extra = sorted(present - set(sizes))
        if extra:
            return f"{extra[0]!r} was not downloaded (it is not in its {_RECORD})", url
    return None, url


def prune_downloads(days: float = 30, *, dry_run: bool = False) -> list[tuple[Path, str, int]]:
    """Remove the downloads no load has used for ``days`` days (a download is used when a load of its
    URL finds its objects unchanged): old versions of packages, objects since deleted.

    :param days: a number >= 0; 0 removes every download not being made right now.
    :param dry_run: only say which would go.
    :returns: (path, URL, bytes) of each download removed (or that would be).
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
        if not cache.HEX64.fullmatch(child.name):
            continue
        path = Path(child.path)
        with cache.entry_lock(root, child.name):
            try:
                used = os.stat(path / _RECORD).st_mtime
            except OSError:
                continue  # not finished (or broken: `neuropod cache verify --repair`)
            if now - used < days * 86400:
                continue
            _, url = _check_download(path, child.name)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
            if not dry_run:
                cache.remove_path(path)
        gone.append((path, url, size))
    return gone


def _protocol(fs: Any) -> str:
    return str(fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0])


def _s3_probe(fs: Any, path: str) -> tuple[dict[str, Any], bytes] | None:
    """S3's answer to a GET of the first :data:`CHUNK` of ``path``: (the object's info, as s3fs's
    ``info`` gives it, and those bytes: the whole object when it is no larger), both from the one
    response. None when anything else happened (no such object, an empty one, no access, an s3fs
    without ``_call_s3``...): the HEAD that follows says what, in its words."""
    call = getattr(fs, "_call_s3", None)
    if call is None or not hasattr(fs, "split_path"):
        return None
    try:
        import fsspec.asyn

        bucket, key, version = fs.split_path(path)
        if not key:
            return None

        async def get() -> tuple[dict[str, Any], bytes]:
            kw = {"VersionId": version} if version else {}
            resp = await call("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{CHUNK - 1}", **kw)
            try:
                length = resp.get("ContentLength")
                if not isinstance(length, int) or length > CHUNK:  # a server that ignored the range
                    return resp, b""
                return resp, await resp["Body"].read()
            finally:
                resp["Body"].close()

        resp, data = fsspec.asyn.sync(fs.loop, get)
    except Exception:  # noqa: BLE001  # the HEAD that follows says what went wrong
        return None
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
    size = int(total) if total.isdigit() else resp.get("ContentLength")
    if not isinstance(size, int) or len(data) != min(size, CHUNK) or not resp.get("ETag"):
        return None
    # The fields and forms of s3fs's info (a HEAD), so that a later load finds the same identity.
    info = {"ETag": resp.get("ETag", ""), "LastModified": resp.get("LastModified", ""), "size": size,
            "name": f"{bucket}/{key}", "type": "file", "StorageClass": resp.get("StorageClass", "STANDARD"),
            "VersionId": resp.get("VersionId"), "ContentType": resp.get("ContentType")}  # fmt: skip
    return info, data


def _read_ahead(fs: Any, path: str) -> concurrent.futures.Future[bytes]:
    """The first :data:`CHUNK` of ``path``, read on a thread of its own."""
    future: concurrent.futures.Future[bytes] = concurrent.futures.Future()

    def read() -> None:
        try:
            future.set_result(fs.cat_file(path, start=0, end=CHUNK))
        except BaseException as e:  # noqa: BLE001  # whatever it was, the download proper says it
            future.set_exception(e)

    if future.set_running_or_notify_cancel():
        threading.Thread(target=read, name="neuropod-read-ahead", daemon=True).start()
    return future


def _whole(first: concurrent.futures.Future[bytes] | None, fs: Any, info: Mapping[str, Any]) -> bytes | None:
    """The bytes read ahead when they are the whole object ``info`` describes, as its listed MD5
    proves (read before the store was asked, they could be an older version); else None."""
    size = info.get("size")
    if first is None or size is None or size > CHUNK:
        return None
    expected = _listed_md5(fs, info)
    if expected is None:
        return None
    try:
        data = first.result(timeout=READ_AHEAD_WAIT_S)
    except Exception:  # noqa: BLE001  # not there, not in time: the download proper reads it
        return None
    if len(data) != size or hashlib.md5(data, usedforsecurity=False).hexdigest() != expected:
        return None
    return data


def as_downloaded(error: PackageError, local: str | os.PathLike[str], url: str) -> PackageError:
    """``error``, raised for the download of ``url`` at ``local``, as a message about the URL."""
    text = str(error)
    if os.fspath(local) in text:
        return PackageError(text.replace(os.fspath(local), shown(url)))
    return PackageError(f"{text} (the package downloaded from {shown(url)})")


# --- the filesystem ------------------------------------------------------------------------------


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    scheme = url.split("://", 1)[0].lower()
    protocol, distribution, extra = SCHEMES[scheme]
    hint = f"pip install 'neuropod[{extra}]'"
    try:
        import fsspec
    except ImportError:
        raise PluginNotInstalledError(
            f"Loading {shown(url)} needs fsspec and {distribution}: {hint}"
        ) from None
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        raise PluginNotInstalledError(f"Loading {shown(url)} needs {distribution} ({e}): {hint}") from None
    if protocol in ("http", "https"):
        # Ours is the only retry; fsspec's http filesystem must not read whole files into memory.
        options.setdefault("block_size", CHUNK)
        target = url
    else:
        target = protocol + "://" + url.split("://", 1)[1]
    try:
        fs, path = fsspec.core.url_to_fs(target, **options)
    except (TypeError, ValueError) as e:
        raise PackageError(f"Cannot open {shown(url)} with these storage_options: {e}") from None
    return fs, path


def _info(fs: Any, path: str, where: str) -> dict[str, Any]:
    # fsspec keeps filesystems (and s3fs their listings) between calls: what is read here must be
    # what the store holds now, or a changed object would pass for the one downloaded before.
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise PackageError(f"No Neuropod package at {where}: {_what_is_missing(fs, path)}") from None
    except Exception as e:  # noqa: BLE001  # every filesystem raises its own: each one worded
        raise _store_error(e, where, "reading what is") from None
    return dict(info)


def _what_is_missing(fs: Any, path: str) -> str:
    """Why ``path`` is not found: its bucket (container) does not exist, or nothing is at the path."""
    bucket = path.split("/", 1)[0]
    if "://" not in path and bucket and bucket != path.rstrip("/"):
        try:
            exists = fs.exists(bucket)
        except Exception:  # noqa: BLE001  # asking cannot make the answer worse
            exists = True
        if not exists:
            kind = "container" if _protocol(fs) in ("az", "abfs", "abfss") else "bucket"
            return f"the {kind} {bucket!r} does not exist (or these credentials cannot see it)"
    return "no such object or prefix"


def _listing(fs: Any, path: str, where: str) -> dict[str, dict[str, Any]]:
    """The files under the prefix ``path`` by their path relative to it, each checked to be a safe one."""
    try:
        found = fs.find(path, detail=True)
    except Exception as e:  # noqa: BLE001
        raise _store_error(e, where, "listing what is") from None
    base = PurePosixPath(path.rstrip("/"))
    files: dict[str, dict[str, Any]] = {}
    for full, info in sorted(found.items()):
        if info.get("type") == "directory":
            continue
        try:
            rel = PurePosixPath(full.rstrip("/")).relative_to(base)
        except ValueError:
            raise PackageError(f"{where}: the store listed {full!r}, which is not under the prefix") from None
        parts = rel.parts
        if not parts or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
            raise PackageError(f"{where}: refusing the object {full!r}: its path under the prefix is not a plain "
                               "relative path")  # fmt: skip
        files[rel.as_posix()] = dict(info)
    if not files:
        raise PackageError(f"No Neuropod package at {where}: the prefix holds no files")
    return files


def object_identity(info: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies an object's content, from its info: the fields the store gave, and its size."""
    found = {k: info[k] for k in _IDENTITY_FIELDS if info.get(k) not in (None, "")}
    found["size"] = info.get("size")
    return found


def _validated(identity: Mapping[str, Any]) -> bool:
    """Whether ``identity`` holds more than the size: only then may a download made earlier be reused."""
    return len(identity) > 1 and identity.get("size") is not None


def _store_error(e: BaseException, where: str, doing: str) -> PackageError:
    """A filesystem's exception as a PackageError naming the URL and, for access, what to do."""
    name = type(e).__name__
    text = str(e) or name
    if isinstance(e, PermissionError) or _status(e) in (401, 403) \
            or any(s in name for s in ("Credential", "Auth", "Forbidden", "AccessDenied")) \
            or any(s in text for s in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403 Forbidden")):  # fmt: skip
        return PackageError(
            f"No access to {where} while {doing} there ({name}: {text}). Give credentials the filesystem's "
            "usual way (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws/credentials or an instance "
            "role; for GCS: GOOGLE_APPLICATION_CREDENTIALS; for Azure: AZURE_STORAGE_CONNECTION_STRING) or as "
            "load_neuropod(..., storage_options={...})."
        )
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return PackageError(f"No Neuropod package at {where}: the bucket does not exist ({text})")
    return PackageError(f"Cannot read {where} while {doing} there: {name}: {text}")


def _status(e: BaseException) -> int | None:
    """The HTTP status an exception carries: aiohttp's ``status``, botocore's response metadata."""
    status = getattr(e, "status", None) or getattr(e, "status_code", None)
    response = getattr(e, "response", None)
    if status is None and isinstance(response, Mapping):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


# --- the downloads directory -----------------------------------------------------------------------


def _complete(entry: Path, key: str, kind: str, files: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether ``entry`` is a finished download of these files: its record names the key, and every
    file is there, a regular file of its size (a stat each; the load checks the package's hashes)."""
    try:
        record = json.loads((entry / _RECORD).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("key") != key or record.get("sizes") is None:
        return False
    sizes = record["sizes"]
    if not isinstance(sizes, dict) or set(sizes) != set(files):
        return False
    for name, size in sizes.items():
        target = entry / kind / name if name else entry / kind
        try:
            st = os.lstat(target)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
    return True


def _download(
    fs: Any, path: str, files: Mapping[str, Mapping[str, Any]], root: Path, key: str, kind: str, where: str,
    identity: Any, *, resumable: bool, whole: bytes | None = None, head: list[bytes] | None = None,
) -> None:  # fmt: skip
    """Download ``files`` into ``root/key`` (the caller holds the key's lock), replacing what is there.

    :param whole: a zip object's bytes already read (and proven whole by its MD5): written, not read again.
    :param head: a zip object's first bytes, read in the answer that gave its identity: written, and the
        rest read after them (the list is emptied once they are written, so that they are not held).
    """
    total = sum(int(i.get("size") or 0) for i in files.values())
    limit = cache.max_package_bytes()
    if total > limit:
        raise PackageError(f"{where} is {total:,} bytes, more than the {limit:,} a package may hold "
                           "(NEUROPOD_MAX_PACKAGE_BYTES)")  # fmt: skip
    # What a killed download left is resumed: the same key is the same bytes, when the store said
    # what identifies them (else it starts again).
    partial = root / f"{key}.partial"
    if not resumable or (kind == _ZIP and partial.is_dir()) or (kind == _DIR and partial.is_file()):
        cache.remove_path(partial)
    if kind == _DIR:
        partial.mkdir(mode=0o700, exist_ok=True)
    started = time.monotonic()
    log.info("downloading %s (%s bytes)", where, f"{total:,}")
    sizes: dict[str, int] = {}
    same = True  # every file's bytes have the MD5 its store listed (so none changed meanwhile)
    for name, info in files.items():
        source = path if not name else path.rstrip("/") + "/" + name
        target = partial if not name else partial / name
        target.parent.mkdir(parents=True, exist_ok=True)
        expected = _listed_md5(fs, info)
        if whole is not None:
            with open(target, "wb") as out:
                out.write(whole)
                out.flush()
                os.fsync(out.fileno())
            sizes[name], md5 = len(whole), expected
        else:
            written = 0
            if head and not name and not (target.exists() and target.stat().st_size >= len(head[0])):
                with open(target, "wb") as out:
                    written = out.write(head.pop())
            sizes[name], md5 = _download_file(fs, source, target, info,
                                              where if not name else f"{where.rstrip('/')}/{name}",
                                              md5=expected is not None, head=written)  # fmt: skip
        same = same and expected is not None and md5 == expected
    # The object (or any file under the prefix) rewritten while it was read would mix two versions,
    # or put another version under this one's key: asked again, unless the MD5s said so already.
    if not same:
        after: Any
        if kind == _DIR:
            after = {n: object_identity(i) for n, i in _listing(fs, path, where).items()}
        else:
            after = object_identity(_info(fs, path, where))
        if after != identity:
            cache.remove_path(partial)
            raise PackageError(f"{where} changed while it was being downloaded; load it again once it is complete")
    elapsed = max(time.monotonic() - started, 1e-9)
    log.info("downloaded %s: %s bytes in %.1f s (%.1f MB/s)", where, f"{total:,}", elapsed, total / elapsed / 1e6)
    tmp = Path(os.fspath(root / f".{key}.{secrets.token_hex(4)}.tmp"))
    tmp.mkdir(mode=0o700)
    try:
        os.rename(partial, tmp / kind)
        _fsync_tree(tmp / kind)
        record = {"key": key, "url": where, "identity": identity, "sizes": sizes, "downloaded": time.time()}
        with open(tmp / _RECORD, "w") as f:
            json.dump(record, f, default=str)
            f.flush()
            os.fsync(f.fileno())
        final = root / key
        if os.path.lexists(final):
            cache.remove_path(final)
        os.rename(tmp, final)
    finally:
        if os.path.lexists(tmp):
            cache.remove_path(tmp)


def _download_file(
    fs: Any, source: str, target: Path, info: Mapping[str, Any], where: str, *, md5: bool, head: int = 0
) -> tuple[int, str | None]:
    """Stream one object into ``target``, resuming from its length, retrying failures: its size,
    and with ``md5`` the MD5 of its bytes (hashed as they are written)."""
    size = info.get("size")
    wait = FIRST_WAIT_S
    for attempt in range(1, ATTEMPTS + 1):
        try:
            have = target.stat().st_size if target.exists() else 0
            if size is not None and have > size:
                target.unlink()
                have = 0
            digest = _md5_of_prefix(target, have) if md5 else None
            if size is not None and have == size:
                if not have:
                    target.touch()  # an empty object (a package's empty __init__.py): nothing to read
                return have, digest.hexdigest() if digest is not None else None
            if have and (attempt > 1 or have != head):  # not the first chunk just written
                log.info("resuming %s from byte %s", where, f"{have:,}")
            written = _copy(fs, source, target, have, size, digest)
            return written, digest.hexdigest() if digest is not None else None
        except FileNotFoundError:
            raise PackageError(f"No Neuropod package at {where}: the object went away while it was being "
                               "downloaded") from None  # fmt: skip
        except NeuropodError:
            raise
        except Exception as e:  # noqa: BLE001  # a connection lost, a timeout: retried from where it stopped
            error = _store_error(e, where, "downloading what is")
            if "No access" in str(error) or attempt == ATTEMPTS:
                raise error from None
            log.warning("downloading %s failed (%s: %s); retrying in %.1f s (attempt %d of %d)", where,
                        type(e).__name__, e, wait, attempt + 1, ATTEMPTS)  # fmt: skip
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")


def _md5_of_prefix(target: Path, length: int) -> Any:
    """An MD5 fed the first ``length`` bytes of ``target`` (a download being resumed)."""
    digest = hashlib.md5(usedforsecurity=False)
    if length:
        with open(target, "rb") as f:
            while length > 0:
                chunk = f.read(min(CHUNK, length))
                if not chunk:
                    break
                digest.update(chunk)
                length -= len(chunk)
    return digest


def _listed_md5(fs: Any, info: Mapping[str, Any]) -> str | None:
    """The MD5 (hex) of an object's bytes as its store lists it, where it surely is one: an S3
    ETag of 32 hex digits (an object uploaded whole), GCS's md5Hash, an Azure blob's Content-MD5.
    None otherwise (multipart uploads, web servers' ETags, which mean what each server likes)."""
    protocol = _protocol(fs)
    if protocol in ("s3", "s3a"):
        etag = str(info.get("ETag") or "").strip('"').lower()
        return etag if len(etag) == 32 and all(c in "0123456789abcdef" for c in etag) else None
    if protocol in ("gs", "gcs") and info.get("md5Hash"):
        try:
            return base64.b64decode(str(info["md5Hash"]), validate=True).hex()
        except ValueError:
            return None
    if protocol in ("az", "abfs", "abfss"):
        # adlfs lists the blob's Content-MD5 property (set when it was uploaded whole) as 16 bytes.
        settings = info.get("content_settings")
        md5 = getattr(settings, "content_md5", None)
        if md5 is None and isinstance(settings, Mapping):
            md5 = settings.get("content_md5")
        if isinstance(md5, (bytes, bytearray)) and len(md5) == 16:
            return bytes(md5).hex()
    return None


def _copy(fs: Any, source: str, target: Path, offset: int, size: int | None, digest: Any = None) -> int:
    """Append ``source`` from ``offset`` to ``target``, a chunk at a time (each fed to ``digest``
    too, when given); the length written in all."""
    if size is not None and size - offset > CHUNK and _ranged(fs):
        return _copy_ranges(fs, source, target, offset, size, digest)
    with fs.open(source, "rb", block_size=CHUNK, cache_type="none") as src:
        if offset:
            try:
                src.seek(offset)
            except (OSError, ValueError):  # no ranges here: start again
                offset = 0
        mode = "ab" if offset else "wb"
        with open(target, mode) as out:
            if not offset:
                out.truncate(0)
            written = offset
            while True:
                chunk = src.read(CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                if digest is not None:
                    digest.update(chunk)
                written += len(chunk)
                if size is not None and written > size:
                    raise OSError(errno.EFBIG, f"the object holds more than the {size:,} bytes its store listed")
            out.flush()
            os.fsync(out.fileno())
    if size is not None and written != size:
        raise OSError(errno.EIO, f"the download stopped at {written:,} of {size:,} bytes")
    return written


def _ranged(fs: Any) -> bool:
    """Whether ``fs`` is an object store, whose every object takes range reads (a web server may not)."""
    protocol = _protocol(fs)
    return protocol in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def _copy_ranges(fs: Any, source: str, target: Path, offset: int, size: int, digest: Any = None) -> int:
    """:func:`_copy` of an object store's object: :data:`PARALLEL` range reads of a chunk each in flight
    (one request's latency hides behind the others', as ``aws s3 cp`` does), written in order, so a
    download that stops leaves a prefix to resume from. Memory: at most about ``2 * PARALLEL + 4`` chunks."""
    ranges = iter(range(offset, size, CHUNK))
    written = offset
    with concurrent.futures.ThreadPoolExecutor(PARALLEL, thread_name_prefix="neuropod-download") as pool, \
            open(target, "ab" if offset else "wb") as out:  # fmt: skip
        if not offset:
            out.truncate(0)
        pending: collections.deque[tuple[int, concurrent.futures.Future[bytes]]] = collections.deque()

        def more() -> None:
            start = next(ranges, None)
            if start is not None:
                end = min(start + CHUNK, size)
                pending.append((end - start, pool.submit(fs.cat_file, source, start=start, end=end)))

        for _ in range(PARALLEL):
            more()
        try:
            while pending:
                length, future = pending.popleft()
                chunk = future.result()
                if len(chunk) != length:
                    raise OSError(errno.EIO, f"a range read gave {len(chunk):,} bytes instead of {length:,}")
                out.write(chunk)
                if digest is not None:
                    digest.update(chunk)
                written += length
                del chunk
                more()
        finally:
            for _, future in pending:
                future.cancel()
            out.flush()
            os.fsync(out.fileno())
    return written


def _fsync_tree(path: Path) -> None:
    if path.is_file():
        return  # written and synced by _copy
    for dirpath, _dirs, _files in os.walk(path):
        with contextlib.suppress(OSError):
            fd = os.open(dirpath, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


__all__ = [
    "PACKAGE_SUFFIXES", "SCHEMES", "as_downloaded", "downloads_dir", "fetch", "is_package_url", "list_objects",
    "object_identity", "prune_downloads", "shown", "verify_downloads",
]  # fmt: skip
