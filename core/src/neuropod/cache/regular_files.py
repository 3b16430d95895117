"""Files a package may hold: regular files only, opened without following links or blocking
on a FIFO; listing a tree and hashing a file the same way."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
from pathlib import Path
from typing import BinaryIO

from neuropod.errors import PackageError

#: How much is read at a time.
CHUNK = 1 << 20
# Flags absent on some systems are 0: no effect there.
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def file_kind(mode: int) -> str:
    """What a file mode is, in words: "a FIFO (named pipe)", "a symbolic link", ..."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def _not_regular(path: Path, mode: int) -> PackageError:
    what = file_kind(mode)
    if stat.S_ISLNK(mode):
        try:
            what += f" (to {os.readlink(path)!r})"
        except OSError:
            pass
    fix = "replace the link with a copy of the file" if stat.S_ISLNK(mode) else "remove it"
    return PackageError(
        f"{path} is {what}; a package may hold only regular files and directories "
        f"(links are refused, as in zip packages): {fix}"
    )


def open_regular(path: Path, *, follow_symlinks: bool = False) -> io.BufferedReader:
    """Open ``path`` for reading only if it is a regular file.

    Opening never blocks (a FIFO is opened non-blocking, then refused) and,
    unless ``follow_symlinks``, never follows a link, so a file checked by
    :func:`scan_tree` cannot be swapped for a FIFO or a link to ``/dev/zero``.

    :raises PackageError: not a regular file, or it cannot be opened.
    """
    flags = os.O_RDONLY | _O_NONBLOCK | O_CLOEXEC | (0 if follow_symlinks else O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise _not_regular(path, stat.S_IFLNK) from None
        if isinstance(e, FileNotFoundError):
            raise PackageError(f"{path} not found") from None
        raise PackageError(f"Cannot open {path}: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def scan_tree(root: Path) -> dict[str, os.stat_result]:
    """Every file under ``root`` by POSIX relative path, with its ``lstat``.

    Nothing is opened: a FIFO, device, socket or link anywhere in the tree is
    refused before any file is read.

    :raises PackageError: naming the first such path, or a directory that cannot be listed.
    """
    files: dict[str, os.stat_result] = {}
    todo = [("", root)]  # a loop, not recursion: a tree may be deeper than the stack
    while todo:
        prefix, folder = todo.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError as e:
            raise PackageError(f"Cannot list {folder}: {e.strerror}") from None
        for entry in entries:
            rel = prefix + entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as e:
                raise PackageError(f"Cannot read {entry.path}: {e.strerror}") from None
            if stat.S_ISDIR(st.st_mode):
                todo.append((rel + "/", Path(entry.path)))
            elif stat.S_ISREG(st.st_mode):
                files[rel] = st
            else:
                raise _not_regular(Path(entry.path), st.st_mode)
    return files


def hash_stream(f: io.BufferedReader, copy_to: BinaryIO | None = None) -> str:
    """The sha256 of what is left to read of ``f``, read in chunks, each also written to ``copy_to`` if given."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := f.readinto(view):
        h.update(view[:n])
        if copy_to is not None:
            copy_to.write(view[:n])
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    """The sha256 of a regular file (see :func:`open_regular`)."""
    with open_regular(path) as f:
        try:
            return hash_stream(f)
        except OSError as e:
            raise PackageError(f"Cannot read {path}: {e.strerror}") from None
