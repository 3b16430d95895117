"""The cache entries: a zip package extracted once under its sha256, with a record of every file,
checked cheaply on each load and re-hashed on demand (``neuropod cache verify``)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import stat
import struct
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from neuropod import _json
from neuropod.cache.regular_files import (
    CHUNK,
    O_CLOEXEC,
    O_NOFOLLOW,
    file_kind,
    hash_stream,
    open_regular,
    scan_tree,
    sha256_file,
)
from neuropod.errors import PackageError

try:
    import lzma
except ImportError:  # a Python built without lzma: zipfile refuses such members itself
    lzma = None  # type: ignore[assignment]

RECORD = "record.json"
FILES = "files"
_RECORD_FORMAT = "neuropod-cache-entry"
_RECORD_VERSION = 1
#: A temporary directory older than this is left over by a killed process, not in use.
STALE_SECONDS = 3600
#: What :func:`remove_path` renames a path to (``<prefix><16 hex digits>``, beside it) before it deletes it:
#: one left behind is a removal that was killed half-way.
TRASH_PREFIX = ".trash-"
#: Above this many files one ``sync()`` is cheaper than an ``fsync()`` per file.
_FSYNC_EACH_UP_TO = 256
#: Deeper than any real package; keeps directory creation and removal, which recurse, far from the stack limit.
_MAX_DEPTH = 100
_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
HEX64 = re.compile(r"[0-9a-f]{64}")

#: What zipfile and the decompressors raise on damaged data (bz2 raises OSError).
ZIP_READ_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError, struct.error, ValueError,
    NotImplementedError, RuntimeError, IndexError, OverflowError,
)
if lzma is not None:
    ZIP_READ_ERRORS += (lzma.LZMAError,)


@dataclass(frozen=True)
class FileRecord:
    """What the record says about one extracted file."""

    size: int
    mtime_ns: int
    sha256: str


@dataclass(frozen=True)
class Entry:
    """A checked cache entry: where the zip's files are, and their records by relative path."""

    path: Path
    files: Mapping[str, FileRecord]


class _Invalid(Exception):
    """A cache entry that must not be used; the message says why."""


def cache_dir() -> Path:
    """Where extracted zip packages live: ``NEUROPOD_CACHE_DIR``, else ``$XDG_CACHE_HOME/neuropod``."""
    env = os.environ.get("NEUROPOD_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "neuropod"


def _make_packages_dir() -> Path:
    return make_private_dir("packages", "package cache")


def make_private_dir(name: str, what: str) -> Path:
    """``name`` in the cache directory, both made private (mode 0700) if missing.

    :param what: what it holds, for the error ("package cache", "download cache").
    :raises PackageError: it cannot be made.
    """
    root = cache_dir()
    path = root / name
    try:
        # Private: whoever can write here can change the models this cache serves.
        if not root.is_dir():
            root.parent.mkdir(parents=True, exist_ok=True)
            root.mkdir(mode=0o700, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise PackageError(
            f"Cannot create the {what} at {path}: {e.strerror}. Set NEUROPOD_CACHE_DIR to a writable directory."
        ) from None
    return path


def extract(
    source: Path,
    *,
    max_bytes: int,
    max_files: int,
    check: Callable[[Path, Mapping[str, FileRecord]], object] | None = None,
) -> Entry:
    """The checked cache entry of a zip, extracting it when there is none or it is bad.

    :param check: called on a fresh extraction before it enters the cache;
        whatever it raises aborts the extraction and leaves nothing behind.
    :raises PackageError: the zip is unreadable, corrupt, unsafe or over a limit.
    """
    for _ in range(3):
        try:
            return _extract_once(source, max_bytes, max_files, check)
        except _Changed:
            continue
    raise PackageError(
        f"Zip package {source} changed while it was being read, three times in a row: is something still "
        "writing it? Load it again once it is complete (write packages elsewhere and rename them into place)."
    )


class _Changed(Exception):
    """The zip's bytes changed between two reads through one descriptor (it is rewritten in place)."""


def _extract_once(
    source: Path, max_bytes: int, max_files: int, check: Callable[[Path, Mapping[str, FileRecord]], object] | None
) -> Entry:
    try:
        f = open_regular(source, follow_symlinks=True)  # the zip's own path may well be a link
    except PackageError as e:
        raise PackageError(f"Cannot read zip package {source}: {e}") from None
    with f:
        digest = _hash_zip(f, source)
        try:
            return _check_entry(cache_dir() / "packages" / digest, digest)
        except _Invalid:
            pass
        packages = _make_packages_dir()
        with entry_lock(packages, digest):
            try:  # made or repaired by another process while this one waited for the lock?
                return _check_entry(packages / digest, digest)
            except _Invalid:
                pass
            f.seek(0)
            with tempfile.TemporaryFile(dir=packages) as copy:
                # Hash the private copy as it is written: the entry is made
                # from exactly the bytes whose hash is its key, whatever
                # happens to the zip's path meanwhile.
                if _hash_zip(f, source, copy_to=copy) != digest:
                    raise _Changed
                return _extract_and_commit(copy, digest, packages, source, max_bytes, max_files, check)


@contextlib.contextmanager
def entry_lock(packages: Path, digest: str, *, wait: bool = True) -> Iterator[bool]:
    """Serialize the processes that extract or repair one entry (or download one object: see
    :mod:`neuropod.storage`), by a lock named ``digest`` beside ``packages``.

    Without it, N workers starting together would each unpack the same zip
    (N times the disk), and one repairing a bad entry could delete the good
    one another has just put in its place. Readers of a sound entry never wait.

    :param wait: False: do not wait for a process that holds it; the context then yields False
        (and holds nothing), else True.
    """
    locks = packages.parent / "locks"
    try:
        locks.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(locks / digest, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0o600)
    except OSError as e:
        raise PackageError(f"Cannot create a lock in the package cache at {locks}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:  # held by another (wait=False only)
            held = False
        yield held
    finally:
        os.close(fd)  # closing releases the lock


def _hash_zip(f: io.BufferedReader, source: Path, copy_to: BinaryIO | None = None) -> str:
    try:
        return hash_stream(f, copy_to)
    except OSError as e:
        raise PackageError(f"Cannot read zip package {source}: {e.strerror}") from None


def _extract_and_commit(
    copy: BinaryIO,
    digest: str,
    packages: Path,
    source: Path,
    max_bytes: int,
    max_files: int,
    check: Callable[[Path, Mapping[str, FileRecord]], object] | None,
) -> Entry:
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=packages))
    except OSError as e:
        raise PackageError(f"Cannot write to the package cache at {packages}: {e.strerror}") from None
    try:  # whatever happens, an interrupt included, nothing partial stays behind
        files = _extract_members(copy, tmp / FILES, source, max_bytes, max_files)
        if check is not None:
            check(tmp / FILES, files)
        _write_record(tmp, digest, files)
        _check_entry(tmp, digest)  # what is committed is exactly what was recorded
        return _commit(tmp, packages / digest, digest)
    except _Invalid as e:
        raise PackageError(f"Extracting zip package {source} into the cache failed: {e}") from None
    finally:
        if os.path.lexists(tmp):
            remove_path(tmp)


def _commit(tmp: Path, final: Path, digest: str) -> Entry:
    """Put ``tmp`` in place as ``final`` (the caller holds the entry's lock)."""
    if os.path.lexists(final):
        remove_path(final)  # a bad entry (the caller checked it): file, empty directory, changed files
    try:
        os.rename(tmp, final)
    except OSError as e:
        raise PackageError(f"Cannot write the cache entry {final}: {e.strerror}") from None
    return _check_entry(final, digest)


def remove_path(path: Path) -> None:
    """Move ``path`` out of the way atomically, then delete it; gone already is fine."""
    trash = path.parent / f"{TRASH_PREFIX}{secrets.token_hex(8)}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    if os.path.isdir(trash) and not os.path.islink(trash):
        shutil.rmtree(trash, ignore_errors=True)
    else:
        try:
            os.unlink(trash)
        except OSError:
            pass


def _safe_members(zf: zipfile.ZipFile, source: Path, max_bytes: int, max_files: int) -> list[tuple[zipfile.ZipInfo, str]]:
    infos = zf.infolist()
    if len(infos) > max_files:
        raise PackageError(
            f"Zip package {source} has {len(infos)} members, more than the {max_files} allowed "
            "(raise NEUROPOD_MAX_PACKAGE_FILES if the package really holds that many files)"
        )
    members = []
    seen: dict[str, str] = {}
    dirs: set[str] = set()
    total = 0
    for info in infos:
        name = info.filename
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise PackageError(f"Zip package {source} holds a link {name!r}; links are not allowed in packages")
        if "\\" in name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
            raise PackageError(f"Zip package {source} holds an absolute or non-POSIX path {name!r}")
        if info.flag_bits & 0x1:
            raise PackageError(f"Zip package {source} holds an encrypted member {name!r}; packages cannot be encrypted")
        if info.compress_type not in _METHODS:
            raise PackageError(
                f"Zip package {source}: member {name!r} uses compression method {info.compress_type}, which this "
                "Python cannot unpack (stored, deflate, bzip2 and lzma can be)"
            )
        if "\0" in name:
            raise PackageError(f"Zip package {source} holds a member name with a NUL character: {name!r}")
        parts = [p for p in PurePosixPath(name).parts if p != "."]
        if ".." in parts:
            raise PackageError(f"Zip package {source} holds a path that leaves the package: {name!r}")
        if len(parts) > _MAX_DEPTH:
            raise PackageError(
                f"Zip package {source} holds a path {len(parts)} levels deep ({name[:80]!r}...); "
                f"a package path may have at most {_MAX_DEPTH}"
            )
        rel = "/".join(parts)
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
        if name.endswith("/"):  # a directory (ZipInfo.is_dir, which an empty name would crash)
            dirs.add(rel)
            continue
        if not rel:
            raise PackageError(f"Cannot extract zip package {source}: member {name!r} has no file name")
        if rel in seen:
            raise PackageError(
                f"Zip package {source} holds two members that unpack to {rel!r} ({seen[rel]!r} and {name!r}); "
                "tools disagree on which one wins, so neither is used"
            )
        seen[rel] = name
        total += info.file_size
        if total > max_bytes:
            raise _too_big(source, max_bytes)
        members.append((info, rel))
    clash = sorted(set(seen) & dirs)
    if clash:
        raise PackageError(f"Cannot extract zip package {source}: {clash[0]!r} is both a file and a directory in it")
    return members


def _too_big(source: Path, max_bytes: int) -> PackageError:
    return PackageError(
        f"Zip package {source} unpacks to more than {max_bytes} bytes "
        "(raise NEUROPOD_MAX_PACKAGE_BYTES if the package is really that large)"
    )


def _extract_members(
    copy: BinaryIO, dest: Path, source: Path, max_bytes: int, max_files: int
) -> dict[str, FileRecord]:
    try:
        zf = zipfile.ZipFile(copy)
    except ZIP_READ_ERRORS as e:
        raise PackageError(f"{source} is not a readable zip package: {e}") from None
    written = 0
    records: dict[str, FileRecord] = {}
    with zf:
        members = _safe_members(zf, source, max_bytes, max_files)
        dest.mkdir()
        for info, rel in members:
            target = dest.joinpath(*rel.split("/"))
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644)
            except OSError as e:
                raise PackageError(f"Cannot extract zip package {source}: member {rel!r}: {e.strerror}") from None
            h = hashlib.sha256()
            with open(fd, "wb", buffering=0) as out:
                try:
                    src = zf.open(info)
                except ZIP_READ_ERRORS as e:
                    raise _corrupt(source, info.filename, e) from None
                with src:
                    while True:
                        try:
                            chunk = src.read(CHUNK)
                        except ZIP_READ_ERRORS as e:
                            raise _corrupt(source, info.filename, e) from None
                        if not chunk:
                            break
                        written += len(chunk)  # headers can lie about sizes: count what comes out
                        if written > max_bytes:
                            raise _too_big(source, max_bytes)
                        h.update(chunk)
                        try:
                            out.write(chunk)
                        except OSError as e:
                            raise PackageError(
                                f"Cannot extract zip package {source} into the cache: member {rel!r}: {e.strerror}"
                            ) from None
                if len(members) <= _FSYNC_EACH_UP_TO:
                    os.fsync(out.fileno())
            st = os.stat(target)
            records[rel] = FileRecord(st.st_size, st.st_mtime_ns, h.hexdigest())
    if len(members) > _FSYNC_EACH_UP_TO:
        os.sync()
    return records


def _corrupt(source: Path, member: str, e: BaseException) -> PackageError:
    return PackageError(
        f"Zip package {source} is damaged: member {member!r} cannot be unpacked ({type(e).__name__}: {e}). "
        "Download or build the package again."
    )


def _write_record(entry: Path, digest: str, files: Mapping[str, FileRecord]) -> None:
    record = {
        "format": _RECORD_FORMAT,
        "version": _RECORD_VERSION,
        "zip_sha256": digest,
        "files": {rel: [r.size, r.mtime_ns, r.sha256] for rel, r in sorted(files.items())},
    }
    data = json.dumps(record, separators=(",", ":")).encode()
    fd = os.open(entry / RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644)
    with open(fd, "wb") as f:
        f.write(data)


def _read_record(entry: Path, digest: str) -> dict[str, FileRecord]:
    try:
        with open_regular(entry / RECORD) as f:
            text = f.read(_json.MAX_BYTES + 1).decode("utf-8")
        data = _json.loads(text)
    except (PackageError, OSError, ValueError) as e:  # UnicodeDecodeError and JSON errors are ValueErrors
        raise _Invalid(f"its {RECORD} cannot be read ({e})") from None
    if not isinstance(data, dict) or data.get("format") != _RECORD_FORMAT or data.get("version") != _RECORD_VERSION:
        raise _Invalid(f"its {RECORD} is not a version {_RECORD_VERSION} cache record")
    if data.get("zip_sha256") != digest:
        raise _Invalid(f"its {RECORD} is for zip {data.get('zip_sha256')!r}, not {digest}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise _Invalid(f"its {RECORD} has no file list")
    out = {}
    for rel, r in files.items():
        if not (isinstance(r, list) and len(r) == 3 and all(type(v) is int for v in r[:2]) and isinstance(r[2], str)):
            raise _Invalid(f"its {RECORD} has a malformed entry for {rel!r}")
        out[rel] = FileRecord(r[0], r[1], r[2])
    return out


def _check_entry(entry: Path, digest: str, *, rehash: bool = False) -> Entry:
    """The entry at ``entry`` if it is complete and matches its record; else :class:`_Invalid`."""
    try:
        st = os.lstat(entry)
    except OSError:
        raise _Invalid("it does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _Invalid(f"it is {file_kind(st.st_mode)}, not a directory")
    records = _read_record(entry, digest)
    try:
        present = scan_tree(entry / FILES)
    except PackageError as e:
        raise _Invalid(str(e)) from None
    missing = sorted(set(records) - set(present))
    if missing:
        raise _Invalid(f"{missing[0]!r} is missing")
    extra = sorted(set(present) - set(records))
    if extra:
        raise _Invalid(f"{extra[0]!r} is not in its {RECORD}")
    for rel, fst in present.items():
        r = records[rel]
        if fst.st_size != r.size or fst.st_mtime_ns != r.mtime_ns:
            raise _Invalid(f"{rel!r} was changed after extraction (size or modification time differ)")
        if rehash:
            try:
                actual = sha256_file(entry / FILES / rel)
            except PackageError as e:
                raise _Invalid(str(e)) from None
            if actual != r.sha256:
                raise _Invalid(f"{rel!r} was changed after extraction (its sha256 differs from the record)")
    return Entry(entry / FILES, records)


def verify_cache(repair: bool = False) -> list[str]:
    """Re-hash every file of every cache entry against its record.

    :param repair: remove each bad entry (it is extracted again the next time
        its zip is loaded) and each temporary directory left by a killed process.
    :returns: one line per problem, naming the entry and what is wrong (ending
        in "(removed)" when ``repair`` removed it); empty when the cache is sound.
    """
    packages = cache_dir() / "packages"
    try:
        with os.scandir(packages) as it:
            children = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise PackageError(f"Cannot list the package cache {packages}: {e.strerror}") from None
    problems = []
    for child in children:
        path = Path(child.path)
        if HEX64.fullmatch(child.name):
            # Under the entry's lock, so that a load repairing it meanwhile is
            # not undone, and what is removed is what was found bad.
            with entry_lock(packages, child.name):
                try:
                    _check_entry(path, child.name, rehash=True)
                    reason = None
                except _Invalid as e:
                    reason = str(e)
                if reason and repair:
                    remove_path(path)
        else:
            reason = _stray(child)
            if reason and repair:
                remove_path(path)
        if reason:
            problems.append(f"{path}: {reason}" + (" (removed)" if repair else ""))
    return problems


def _stray(child: os.DirEntry[str]) -> str | None:
    """Why something in the cache that is not an entry should go, or None to leave it."""
    if not child.name.startswith((".extract-", TRASH_PREFIX, "tmp")):
        return "not a cache entry (its name is not a sha256)"
    try:
        age = time.time() - child.stat(follow_symlinks=False).st_mtime
    except OSError:
        return None  # gone already
    if age < STALE_SECONDS:
        return None  # perhaps another process is extracting right now
    return "a temporary directory left behind by an interrupted extraction"
