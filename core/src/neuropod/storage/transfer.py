"""Downloading into the downloads directory: streamed in chunks, range reads in parallel, retried and
resumed, checked against the store's identity, moved into place with its record last."""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

import neuropod.storage.stores as stores
import neuropod.storage.web as web
from neuropod import cache
from neuropod.errors import NeuropodError, PackageError
from neuropod.storage.pinned import Read, ranged_reader
from neuropod.storage.stores import (
    fs_protocol,
    is_ranged,
    list_files,
    listed_md5,
    object_identity,
    object_info,
    store_error,
)
from neuropod.storage.urls import redact
from neuropod.storage.web import Changed, Unfit

log = logging.getLogger("neuropod.storage")

#: Range reads of an object store's object in flight at once.
PARALLEL = 4
#: Seconds the first download of a URL waits for the chunk read ahead once the store said what the
#: object is (beyond them, the download proper reads it).
READ_AHEAD_WAIT_S = 30.0
#: Attempts at one file before a download fails; the waits between them (seconds) double from the first.
ATTEMPTS = 5
FIRST_WAIT_S = 0.5
ZIP_ENTRY = "package.zip"
DIR_ENTRY = "package"
RECORD_FILE = "record.json"


def s3_probe(fs: Any, path: str) -> tuple[dict[str, Any], bytes] | None:
    """S3's answer to a GET of the first :data:`stores.CHUNK` of ``path``: (the object's info, as s3fs's
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
            resp = await call("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{stores.CHUNK - 1}", **kw)
            try:
                length = resp.get("ContentLength")
                if not isinstance(length, int) or length > stores.CHUNK:  # a server that ignored the range
                    return resp, b""
                return resp, await resp["Body"].read()
            finally:
                resp["Body"].close()

        resp, data = fsspec.asyn.sync(fs.loop, get)
    except Exception:  # noqa: BLE001  # the HEAD that follows says what went wrong
        return None
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
    size = int(total) if total.isdigit() else resp.get("ContentLength")
    if not isinstance(size, int) or len(data) != min(size, stores.CHUNK) or not resp.get("ETag"):
        return None
    # The fields and forms of s3fs's info (a HEAD), so that a later load finds the same identity.
    info = {"ETag": resp.get("ETag", ""), "LastModified": resp.get("LastModified", ""), "size": size,
            "name": f"{bucket}/{key}", "type": "file", "StorageClass": resp.get("StorageClass", "STANDARD"),
            "VersionId": resp.get("VersionId"), "ContentType": resp.get("ContentType")}  # fmt: skip
    return info, data


def read_ahead(fs: Any, path: str) -> concurrent.futures.Future[bytes]:
    """The first :data:`stores.CHUNK` of ``path``, read on a thread of its own."""
    future: concurrent.futures.Future[bytes] = concurrent.futures.Future()

    def read() -> None:
        try:
            future.set_result(fs.cat_file(path, start=0, end=stores.CHUNK))
        except BaseException as e:  # noqa: BLE001  # whatever it was, the download proper says it
            future.set_exception(e)

    if future.set_running_or_notify_cancel():
        threading.Thread(target=read, name="neuropod-read-ahead", daemon=True).start()
    return future


def whole_read_ahead(first: concurrent.futures.Future[bytes] | None, fs: Any, info: Mapping[str, Any]) -> bytes | None:
    """The bytes read ahead when they are the whole object ``info`` describes, as its listed MD5
    proves (read before the store was asked, they could be an older version); else None."""
    size = info.get("size")
    if first is None or size is None or size > stores.CHUNK:
        return None
    expected = listed_md5(fs, info)
    if expected is None:
        return None
    try:
        data = first.result(timeout=READ_AHEAD_WAIT_S)
    except Exception:  # noqa: BLE001  # not there, not in time: the download proper reads it
        return None
    if len(data) != size or hashlib.md5(data, usedforsecurity=False).hexdigest() != expected:
        return None
    return data


def is_complete(entry: Path, key: str, kind: str, files: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether ``entry`` is a finished download of these files: its record names the key, and every
    file is there, a regular file of its size (a stat each; the load checks the package's hashes)."""
    try:
        record = json.loads((entry / RECORD_FILE).read_text())
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


def download(
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
    if not resumable or (kind == ZIP_ENTRY and partial.is_dir()) or (kind == DIR_ENTRY and partial.is_file()):
        cache.remove_path(partial)
    if kind == DIR_ENTRY:
        partial.mkdir(mode=0o700, exist_ok=True)
    started = time.monotonic()
    log.info("downloading %s (%s bytes)", where, f"{total:,}")
    sizes: dict[str, int] = {}
    same = True  # every file's bytes have the MD5 its store listed (so none changed meanwhile)
    for name, info in files.items():
        source = path if not name else path.rstrip("/") + "/" + name
        target = partial if not name else partial / name
        target.parent.mkdir(parents=True, exist_ok=True)
        expected = listed_md5(fs, info)
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
            try:
                sizes[name], md5 = _download_file(fs, source, target, info,
                                                  where if not name else f"{where.rstrip('/')}/{name}",
                                                  md5=expected is not None, head=written)  # fmt: skip
            except Unfit:  # another version's bytes, or too many: nothing of them is kept
                cache.remove_path(partial)
                raise
        if expected is not None and md5 != expected:  # bytes of another version than the one listed
            cache.remove_path(partial)
            raise Changed(f"{where} changed while it was being downloaded (its bytes are not those of the "
                          "version listed); load it again once it is complete")  # fmt: skip
        same = same and expected is not None
    # The object (or any file under the prefix) rewritten while it was read would mix two versions,
    # or put another version under this one's key: asked again, unless the MD5s said so already.
    if not same:
        after: Any
        if kind == DIR_ENTRY:
            after = {n: object_identity(i) for n, i in list_files(fs, path, where).items()}
        else:
            after = object_identity(object_info(fs, path, where))
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
        with open(tmp / RECORD_FILE, "w") as f:
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
    ranges = [True]  # a web server that showed it takes no ranges: every attempt starts again
    # An object store's reads, each conditional on the version this download is cached under.
    read = ranged_reader(fs, source, info, where) if is_ranged(fs) else None
    for attempt in range(1, ATTEMPTS + 1):
        try:
            have = target.stat().st_size if target.exists() and ranges[0] else 0
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
            if fs_protocol(fs) in ("http", "https"):
                written = web.copy(fs, source, target, have, info, where, ranges)
                return written, None  # a web server lists no MD5
            written = _copy(fs, source, target, have, size, digest, read)
            return written, digest.hexdigest() if digest is not None else None
        except FileNotFoundError:
            raise PackageError(f"No Neuropod package at {where}: the object went away while it was being "
                               "downloaded") from None  # fmt: skip
        except NeuropodError:
            raise
        except Exception as e:  # noqa: BLE001  # a connection lost, a timeout: retried from where it stopped
            error = store_error(e, where, "downloading what is")
            if "No access" in str(error) or attempt == ATTEMPTS:
                raise error from None
            log.warning("downloading %s failed (%s: %s); retrying in %.1f s (attempt %d of %d)", where,
                        type(e).__name__, redact(str(e)), wait, attempt + 1, ATTEMPTS)  # fmt: skip
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")


def _md5_of_prefix(target: Path, length: int) -> Any:
    """An MD5 fed the first ``length`` bytes of ``target`` (a download being resumed)."""
    digest = hashlib.md5(usedforsecurity=False)
    if length:
        with open(target, "rb") as f:
            while length > 0:
                chunk = f.read(min(stores.CHUNK, length))
                if not chunk:
                    break
                digest.update(chunk)
                length -= len(chunk)
    return digest


def _copy(fs: Any, source: str, target: Path, offset: int, size: int | None, digest: Any = None,
          read: Read | None = None) -> int:  # fmt: skip
    """Append ``source`` from ``offset`` to ``target``, a chunk at a time (each fed to ``digest``
    too, when given); the length written in all.

    :param read: reads ranges of ``source`` from the version being downloaded (:mod:`.pinned`):
        every read of the object goes through it."""
    if size is not None and is_ranged(fs) and (read is not None or size - offset > stores.CHUNK):
        return _copy_ranges(fs, source, target, offset, size, digest, read)
    with fs.open(source, "rb", block_size=stores.CHUNK, cache_type="none") as src:
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
                chunk = src.read(stores.CHUNK)
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


def _copy_ranges(fs: Any, source: str, target: Path, offset: int, size: int, digest: Any = None,
                 read: Read | None = None) -> int:  # fmt: skip
    """:func:`_copy` of an object store's object: :data:`PARALLEL` range reads of a chunk each in flight
    (one request's latency hides behind the others', as ``aws s3 cp`` does), written in order, so a
    download that stops leaves a prefix to resume from. Memory: at most about ``2 * PARALLEL + 4`` chunks."""
    # Without ``read``, plain reads: the listed MD5 and the check after the download tie them to the version.
    reader = read or (lambda start, end: bytes(fs.cat_file(source, start=start, end=end)))
    if size - offset <= stores.CHUNK:  # one read: no threads
        chunk = reader(offset, size)
        if len(chunk) != size - offset:
            raise OSError(errno.EIO, f"a range read gave {len(chunk):,} bytes instead of {size - offset:,}")
        return _append(target, offset, [chunk], digest)
    ranges = iter(range(offset, size, stores.CHUNK))
    written = offset
    with concurrent.futures.ThreadPoolExecutor(PARALLEL, thread_name_prefix="neuropod-download") as pool, \
            open(target, "ab" if offset else "wb") as out:  # fmt: skip
        if not offset:
            out.truncate(0)
        pending: collections.deque[tuple[int, concurrent.futures.Future[bytes]]] = collections.deque()

        def more() -> None:
            start = next(ranges, None)
            if start is not None:
                end = min(start + stores.CHUNK, size)
                pending.append((end - start, pool.submit(reader, start, end)))

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


def _append(target: Path, offset: int, chunks: list[bytes], digest: Any) -> int:
    """Write ``chunks`` to ``target`` from ``offset`` (its length until then), synced: the length then."""
    with open(target, "ab" if offset else "wb") as out:
        if not offset:
            out.truncate(0)
        for chunk in chunks:
            out.write(chunk)
            if digest is not None:
                digest.update(chunk)
            offset += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return offset


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
