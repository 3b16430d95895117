"""Package URLs: which schemes name a package to download, and a URL as messages show it."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from neuropod.errors import PackageError

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


def as_downloaded(error: PackageError, local: str | os.PathLike[str], url: str) -> PackageError:
    """``error``, raised for the download of ``url`` at ``local``, as a message about the URL."""
    text = str(error)
    if os.fspath(local) in text:
        return PackageError(text.replace(os.fspath(local), shown(url)))
    return PackageError(f"{text} (the package downloaded from {shown(url)})")
