"""Range reads of an object store's object tied to the version a download is cached under: each
read is conditional on that version (S3: ``If-Match`` its ETag, and its VersionId; GCS:
``ifGenerationMatch`` its generation; Azure: ``If-Match`` its ETag) and its answer checked against
it, so that a store (or a load balancer in front of one) answering a read from another version
gives :class:`~neuropod.storage.web.Changed`, never those bytes.

Where a filesystem's internals are not what these use (an older s3fs, gcsfs or adlfs), no reader
is made: the download reads plainly and relies on the listed MD5 and the check after it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from neuropod.storage.stores import fs_protocol, status_of
from neuropod.storage.web import Changed

#: Bytes ``[start, end)`` of the object, from the version the reader was made for.
Read = Callable[[int, int], bytes]


def ranged_reader(fs: Any, source: str, info: Mapping[str, Any], where: str) -> Read | None:
    """A function reading ranges of ``source`` from the version ``info`` describes (thread-safe, each
    call one request); None where the store or its filesystem gives no way to (then plain reads)."""
    protocol = fs_protocol(fs)
    try:
        if protocol in ("s3", "s3a"):
            return _s3(fs, source, info, where)
        if protocol in ("gs", "gcs"):
            return _gcs(fs, source, info, where)
        if protocol in ("az", "abfs", "abfss"):
            return _azure(fs, source, info, where)
    except Exception:  # noqa: BLE001  # a filesystem whose internals differ: plain reads, checked after
        return None
    return None


def _changed(where: str, what: str) -> Changed:
    return Changed(f"{where} changed while it was being downloaded ({what}); load it again once it is complete")


def _bare(etag: Any) -> str:
    """An ETag without its quotes (stores and their clients differ in keeping them)."""
    return str(etag or "").removeprefix("W/").strip('"')


def _sync(fs: Any, coroutine: Callable[[], Any]) -> Any:
    import fsspec.asyn  # lazy: fsspec is a storage extra's

    return fsspec.asyn.sync(fs.loop, coroutine)


def _refused(e: BaseException) -> bool:
    """Whether ``e`` (or what it was raised from) is a store's 412: a precondition not met."""
    seen: BaseException | None = e
    for _ in range(4):
        if seen is None:
            return False
        response = getattr(seen, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, Mapping) else None
        if status_of(seen) == 412 or code in ("PreconditionFailed", "ConditionNotMet"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _check_total(headers: Mapping[str, Any], size: Any, where: str, field: str = "ContentRange") -> None:
    total = str(headers.get(field) or "").rpartition("/")[2]
    if isinstance(size, int) and total.isdigit() and int(total) != size:
        raise _changed(where, f"it was {size:,} bytes, a range read gave {int(total):,}")


def _s3(fs: Any, source: str, info: Mapping[str, Any], where: str) -> Read | None:
    """GetObject with ``Range``, ``If-Match`` the ETag (and the VersionId the info names), through
    s3fs's own call (its credentials, retries and extra arguments)."""
    call = getattr(fs, "_call_s3", None)
    etag = str(info.get("ETag") or "")
    if call is None or not hasattr(fs, "split_path") or not _bare(etag):
        return None
    bucket, key, version = fs.split_path(source)
    version = version or info.get("VersionId")
    pin = {"VersionId": version} if version and version != "null" else {}
    size = info.get("size")

    def read(start: int, end: int) -> bytes:
        async def get() -> bytes:
            resp = await call("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=etag,
                              **pin)  # fmt: skip
            try:
                if _bare(resp.get("ETag")) != _bare(etag):
                    raise _changed(where, f"its ETag was {etag}, a range read gave {resp.get('ETag')}")
                _check_total(resp, size, where)
                return bytes(await resp["Body"].read())
            finally:
                resp["Body"].close()

        try:
            return bytes(_sync(fs, get))
        except Changed:
            raise
        except Exception as e:
            if _refused(e):
                raise _changed(where, f"the store has another version than ETag {etag} now") from None
            raise

    return read


def _gcs(fs: Any, source: str, info: Mapping[str, Any], where: str) -> Read | None:
    """A media GET with ``Range`` and ``ifGenerationMatch`` the generation (none when the URL names a
    generation: that one never changes), its ``x-goog-generation`` checked, through gcsfs's call."""
    call = getattr(fs, "_call", None)
    generation = str(info.get("generation") or "")
    if call is None or not hasattr(fs, "url") or not hasattr(fs, "split_path") or not generation:
        return None
    _, _, named = fs.split_path(source)
    url = fs.url(source) + ("" if named else f"&ifGenerationMatch={generation}")
    size = info.get("size")

    def read(start: int, end: int) -> bytes:
        async def get() -> bytes:
            headers, data = await call("GET", url, headers={"Range": f"bytes={start}-{end - 1}"})
            got = headers.get("x-goog-generation")
            if got and str(got) != generation:
                raise _changed(where, f"its generation was {generation}, a range read gave {got}")
            _check_total(headers, size, where, "Content-Range")
            return bytes(data)

        try:
            return bytes(_sync(fs, get))
        except Changed:
            raise
        except FileExistsError:  # gcsfs's word for a 412
            raise _changed(where, f"the store has another generation than {generation} now") from None
        except Exception as e:
            if _refused(e):
                raise _changed(where, f"the store has another generation than {generation} now") from None
            raise

    return read


def _azure(fs: Any, source: str, info: Mapping[str, Any], where: str) -> Read | None:
    """Download Blob with an offset and length, ``If-Match`` the ETag, the answer's ETag checked,
    through adlfs's service client (its credentials and timeouts)."""
    client = getattr(fs, "service_client", None)
    etag = str(info.get("etag") or info.get("ETag") or "")
    if client is None or not hasattr(fs, "split_path") or not _bare(etag):
        return None
    # lazy: azure-core is the azure extra's (not installed where the types are checked)
    from azure.core import MatchConditions  # type: ignore[import-not-found, unused-ignore]

    container, blob, version = fs.split_path(source)
    options = dict(getattr(fs, "_timeout_kwargs", None) or {})
    with contextlib.suppress(AttributeError):
        options["max_concurrency"] = fs.max_concurrency or 1

    def read(start: int, end: int) -> bytes:
        async def get() -> bytes:
            async with fs.service_client.get_blob_client(container=container, blob=blob) as bc:
                stream = await bc.download_blob(offset=start, length=end - start, version_id=version, etag=etag,
                                                match_condition=MatchConditions.IfNotModified, **options)  # fmt: skip
                got = getattr(getattr(stream, "properties", None), "etag", None)
                if got and _bare(got) != _bare(etag):
                    raise _changed(where, f"its ETag was {etag}, a range read gave {got}")
                return bytes(await stream.readall())

        try:
            return bytes(_sync(fs, get))
        except Changed:
            raise
        except Exception as e:
            if status_of(e) == 404:  # azure-core's ResourceNotFoundError
                raise FileNotFoundError(where) from None
            if _refused(e):
                raise _changed(where, f"the store has another version than ETag {etag} now") from None
            raise

    return read
