"""Package URLs: which schemes name a package to download, a URL as messages show it (and every
URL in a message so), and the URL a download is keyed by."""

from __future__ import annotations

import os
import re
from urllib.parse import unquote_plus, urlsplit, urlunsplit

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


#: Query parameters that sign a URL rather than name an object: a URL signed again (a new presigned
#: URL of the same object) differs only in them. Any parameter whose name starts so: AWS's and
#: GCS's V4 signing (``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Goog-Date``...).
_SIGNING_PREFIXES = ("x-amz-", "x-goog-")
#: The parameters of the other signing schemes, each left out only beside its signature parameter:
#: AWS's and GCS's V2 signing and CloudFront's signed URLs (``Signature``), Azure's SAS tokens (``sig``).
_SIGNING_SETS = {
    "signature": frozenset({"signature", "expires", "key-pair-id", "policy", "awsaccesskeyid", "googleaccessid"}),
    "sig": frozenset({
        "sig", "sv", "ss", "srt", "sp", "se", "st", "spr", "sip", "si", "sr", "sdd", "ses", "skoid", "sktid", "skt",
        "ske", "sks", "skv", "saoid", "suoid", "scid", "rscc", "rscd", "rsce", "rscl", "rsct",
    }),
}  # fmt: skip
#: A URL in a message (an HTTP client's exception carries the one it requested, signature and all).
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
#: A URL whose ``//`` a path normalisation collapsed (``http:/host/m?sig=...`` named as a file).
_COLLAPSED_URL_IN_TEXT = re.compile(r"\b(?:https?|s3a?|gs|gcs|az|abfss?):/(?!/)[^\s'\"<>`?#]*[?#][^\s'\"<>`]*")
#: Signing parameters outside a URL (a query quoted on its own).
_SIGNING_IN_TEXT = re.compile(
    r"(?i)(?<=[?&])(x-amz-[a-z-]*|x-goog-[a-z-]*|sig|signature|key-pair-id|policy|awsaccesskeyid|googleaccessid"
    r"|se|st|sp|sv|skoid|sktid|token|access_token|code)=[^&\s'\"<>`]*"
)


def shown(url: str) -> str:
    """``url`` as messages and records show it: without user, password, query or fragment."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:  # not a URL urllib can read (a bad port, a bracket): cut what may be secret
        scheme, _, rest = url.partition("://")
        rest = re.split(r"[?#]", rest, maxsplit=1)[0]
        return f"{scheme.lower()}://{rest.rpartition('@')[2]}"
    return urlunsplit((parts.scheme.lower(), host, parts.path, "", ""))


def redact(text: str) -> str:
    """``text`` with every URL in it as :func:`shown` shows it (no user, password, query, fragment),
    and any signing parameter quoted outside a URL without its value: for messages and log lines
    that carry another library's words (an HTTP client's exception names the URL it requested)."""
    if ":/" not in text and "=" not in text:
        return text

    def one(match: re.Match[str]) -> str:
        url = match.group(0)
        body = url.rstrip(".,;:!?)]}")
        if not any(c in body for c in "@?#"):  # nothing to hide: left as written (shown() would normalise it)
            return url
        return shown(body) + url[len(body) :]

    def collapsed(match: re.Match[str]) -> str:
        url = match.group(0)
        body = url.rstrip(".,;:!?)]}")
        return re.split(r"[?#]", body, maxsplit=1)[0] + url[len(body) :]

    text = _COLLAPSED_URL_IN_TEXT.sub(collapsed, _URL_IN_TEXT.sub(one, text))
    return _SIGNING_IN_TEXT.sub(lambda m: m.group(0).split("=", 1)[0] + "=...", text)


def download_url(url: str) -> str:
    """The URL a download is keyed by: :func:`shown`'s, and the query without the parameters that
    sign it. Two URLs that differ in their query (``?version=3``, ``?version=4``) are two packages;
    a presigned URL signed again (AWS ``X-Amz-*``, GCS ``X-Goog-*``, Azure's SAS token ``sig``, ``se``,
    ``sp``..., ``Signature``/``Expires``/``Key-Pair-Id``) is the same one. Never shown: a key is its hash."""
    try:
        query = urlsplit(url).query
    except ValueError:  # not a URL urllib can read: the store says so when it is opened
        query = ""
    if not query:
        return shown(url)
    fields = [f for f in re.split(r"[&;]", query) if f]
    names = [unquote_plus(f.split("=", 1)[0]).lower() for f in fields]
    signing = frozenset().union(*(s for k, s in _SIGNING_SETS.items() if k in names))
    kept = [f for f, n in zip(fields, names) if n not in signing and not n.startswith(_SIGNING_PREFIXES)]
    return shown(url) + ("?" + "&".join(kept) if kept else "")


def as_downloaded(error: PackageError, local: str | os.PathLike[str], url: str) -> PackageError:
    """``error``, raised for the download of ``url`` at ``local``, as a message about the URL."""
    text = str(error)
    if os.fspath(local) in text:
        return PackageError(text.replace(os.fspath(local), shown(url)))
    return PackageError(f"{text} (the package downloaded from {shown(url)})")
