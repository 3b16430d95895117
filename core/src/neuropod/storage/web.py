"""A web server's file read into a download: one streaming GET (a ranged one to resume, where the
server takes ranges), every answer conditional on and checked against the identity the download
is cached under, its bytes counted against the package limit as they arrive."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuropod import cache
from neuropod.errors import PackageError

#: Bytes read from an answer at a time.
PIECE = 1024 * 1024


class Unfit(PackageError):
    """Bytes that must not be kept: the download so far is removed, not resumed."""


class Changed(Unfit):
    """The server answered with bytes of another version than the one being downloaded."""


def denied(where: str, status: int) -> PackageError:
    """An access the server refused, with its status (401, 403)."""
    return PackageError(f"Access denied to {where} (HTTP {status}): the server refused the request; give the "
                        "URL its credentials (a signed URL, or headers in storage_options={'headers': {...}})")  # fmt: skip


def _strong_etag(info: Mapping[str, Any]) -> str | None:
    etag = str(info.get("ETag") or "")
    return etag if etag.startswith('"') else None  # a weak one (W/"...") never matches If-Match


def _conditions(info: Mapping[str, Any]) -> dict[str, str]:
    """Headers that make a GET answer only with the version ``info`` describes (412 otherwise)."""
    etag = _strong_etag(info)
    if etag:
        return {"If-Match": etag}
    if info.get("Last-Modified"):
        return {"If-Unmodified-Since": str(info["Last-Modified"])}
    return {}


def _check(headers: Mapping[str, str], info: Mapping[str, Any], status: int, where: str) -> None:
    """Refuse an answer whose validators or total size are not those of ``info``."""
    for field in ("ETag", "Last-Modified"):
        if info.get(field) and headers.get(field) and headers[field] != info[field]:
            raise Changed(f"{where} changed while it was being downloaded (its {field} was {info[field]}, an answer "
                          f"gave {headers[field]}); load it again once it is complete")  # fmt: skip
    size = info.get("size")
    if size is None:
        return
    total: str | None = None
    if status == 206:
        total = (headers.get("Content-Range") or "").rpartition("/")[2]
    elif headers.get("Content-Encoding", "identity") == "identity":
        total = headers.get("Content-Length")
    if total and total.isdigit() and int(total) != size:
        raise Changed(f"{where} changed while it was being downloaded (it was {size:,} bytes, an answer gave "
                      f"{int(total):,}); load it again once it is complete")  # fmt: skip


def copy(fs: Any, source: str, target: Path, offset: int, info: Mapping[str, Any], where: str,
         ranges: list[bool]) -> int:  # fmt: skip
    """Append the file at ``source`` from ``offset`` to ``target`` (from the start when the server
    does not take ranges); the length of ``target`` then.

    :param ranges: one flag shared by the attempts at one file: cleared once the server showed it
        does not take ranges (an answer without ``Accept-Ranges: bytes``, or a whole body for a range),
        after which every attempt starts again from the first byte.
    :raises Changed: an answer of another version (another ETag, Last-Modified or size, or 412).
    :raises Unfit: more bytes than ``NEUROPOD_MAX_PACKAGE_BYTES``.
    :raises PackageError: access denied.
    """
    import fsspec.asyn  # lazy: fsspec is the optional http extra's

    limit = cache.max_package_bytes()
    size = info.get("size")
    if not ranges[0]:
        offset = 0

    async def get() -> int:
        session = await fs.set_session()
        kwargs = {k: v for k, v in fs.kwargs.items() if k != "headers"}
        headers = {**(fs.kwargs.get("headers") or {}), "Accept-Encoding": "identity", **_conditions(info)}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        async with session.get(fs.encode_url(source), headers=headers, **kwargs) as r:
            if r.status == 404:
                raise FileNotFoundError(where)
            if r.status in (401, 403):
                raise denied(where, r.status)
            if r.status == 412:
                raise Changed(f"{where} changed while it was being downloaded (the server has another version "
                              "now); load it again once it is complete")  # fmt: skip
            r.raise_for_status()
            _check(r.headers, info, r.status, where)
            if r.headers.get("Accept-Ranges", "").lower() != "bytes" or (offset and r.status != 206):
                ranges[0] = False
            start = offset if r.status == 206 else 0
            with open(target, "r+b" if start else "wb") as out:
                out.truncate(start)
                out.seek(start)
                written = start
                async for piece in r.content.iter_chunked(PIECE):
                    written += len(piece)
                    if written > limit:
                        raise Unfit(f"{where} holds more than the {limit:,} bytes a package may hold "
                                           "(NEUROPOD_MAX_PACKAGE_BYTES)")  # fmt: skip
                    if size is not None and written > size:
                        raise OSError(errno.EFBIG, f"the file holds more than the {size:,} bytes its server listed")
                    out.write(piece)
                out.flush()
                os.fsync(out.fileno())
        return written

    written: int = fsspec.asyn.sync(fs.loop, get)
    if size is not None and written != size:
        raise OSError(errno.EIO, f"the download stopped at {written:,} of {size:,} bytes")
    return written
