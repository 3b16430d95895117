"""The object stores through fsspec: opening a URL's filesystem, what an object is (its info,
its identity, its listed MD5), listing a prefix, and a store's errors in words."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from neuropod.errors import PackageError, PluginNotInstalledError
from neuropod.storage.urls import SCHEMES, redact, shown
from neuropod.storage.web import denied

#: Bytes read and written at a time: a download holds at most about ``2 * PARALLEL + 4`` of them in
#: memory (each range read in flight twice while the HTTP client joins its body into one bytes object).
CHUNK = 16 * 1024 * 1024
#: What an object's info may hold that identifies its content, by filesystem: compared before a
#: cached download is taken and after a download, to see that the object did not change.
_IDENTITY_FIELDS = (
    "ETag", "etag", "VersionId", "version_id", "generation", "md5Hash", "Content-MD5", "content_md5",
    "LastModified", "last_modified", "Last-Modified", "updated", "mtime",
)  # fmt: skip


def open_filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
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
        raise PluginNotInstalledError(f"Loading {shown(url)} needs {distribution} ({redact(str(e))}): {hint}") from None
    if protocol in ("http", "https"):
        # Ours is the only retry; fsspec's http filesystem must not read whole files into memory.
        options.setdefault("block_size", CHUNK)
        target = url
    else:
        target = protocol + "://" + url.split("://", 1)[1]
    try:
        fs, path = fsspec.core.url_to_fs(target, **options)
    except (TypeError, ValueError) as e:
        raise PackageError(f"Cannot open {shown(url)} with these storage_options: {redact(str(e))}") from None
    return fs, path


def fs_protocol(fs: Any) -> str:
    return str(fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0])


def is_ranged(fs: Any) -> bool:
    """Whether ``fs`` is an object store, whose every object takes range reads (a web server may not)."""
    protocol = fs_protocol(fs)
    return protocol in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def object_info(fs: Any, path: str, where: str) -> dict[str, Any]:
    # fsspec keeps filesystems (and s3fs their listings) between calls: what is read here must be
    # what the store holds now, or a changed object would pass for the one downloaded before.
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    try:
        info = fs.info(path)
    except FileNotFoundError as e:
        # fsspec's web filesystem says "not found" for every failed HEAD and GET: its cause has the status.
        status = status_of(e.__cause__) if e.__cause__ is not None else None
        if status in (401, 403):
            raise denied(where, status) from None
        raise PackageError(f"No Neuropod package at {where}: {_what_is_missing(fs, path)}") from None
    except Exception as e:  # noqa: BLE001  # every filesystem raises its own: each one worded
        raise store_error(e, where, "reading what is") from None
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
            kind = "container" if fs_protocol(fs) in ("az", "abfs", "abfss") else "bucket"
            return f"the {kind} {bucket!r} does not exist (or these credentials cannot see it)"
    return "no such object or prefix"


def list_files(fs: Any, path: str, where: str) -> dict[str, dict[str, Any]]:
    """The files under the prefix ``path`` by their path relative to it, each checked to be a safe one."""
    try:
        found = fs.find(path, detail=True)
    except Exception as e:  # noqa: BLE001
        raise store_error(e, where, "listing what is") from None
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


def is_validated(identity: Mapping[str, Any]) -> bool:
    """Whether ``identity`` holds more than the size: only then may a download made earlier be reused."""
    return len(identity) > 1 and identity.get("size") is not None


def listed_md5(fs: Any, info: Mapping[str, Any]) -> str | None:
    """The MD5 (hex) of an object's bytes as its store lists it, where it surely is one: an S3
    ETag of 32 hex digits (an object uploaded whole), GCS's md5Hash, an Azure blob's Content-MD5.
    None otherwise (multipart uploads, web servers' ETags, which mean what each server likes)."""
    protocol = fs_protocol(fs)
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


def store_error(e: BaseException, where: str, doing: str) -> PackageError:
    """A filesystem's exception as a PackageError naming the URL and, for access, what to do."""
    name = type(e).__name__
    text = redact(str(e) or name)  # an HTTP client's words name the URL it requested, signature and all
    if isinstance(e, PermissionError) or status_of(e) in (401, 403) \
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


def status_of(e: BaseException) -> int | None:
    """The HTTP status an exception carries: aiohttp's ``status``, azure-core's ``status_code``, botocore's
    response metadata."""
    status = getattr(e, "status", None) or getattr(e, "status_code", None)
    response = getattr(e, "response", None)
    if status is None and isinstance(response, Mapping):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None
